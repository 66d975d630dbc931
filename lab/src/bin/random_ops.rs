//! Random alloc/free ops on the simulated device, the mix of the GPU bench's
//! "random ops" case, timed on the host: for profiling the core path.
//!
//! ```text
//! cargo run -p lab --release --bin random_ops -- [SLOTS] [MAX_MIB] [CONFIG] [OPS]
//! ```
//! Defaults: 256 slots, 8 MiB, `default`, 2 000 000 ops (after as many warm-up ops);
//! the environment variable `SEED` picks the plan (default 1).

use cachealloc_core::{CachingAllocator, DevicePtr, SimulatedDevice, StreamId};
use lab::{arg, random_plan, MIB};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let slots: usize = arg(&args, 0, "SLOTS", 256);
    let max_mib: u64 = arg(&args, 1, "MAX_MIB", 8);
    let config = lab::config_arg(&args, 2, "default");
    let ops: usize = arg(&args, 3, "OPS", 2_000_000);

    let alloc = CachingAllocator::new(SimulatedDevice::unlimited(), config);
    // The GPU bench's plan: `SEED=1` (256 slots) and `SEED=2` (4096 slots) there.
    let seed: u64 = std::env::var("SEED").map_or(1, |s| s.parse().expect("SEED"));
    let plan = random_plan(slots, max_mib * MIB, ops, seed);
    let mut live: Vec<Option<DevicePtr>> = vec![None; slots];
    let run = |live: &mut Vec<Option<DevicePtr>>| {
        for &(slot, size) in &plan {
            match live[slot].take() {
                Some(p) => alloc.free(p).expect("free"),
                None => live[slot] = Some(alloc.malloc(size, StreamId(0)).expect("malloc")),
            }
        }
    };
    run(&mut live);
    let before = alloc.device().counters();
    let t0 = Instant::now();
    run(&mut live);
    let ns = t0.elapsed().as_nanos() as f64 / ops as f64;
    let c = alloc.device().counters();
    println!(
        "{slots} slots, <= {max_mib} MiB, {ops} ops: {ns:.1} ns/op (device allocs {}, frees {}; in the timed pass {} and {})",
        c.allocs,
        c.frees,
        c.allocs - before.allocs,
        c.frees - before.frees
    );
}
