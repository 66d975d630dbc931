//! Replays a trace on a simulated device of a given capacity and, at the
//! first allocation that fails even after flush-and-retry, prints the
//! out-of-memory report and every segment with free blocks (`_` marks a
//! free block; sizes in MiB): why a layout needs a bigger device.
//!
//! ```text
//! cargo run -p lab --release --bin oom_dump -- TRACE.gz CONF CAPACITY_BYTES
//! ```
use cachealloc_core::{
    BlockState, CachingAllocator, Config, SimulatedDevice, StreamId, TraceEvent,
};
use std::collections::HashMap;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: oom_dump TRACE.gz CONF CAPACITY_BYTES");
        std::process::exit(2);
    }
    let config = Config::parse(&args[2]).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    let capacity: u64 = args[3].parse().unwrap_or_else(|e| {
        eprintln!("capacity: {e}");
        std::process::exit(2)
    });
    let events = lab::load_trace(&args[1]);
    let a = CachingAllocator::new(SimulatedDevice::new(capacity), config);
    let mut live = HashMap::new();
    for (i, e) in events.iter().enumerate() {
        match *e {
            TraceEvent::Alloc { id, bytes, stream } => match a.malloc(bytes, StreamId(stream)) {
                Ok(p) => {
                    live.insert(id, p);
                }
                Err(err) => {
                    println!("event {i}: {err}");
                    break;
                }
            },
            TraceEvent::Free { id } => a.free(live.remove(&id).unwrap()).unwrap(),
            TraceEvent::EmptyCache => {
                a.empty_cache().unwrap();
            }
        }
    }
    let snap = a.snapshot();
    let mut by_pool: HashMap<String, (u64, u64, u64)> = HashMap::new();
    for s in &snap.segments {
        let free: u64 = s
            .blocks
            .iter()
            .filter(|b| b.state == BlockState::Free)
            .map(|b| b.size)
            .sum();
        let e = by_pool.entry(format!("{:?}", s.pool)).or_default();
        e.0 += 1;
        e.1 += s.total_size;
        e.2 += free;
        if free > 0 && s.total_size > (2 << 20) {
            let blocks: Vec<String> = s
                .blocks
                .iter()
                .map(|b| {
                    format!(
                        "{}{:.1}",
                        if b.state == BlockState::Free { "_" } else { "" },
                        b.size as f64 / 1048576.0
                    )
                })
                .collect();
            println!(
                "seg {:>7.1} MiB free {:>6.1}: {}",
                s.total_size as f64 / 1048576.0,
                free as f64 / 1048576.0,
                blocks.join(" ")
            );
        }
    }
    for (pool, (n, total, free)) in by_pool {
        println!(
            "{pool}: {n} segments, {:.1} MiB, {:.1} MiB free",
            total as f64 / 1048576.0,
            free as f64 / 1048576.0
        );
    }
}
