//! Replays a trace and prints every event that made device calls: the
//! event, the request size, and the allocations and frees it caused (MiB),
//! to see where a policy gives memory back and takes it again.
//!
//! ```text
//! cargo run -p lab --release --bin call_log -- TRACE.gz [CONF]
//! ```
use cachealloc_core::{CachingAllocator, SimulatedDevice, StreamId, TraceEvent};
use std::collections::HashMap;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 2 && args.len() != 3 {
        eprintln!("usage: call_log TRACE.gz [CONF]");
        std::process::exit(2);
    }
    let config = lab::config_arg(&args, 2, "default");
    let events = lab::load_trace(&args[1]);
    let a = CachingAllocator::new(
        SimulatedDevice::unlimited().with_auto_complete(true),
        config,
    );
    let mut live = HashMap::new();
    let mut sizes = HashMap::new();
    let (mut na, mut nf) = (0u64, 0u64);
    for (i, e) in events.iter().enumerate() {
        let what = match *e {
            TraceEvent::Alloc { id, bytes, stream } => {
                live.insert(id, a.malloc(bytes, StreamId(stream)).unwrap());
                sizes.insert(id, bytes);
                format!("a {:.1}", bytes as f64 / 1048576.0)
            }
            TraceEvent::Free { id } => {
                a.free(live.remove(&id).unwrap()).unwrap();
                format!("f {:.1}", sizes[&id] as f64 / 1048576.0)
            }
            TraceEvent::EmptyCache => {
                a.empty_cache().unwrap();
                "e".into()
            }
        };
        let s = a.stats();
        let (da, df) = (s.num_device_alloc - na, s.num_device_free - nf);
        (na, nf) = (s.num_device_alloc, s.num_device_free);
        if da + df > 0 {
            println!(
                "{i} {what}: +{da} -{df} reserved {:.1}",
                a.usage().reserved as f64 / 1048576.0
            );
        }
    }
}
