//! Alloc+free pairs of one size on the simulated device, timed on the host:
//! for profiling the thread cache's hit path (the GPU bench's "pair" case).
//!
//! ```text
//! cargo run -p lab --release --bin pair_ops -- [SIZE] [PAIRS] [CONFIG]
//! ```
//! Defaults: 512 bytes, 10 000 000 pairs, `default` (after 1 000 warm-up pairs).

use cachealloc_core::{CachingAllocator, SimulatedDevice, StreamId};
use lab::arg;
use std::hint::black_box;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let size: u64 = arg(&args, 0, "SIZE", 512);
    let n: u64 = arg(&args, 1, "PAIRS", 10_000_000);
    let config = lab::config_arg(&args, 2, "default");
    let a = CachingAllocator::new(SimulatedDevice::unlimited(), config);
    for _ in 0..1000 {
        let p = a.malloc(size, StreamId(0)).expect("malloc");
        a.free(p).expect("free");
    }
    let t = Instant::now();
    for _ in 0..n {
        let p = a.malloc(black_box(size), StreamId(0)).expect("malloc");
        a.free(black_box(p)).expect("free");
    }
    println!(
        "{size} B: {:.1} ns per alloc+free pair",
        t.elapsed().as_nanos() as f64 / n as f64
    );
}
