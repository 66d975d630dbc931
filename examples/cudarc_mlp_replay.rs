//! The allocation sequence of `examples/cudarc_mlp.rs` (same batch sizes,
//! same order of allocations and frees, one stream) replayed through the
//! caching allocator on the simulated device (2 MiB pages, like an H100), to
//! see each configuration's peak reserved memory without a GPU. On one stream
//! the allocator's decisions do not depend on timing, so the peaks are the
//! ones the GPU run reports.
//!
//! ```text
//! cargo run --release --example cudarc_mlp_replay -- [STEPS] [HIDDEN] [MAX_BATCH] [ROUNDS] [CONF...]
//! ```
//! (defaults 200 2048 2048 3, and the presets default, pytorch, expandable).

use cachealloc::{CachingAllocator, Config, DevicePtr, SimulatedDevice, StreamId};

/// The example's batch-size generator.
struct Lcg(u64);

impl Lcg {
    fn next_u32(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, d: u64| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(d);
    let (steps, hidden, max_batch, rounds) = (num(0, 200), num(1, 2048), num(2, 2048), num(3, 3));
    let mut confs: Vec<&str> = args.iter().skip(4).map(String::as_str).collect();
    if confs.is_empty() {
        confs = vec!["default", "pytorch", "expandable"];
    }
    let sizes = [256u64, hidden, hidden, 10];
    println!("MLP {sizes:?}, {rounds} rounds of {steps} steps, batch 32..={max_batch}");
    for conf in confs {
        let a = CachingAllocator::new(SimulatedDevice::unlimited(), Config::parse(conf)?);
        let s = StreamId(1);
        let m = |bytes: u64| a.malloc(bytes, s);
        let f = |p: DevicePtr| a.free(p);
        for _ in 0..rounds {
            // Parameters: per layer W then b (f32).
            let mut params = Vec::new();
            for io in sizes.windows(2) {
                params.push(m(io[0] * io[1] * 4)?);
                params.push(m(io[1] * 4)?);
            }
            for step in 0..steps {
                let rows = 32 + u64::from(Lcg(1000 + step).next_u32()) % (max_batch - 31);
                let x = m(rows * 256 * 4)?;
                let y = m(rows * 4)?;
                let mut acts = vec![x];
                for io in sizes.windows(2) {
                    acts.push(m(rows * io[1] * 4)?);
                }
                let loss = m(rows * 4)?;
                let mut grad = m(rows * 10 * 4)?;
                for i in (0..3).rev() {
                    let (inp, out) = (sizes[i], sizes[i + 1]);
                    let dw = m(out * inp * 4)?;
                    let db = m(out * 4)?;
                    if i > 0 {
                        let da = m(rows * inp * 4)?;
                        f(std::mem::replace(&mut grad, da))?;
                    }
                    f(db)?;
                    f(dw)?;
                }
                // The step's locals, in Rust's drop order.
                f(grad)?;
                f(loss)?;
                for p in acts {
                    f(p)?;
                }
                f(y)?;
            }
            for p in params {
                f(p)?;
            }
        }
        let st = a.stats();
        println!(
            "{conf:<24} peak reserved {:>8.1} MiB   peak allocated {:>8.1} MiB",
            st.reserved_bytes.all().peak as f64 / (1u64 << 20) as f64,
            st.allocated_bytes.all().peak as f64 / (1u64 << 20) as f64
        );
    }
    Ok(())
}
