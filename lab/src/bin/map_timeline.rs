//! Prints, per window of a replay, the page maps and unmaps made in it with
//! the allocated, peak allocated and reserved bytes at its end: where in a
//! trace an expandable configuration moves pages.
//!
//! ```text
//! cargo run -p lab --release --bin map_timeline -- TRACE.gz [CONF] [WINDOWS]
//! ```
use cachealloc_core::{CachingAllocator, SimulatedDevice, StreamId, TraceEvent};
use std::collections::HashMap;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if !(2..=4).contains(&args.len()) {
        eprintln!("usage: map_timeline TRACE.gz [CONF (default: expandable)] [WINDOWS]");
        std::process::exit(2);
    }
    let config = lab::config_arg(&args, 2, "expandable");
    let windows: usize = lab::arg(&args, 3, "windows", 40);
    if windows == 0 {
        eprintln!("windows: at least 1");
        std::process::exit(2);
    }
    let events = lab::load_trace(&args[1]);
    let per = events.len().div_ceil(windows).max(1);
    let a = CachingAllocator::new(
        SimulatedDevice::unlimited().with_auto_complete(true),
        config,
    );
    let mut live = HashMap::new();
    let (mut maps, mut unmaps, mut creates) = (0, 0, 0);
    let mib = |b: u64| b as f64 / 1048576.0;
    println!("events      maps  unmaps  creates  allocated  peak_alloc  reserved  (MiB)");
    for (i, e) in events.iter().enumerate() {
        match *e {
            TraceEvent::Alloc { id, bytes, stream } => {
                live.insert(id, a.malloc(bytes, StreamId(stream)).unwrap());
            }
            TraceEvent::Free { id } => a.free(live.remove(&id).unwrap()).unwrap(),
            TraceEvent::EmptyCache => {
                a.empty_cache().unwrap();
            }
        }
        if (i + 1) % per == 0 || i + 1 == events.len() {
            let c = a.device().counters();
            let s = a.stats();
            println!(
                "{:>9} {:>6} {:>7} {:>8} {:>10.0} {:>11.0} {:>9.0}",
                i + 1,
                c.vmm_maps - maps,
                c.vmm_unmaps - unmaps,
                c.vmm_creates - creates,
                mib(s.allocated_bytes.all().current),
                mib(s.allocated_bytes.all().peak),
                mib(s.reserved_bytes.all().current),
            );
            (maps, unmaps, creates) = (c.vmm_maps, c.vmm_unmaps, c.vmm_creates);
        }
    }
}
