//! Replays a trace on a simulated device of a given capacity and, at the
//! first allocation that fails even after flush-and-retry, prints the
//! out-of-memory report and every segment with free blocks (`_` marks a
//! free block; sizes in MiB), and for an expandable range how much of its
//! mapped memory lies under allocated blocks: why a layout needs a bigger device.
//!
//! ```text
//! cargo run -p lab --release --bin oom_dump -- TRACE.gz CONF CAPACITY_BYTES [EVENT]
//! ```
use cachealloc_core::{
    BlockState, CachingAllocator, SegmentSnapshot, SimulatedDevice, StreamId, TraceEvent,
};
use std::collections::{BTreeSet, HashMap};

const MIB: f64 = 1048576.0;
/// The simulated device's mapping granularity.
const GRANULE: u64 = 2 << 20;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 && args.len() != 5 {
        eprintln!("usage: oom_dump TRACE.gz CONF CAPACITY_BYTES [EVENT]");
        std::process::exit(2);
    }
    let config = lab::config_arg(&args, 2, "default");
    let capacity: u64 = lab::arg(&args, 3, "capacity", 0);
    // With an event index, the layout is printed just before that event
    // even if nothing fails (to compare configurations at one point).
    let stop_at: usize = lab::arg(&args, 4, "event", usize::MAX);
    let events = lab::load_trace(&args[1]);
    let a = CachingAllocator::new(
        SimulatedDevice::new(capacity).with_auto_complete(true),
        config,
    );
    let mut live = HashMap::new();
    for (i, e) in events.iter().enumerate() {
        if i == stop_at {
            println!("event {i}: {:?}", a.usage());
            break;
        }
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
    // Reserved beyond what the segments map: pooled pages (expandable) or
    // pages created for the request that failed.
    let snap = a.snapshot();
    let mapped: u64 = snap.segments.iter().map(|s| s.mapped_size).sum();
    println!(
        "usage {:?}; mapped in segments {:.1} MiB",
        a.usage(),
        mapped as f64 / MIB
    );
    let mut by_pool: HashMap<String, (u64, u64, u64)> = HashMap::new();
    for s in &snap.segments {
        let (free, line) = lab::segment_line(s);
        let e = by_pool.entry(format!("{:?}", s.pool)).or_default();
        *e = (e.0 + 1, e.1 + s.total_size, e.2 + free);
        if s.mapped_size < s.total_size {
            // An expandable range: how much of what is mapped lies under
            // allocated blocks (the rest could move where it is needed).
            println!(
                "range {:?} {:?}: mapped {:.1} MiB, pages under allocated blocks {:.1} MiB, allocated {:.1} MiB, {} blocks",
                s.stream,
                s.pool,
                s.mapped_size as f64 / MIB,
                pages_in_use(s) as f64 / MIB,
                s.allocated_size as f64 / MIB,
                s.blocks.len()
            );
        }
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

/// Bytes of the granules that allocated blocks of `s` touch.
fn pages_in_use(s: &SegmentSnapshot) -> u64 {
    let mut pages = BTreeSet::new();
    for b in s.blocks.iter().filter(|b| b.state != BlockState::Free) {
        pages.extend(b.address.0 / GRANULE..(b.address.0 + b.size).div_ceil(GRANULE));
    }
    pages.len() as u64 * GRANULE
}
