//! Replays a trace on a simulated device of a given capacity and, at the
//! first allocation that fails even after flush-and-retry, prints the
//! out-of-memory report and every segment with free blocks (`_` marks a
//! free block; sizes in MiB): why a layout needs a bigger device.
//!
//! ```text
//! cargo run -p lab --release --bin oom_dump -- TRACE.gz CONF CAPACITY_BYTES
//! ```
use cachealloc_core::{CachingAllocator, SimulatedDevice, StreamId, TraceEvent};
use std::collections::HashMap;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: oom_dump TRACE.gz CONF CAPACITY_BYTES");
        std::process::exit(2);
    }
    let config = lab::config_arg(&args, 2, "default");
    let capacity: u64 = lab::arg(&args, 3, "capacity", 0);
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
    // Per pool: segments, bytes, free bytes.
    let mut by_pool: HashMap<String, (u64, u64, u64)> = HashMap::new();
    for s in &a.snapshot().segments {
        let (free, line) = lab::segment_line(s);
        let e = by_pool.entry(format!("{:?}", s.pool)).or_default();
        *e = (e.0 + 1, e.1 + s.total_size, e.2 + free);
        if free > 0 && s.total_size > (2 << 20) {
            println!("{line}");
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
