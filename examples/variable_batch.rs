//! A variable-batch-shape loop on the GPU, as a transformer's activations
//! look to an allocator: every step draws a new batch size and sequence
//! length, runs a forward pass that keeps each layer's activations for the
//! backward pass (queries, keys, values, attention scores, MLP hidden),
//! frees the temporaries as it goes, then a backward pass that frees the
//! saved activations in reverse while allocating gradients. Every buffer is
//! written on the GPU (`cuMemsetD32Async`), so the memory is really touched.
//!
//! At the end it prints the allocator's statistics (PyTorch's
//! `memory_stats()` keys) and the fragmentation report.
//!
//! ```text
//! cargo run --release --features cuda --example variable_batch -- [STEPS] [SEED]
//! CACHEALLOC_CONF=pytorch cargo run --release --features cuda --example variable_batch
//! ```

use cachealloc::cuda::{self, driver::Stream, CachedBuffer, CudaDevice};
use cachealloc::{CachingAllocator, StreamId};
use std::time::Instant;

const LAYERS: usize = 8;
const HIDDEN: usize = 1024;
const HEADS: usize = 16;
const MAX_BATCH: u64 = 32;
const MAX_SEQ: u64 = 512;

type Alloc = &'static CachingAllocator<CudaDevice>;

/// A tensor of f32 values, written with `tag` on the stream.
fn tensor(alloc: Alloc, len: usize, stream: StreamId, tag: u32) -> CachedBuffer<f32> {
    // SAFETY: filled right below, on the same stream, before anything reads it.
    let mut t = unsafe { CachedBuffer::uninitialized(alloc, len, stream) }.expect("alloc");
    t.fill_u32(tag).expect("memset");
    t
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let steps: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(300);
    let mut seed: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(42);
    let mut rand = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };

    let alloc = cuda::allocator(0)?;
    alloc.device().bind_thread()?;
    let stream = Stream::new(alloc.device())?;
    let s = stream.id();
    println!(
        "device 0: {}  config: {}  steps: {steps}",
        alloc.device().name(),
        alloc.config().to_conf_string()
    );

    let t0 = Instant::now();
    let mut requests = 0u64;
    for step in 0..steps {
        let batch = 1 + rand() % MAX_BATCH;
        let seq = 16 + rand() % (MAX_SEQ - 15);
        let tokens = (batch * seq) as usize;
        let tag = step as u32;
        let x = tensor(alloc, tokens * HIDDEN, s, tag);
        let mut saved: Vec<CachedBuffer<f32>> = vec![x];
        // forward
        for _ in 0..LAYERS {
            let q = tensor(alloc, tokens * HIDDEN, s, tag);
            let k = tensor(alloc, tokens * HIDDEN, s, tag);
            let v = tensor(alloc, tokens * HIDDEN, s, tag);
            let scores = tensor(alloc, batch as usize * HEADS * (seq * seq) as usize, s, tag);
            let attn_out = tensor(alloc, tokens * HIDDEN, s, tag);
            let proj = tensor(alloc, tokens * HIDDEN, s, tag); // temporary
            drop(proj);
            let mlp_hidden = tensor(alloc, tokens * 4 * HIDDEN, s, tag);
            let mlp_out = tensor(alloc, tokens * HIDDEN, s, tag);
            saved.extend([q, k, v, scores, attn_out, mlp_hidden, mlp_out]);
            requests += 8;
        }
        let logits = tensor(alloc, tokens * 4096, s, tag);
        requests += 2;
        drop(logits);
        // backward: gradients allocated while the saved activations go, in reverse
        let mut grad = tensor(alloc, tokens * HIDDEN, s, tag);
        while let Some(act) = saved.pop() {
            let g = tensor(alloc, act.len(), s, tag);
            requests += 1;
            drop(act);
            if g.len() == tokens * HIDDEN {
                grad = g;
            }
        }
        drop(grad);
        if (step + 1) % 50 == 0 {
            stream.synchronize()?;
            let u = alloc.usage();
            println!(
                "step {:4}: batch {batch:2} seq {seq:3}  reserved {:8.1} MiB  allocated {:6.1} MiB  {:.2} ms/step",
                step + 1,
                u.reserved as f64 / 1048576.0,
                u.allocated as f64 / 1048576.0,
                t0.elapsed().as_secs_f64() * 1e3 / (step + 1) as f64
            );
        }
    }
    stream.synchronize()?;
    let secs = t0.elapsed().as_secs_f64();

    let st = alloc.stats();
    println!("\n{steps} steps, {requests} allocations in {secs:.2} s");
    println!("memory_stats (PyTorch keys):");
    for (key, value) in st.entries() {
        if key.starts_with("allocated_bytes.all")
            || key.starts_with("reserved_bytes.all")
            || key.starts_with("segment.all")
            || key.starts_with("allocation.all")
            || key.starts_with("inactive_split_bytes.all")
            || key.starts_with("num_")
        {
            println!("  {key:40} {value}");
        }
    }
    let peak_alloc = st.allocated_bytes.all().peak;
    let peak_res = st.reserved_bytes.all().peak;
    println!(
        "peak reserved / peak allocated = {:.3} ({:.1} / {:.1} MiB); driver allocations: {} for {requests} requests",
        peak_res as f64 / peak_alloc.max(1) as f64,
        peak_res as f64 / 1048576.0,
        peak_alloc as f64 / 1048576.0,
        st.num_device_alloc,
    );
    println!("\nfragmentation at the end:\n{}", alloc.fragmentation());
    let released = alloc.empty_cache()?;
    println!(
        "empty_cache released {:.1} MiB in {} segments",
        released.bytes as f64 / 1048576.0,
        released.segments
    );
    Ok(())
}
