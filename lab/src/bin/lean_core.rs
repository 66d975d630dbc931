//! How fast can the core's algorithm go? Times the lean path
//! ([`lab::lean`]) on the random-op plan of the GPU latency benchmark, next
//! to the real allocator.
//!
//! ```text
//! cargo run -p lab --release --bin lean_core -- [SLOTS] [MAX_MIB] [OPS] [lean|core|null|check|slab:KIB]
//! ```
//! Defaults: 256 slots, 8 MiB, 2 000 000 ops, `lean`; the environment
//! variable `SEED` picks the plan (default 1). `core` times the real
//! allocator (the `pytorch` configuration, which makes the same decisions as
//! `default` on this mix but has no thread caches), `null` the loop alone.
//! `check` runs both on the same plan and fails unless every allocation lands
//! at the same address, with the same device calls. `slab:KIB` is the lean
//! path with slabs for requests of at most KIB (at most 1024).

use cachealloc_core::SLAB_MAX;
use cachealloc_core::{CachingAllocator, Config, DevicePtr, SimulatedDevice, StreamId};
use lab::lean::{check, Lean, GRANULE};
use lab::{arg, random_plan, MIB};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let slots: usize = arg(&args, 0, "SLOTS", 256);
    let max_mib: u64 = arg(&args, 1, "MAX_MIB", 8);
    let ops: usize = arg(&args, 2, "OPS", 2_000_000);
    let mode_arg = args.get(3).map_or("lean", String::as_str);
    // `slab:KIB` is the lean path with slabs for requests up to KIB.
    let (mode, slab_limit) = match mode_arg.split_once(':') {
        Some(("slab", kib)) => match kib.parse::<u64>() {
            Ok(kib) if kib * 1024 <= SLAB_MAX => ("lean", kib * 1024),
            _ => {
                eprintln!("slab:KIB takes a number of KiB up to 1024, got {kib:?}");
                std::process::exit(2)
            }
        },
        _ => (mode_arg, 0),
    };
    let seed: u64 = std::env::var("SEED").map_or(1, |s| s.parse().expect("SEED, a number"));
    let plan = random_plan(slots, max_mib * MIB, ops, seed);

    let lean = Lean::with_slabs(SimulatedDevice::unlimited(), slab_limit);
    let core = CachingAllocator::new(SimulatedDevice::unlimited(), Config::pytorch());
    match mode {
        "check" => println!("{}", check(&plan, slots)),
        "lean" | "core" | "null" => {
            let mut live: Vec<Option<DevicePtr>> = vec![None; slots];
            // `null`: the loop alone (a bump pointer, frees ignored), the floor under both.
            let bump = std::cell::Cell::new(1u64 << 40);
            let run = |live: &mut Vec<Option<DevicePtr>>| {
                for &(slot, size) in &plan {
                    match live[slot].take() {
                        Some(p) if mode == "lean" => lean.free(p),
                        Some(p) if mode == "core" => core.free(p).expect("free"),
                        Some(p) => {
                            std::hint::black_box(p);
                        }
                        None if mode == "lean" => live[slot] = Some(lean.malloc(size)),
                        None if mode == "core" => {
                            live[slot] = Some(core.malloc(size, StreamId(0)).expect("malloc"))
                        }
                        None => {
                            let p = bump.get();
                            bump.set(p + size.div_ceil(GRANULE) * GRANULE);
                            live[slot] = Some(DevicePtr(std::hint::black_box(p)));
                        }
                    }
                }
            };
            run(&mut live);
            let t0 = Instant::now();
            run(&mut live);
            let ns = t0.elapsed().as_nanos() as f64 / ops as f64;
            println!("{mode_arg}: {slots} slots, <= {max_mib} MiB, {ops} ops: {ns:.1} ns/op");
        }
        other => {
            eprintln!("mode {other:?}: lean, core, null, check or slab:KIB");
            std::process::exit(2)
        }
    }
}
