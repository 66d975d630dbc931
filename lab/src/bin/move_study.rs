//! Where an expandable replay's page maps come from: for each request that
//! mapped pages, whether a free block of its own pool already held a run of
//! mapped pages (not old mappings kept as shadows) long enough to serve it.
//! Maps made by requests with such a run are what any placement over idle
//! pages could save; the rest are needed by the layout the trace had then.
//! Also prints the maps by the size of the request that made them.
//!
//! ```text
//! cargo run -p lab --release --bin move_study -- TRACE.gz [CONF]
//! ```
use cachealloc_core::{
    BlockState, CachingAllocator, Config, PoolKind, SegmentSnapshot, SimulatedDevice, StreamId,
    TraceEvent,
};
use std::collections::{BTreeMap, HashMap, HashSet};

/// Per request (event index) that mapped pages: (maps, bytes allocated).
type Mapping = BTreeMap<usize, (u64, u64)>;

/// The longest run of bytes mapped under one free block of `stream`'s pool
/// of `small` kind, shadows left out.
fn longest_mapped_run(a: &CachingAllocator<SimulatedDevice>, stream: u64, small: bool) -> u64 {
    let stale: HashSet<u64> = a.stale_mappings().iter().map(|m| m.0 .0).collect();
    let mappings: Vec<_> = a
        .device()
        .mappings()
        .into_iter()
        .filter(|m| !stale.contains(&m.0 .0))
        .collect();
    let own =
        |s: &&SegmentSnapshot| s.stream == StreamId(stream) && (s.pool == PoolKind::Small) == small;
    let mut best = 0;
    for s in a.snapshot().segments.iter().filter(own) {
        for b in s.blocks.iter().filter(|b| b.state == BlockState::Free) {
            let (lo, hi) = (b.address.0, b.address.0 + b.size);
            let (mut run, mut at) = (0, lo);
            for &(p, n) in &mappings {
                let (ps, pe) = (p.0.max(lo), (p.0 + n).min(hi));
                if pe <= ps {
                    continue;
                }
                run = if ps == at { run + pe - ps } else { pe - ps };
                at = pe;
                best = best.max(run);
            }
        }
    }
    best
}

/// Replays `events`; with `probe` (a first replay's answer), classifies the
/// requests it lists before serving them and prints the totals.
fn run(events: &[TraceEvent], config: &Config, probe: Option<&Mapping>) -> Mapping {
    let a = CachingAllocator::new(
        SimulatedDevice::unlimited().with_auto_complete(true),
        config.clone(),
    );
    let mut live = HashMap::new();
    let mut out = BTreeMap::new();
    // (requests, maps) with a long enough run, and without.
    let (mut with, mut without) = ((0, 0), (0, 0));
    for (i, e) in events.iter().enumerate() {
        match *e {
            TraceEvent::Alloc { id, bytes, stream } => {
                if let Some(&(maps, rounded)) = probe.and_then(|p| p.get(&i)) {
                    let small = rounded <= cachealloc_core::SMALL_SIZE;
                    let side = match longest_mapped_run(&a, stream, small) >= rounded {
                        true => &mut with,
                        false => &mut without,
                    };
                    *side = (side.0 + 1, side.1 + maps);
                }
                let maps = a.device().counters().vmm_maps;
                let allocated = a.stats().allocated_bytes.all().current;
                live.insert(id, a.malloc(bytes, StreamId(stream)).unwrap());
                let maps = a.device().counters().vmm_maps - maps;
                if maps > 0 {
                    let bytes = a.stats().allocated_bytes.all().current - allocated;
                    out.insert(i, (maps, bytes));
                }
            }
            TraceEvent::Free { id } => a.free(live.remove(&id).unwrap()).unwrap(),
            TraceEvent::EmptyCache => {
                a.empty_cache().unwrap();
            }
        }
    }
    if probe.is_some() {
        println!(
            "requests that mapped pages: {} ({} maps) had a long enough mapped run free in their pool, {} ({} maps) had none",
            with.0, with.1, without.0, without.1
        );
    }
    out
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if !(2..=3).contains(&args.len()) {
        eprintln!("usage: move_study TRACE.gz [CONF (default: expandable)]");
        std::process::exit(2);
    }
    let config = lab::config_arg(&args, 2, "expandable");
    let events = lab::load_trace(&args[1]);
    let first = run(&events, &config, None);
    // Maps by the size of the request that made them.
    const CLASSES: [(&str, u64); 6] = [
        ("< 8 MiB", 8),
        ("8-64 MiB", 64),
        ("64-256 MiB", 256),
        ("256 MiB-1 GiB", 1024),
        ("1-2 GiB", 2048),
        ("> 2 GiB", u64::MAX),
    ];
    let mut by_size = [0u64; CLASSES.len()];
    for &(maps, bytes) in first.values() {
        let k = CLASSES
            .iter()
            .position(|&(_, mib)| bytes >> 20 < mib)
            .unwrap();
        by_size[k] += maps;
    }
    let parts: Vec<String> = CLASSES
        .iter()
        .zip(by_size)
        .map(|((name, _), n)| format!("{name}: {n}"))
        .collect();
    println!("maps by request size: {}", parts.join(", "));
    run(&events, &config, Some(&first));
}
