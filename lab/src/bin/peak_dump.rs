//! Dumps the segment map at the reserved peak of a replay: the
//! fragmentation report, then every segment over 16 MiB with free blocks
//! (`_` marks a free block; sizes in MiB).
//!
//! ```text
//! cargo run -p lab --release --bin peak_dump -- TRACE.gz CONF
//! ```
use cachealloc_core::replay::{replay, ReplayOptions};
use cachealloc_core::{CachingAllocator, Config, SimulatedDevice, StreamId, TraceEvent};
use std::collections::HashMap;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: peak_dump TRACE.gz CONF");
        std::process::exit(2);
    }
    let config = Config::parse(&args[2]).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    let events = lab::load_trace(&args[1]);
    let opts = ReplayOptions {
        report_at_peak: false,
        ..Default::default()
    };
    let r = replay(|| Ok(events.iter().copied().map(Ok)), &config, opts).unwrap();
    let a = CachingAllocator::new(
        SimulatedDevice::unlimited().with_auto_complete(true),
        config,
    );
    let mut live = HashMap::new();
    for (i, e) in events.iter().enumerate() {
        match *e {
            TraceEvent::Alloc { id, bytes, stream } => {
                if i as u64 == r.peak_reserved_event {
                    println!(
                        "peak event {i}: alloc {:.1} MiB; before: {:?}",
                        bytes as f64 / 1048576.0,
                        a.usage()
                    );
                }
                live.insert(id, a.malloc(bytes, StreamId(stream)).unwrap());
            }
            TraceEvent::Free { id } => a.free(live.remove(&id).unwrap()).unwrap(),
            TraceEvent::EmptyCache => {
                a.empty_cache().unwrap();
            }
        }
        if i as u64 == r.peak_reserved_event {
            break;
        }
    }
    print!("{}", a.fragmentation());
    if a.is_expandable() {
        return;
    }
    let snap = a.snapshot();
    // Per stream and pool: segments, reserved, allocated (MiB).
    let mut per: std::collections::BTreeMap<String, (u32, u64, u64)> = Default::default();
    for s in &snap.segments {
        let e = per
            .entry(format!("{:?} {:?}", s.stream, s.pool))
            .or_default();
        *e = (e.0 + 1, e.1 + s.total_size, e.2 + s.allocated_size);
    }
    for (k, (n, total, used)) in per {
        println!(
            "{k}: {n} segments, {:.1} MiB, allocated {:.1} MiB, free {:.1} MiB",
            total as f64 / 1048576.0,
            used as f64 / 1048576.0,
            (total - used) as f64 / 1048576.0
        );
    }
    for s in snap.segments.iter().filter(|s| s.total_size > (16 << 20)) {
        let (free, line) = lab::segment_line(s);
        if free > 0 {
            println!("{line}");
        }
    }
}
