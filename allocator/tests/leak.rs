//! Leak check: after any sequence that frees everything, `empty_cache`
//! leaves nothing reserved, every current statistic at zero, no segment in
//! the snapshot, no event pending and nothing of ours on the (simulated)
//! device — for every named preset, expandable segments included, and for a
//! few PyTorch-style variants.
//!
//! Each sequence mixes small, large and huge requests on three streams,
//! cross-stream use (`record_stream`) with events left pending, frees in
//! random order, `empty_cache` in the middle, a tight device (OOM, the
//! flush-and-retry), injected device failures and a memory cap.

use cachealloc_core::sample::XorShift64;
use cachealloc_core::{
    AllocError, CachingAllocator, Config, DevicePtr, MemoryCap, SimulatedDevice, StreamId,
};

const MIB: u64 = 1 << 20;
const STREAMS: [StreamId; 3] = [StreamId(0), StreamId(7), StreamId(u64::MAX)];

/// Log-uniform from 1 B to 512 MiB.
fn size(rng: &mut XorShift64) -> u64 {
    let e = rng.below(30);
    (1 << e) + rng.below(1 << e)
}

fn configs() -> Vec<(String, Config)> {
    let mut v: Vec<(String, Config)> = Config::PRESETS
        .iter()
        .map(|n| (n.to_string(), Config::preset(n).unwrap()))
        .collect();
    for conf in [
        "pytorch,max_split_size_mb:64",
        "pytorch,roundup_power2_divisions:4",
        "pytorch,garbage_collection_threshold:0.6,per_process_memory_fraction:0.8",
        "segments,huge_size_mb:64",
        "segments,slab_max_kb:1024",
        "expandable,expandable_page_mb:8",
        "expandable,expandable_edges:small",
        "expandable,expandable_edges:big",
        "expandable,expandable_page_mb:6,expandable_edges:small",
    ] {
        v.push((conf.to_string(), Config::parse(conf).unwrap()));
    }
    v
}

/// Runs a random sequence, frees everything, empties the cache and checks
/// that nothing is left. `complete_at_end`: whether the test completes the
/// pending events itself before `empty_cache` (else `empty_cache` must wait).
fn sequence(name: &str, config: Config, capacity: u64, seed: u64, complete_at_end: bool) {
    let dev = SimulatedDevice::new(capacity);
    let alloc = CachingAllocator::new(dev.clone(), config);
    let mut rng = XorShift64::new(seed);
    let mut live: Vec<DevicePtr> = Vec::new();
    let mut ooms = 0;
    for step in 0..1500 {
        match rng.below(100) {
            0..=44 => match alloc.malloc(size(&mut rng), STREAMS[rng.below(3) as usize]) {
                Ok(p) => live.push(p),
                Err(AllocError::OutOfMemory(_)) => ooms += 1,
                Err(e) => panic!("{name}: step {step}: malloc: {e}"),
            },
            45..=79 if !live.is_empty() => {
                let p = live.swap_remove(rng.below(live.len() as u64) as usize);
                alloc.free(p).unwrap();
            }
            80..=87 if !live.is_empty() => {
                let p = live[rng.below(live.len() as u64) as usize];
                alloc
                    .record_stream(p, STREAMS[rng.below(3) as usize])
                    .unwrap();
            }
            88..=91 => {
                let pending = dev.pending_events();
                if !pending.is_empty() {
                    dev.complete_event(pending[rng.below(pending.len() as u64) as usize]);
                }
            }
            92 => {
                alloc.empty_cache().unwrap();
            }
            93 => dev.fail_next_allocations(rng.below(3)),
            94 => alloc
                .set_memory_cap(match rng.below(3) {
                    0 => None,
                    1 => Some(MemoryCap::Fraction(0.5)),
                    _ => Some(MemoryCap::Bytes(capacity / 4)),
                })
                .unwrap(),
            95 => dev.complete_all_events(),
            _ => {}
        }
    }
    alloc
        .check_invariants()
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let c = dev.counters();
    assert!(
        c.allocs + c.vmm_creates > 0,
        "{name}: the sequence never reached the device"
    );
    // Free everything (some blocks are used by other streams: their events
    // may still be pending), then empty the cache.
    for p in live.drain(..) {
        alloc.free(p).unwrap();
    }
    if complete_at_end {
        dev.complete_all_events();
    }
    dev.fail_next_allocations(0);
    alloc.empty_cache().unwrap();
    alloc
        .check_invariants()
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let stats = alloc.stats();
    for (stat, a) in stats.arrays() {
        assert!(
            a.stats().iter().all(|s| s.current == 0),
            "{name}: after freeing everything and empty_cache, {stat} is {a:?}"
        );
    }
    assert_eq!(alloc.usage().reserved, 0, "{name}: reserved");
    assert!(
        alloc.snapshot().segments.is_empty(),
        "{name}: segments left {:?}",
        alloc.snapshot().segments
    );
    assert!(
        dev.pending_events().is_empty(),
        "{name}: events left pending"
    );
    assert_eq!(
        (dev.outstanding(), dev.used()),
        (0, 0),
        "{name}: the device still holds segments/pages of ours"
    );
    let c = dev.counters();
    eprintln!(
        "{name}: {} segments and {} pages from the device, {ooms} OOMs, clean",
        c.allocs, c.vmm_creates
    );
}

#[test]
fn empty_cache_after_freeing_everything_leaves_nothing() {
    for (i, (name, config)) in configs().into_iter().enumerate() {
        for (j, capacity) in [1024 * MIB, 16384 * MIB].into_iter().enumerate() {
            for complete in [false, true] {
                let seed = 0x1ea4_0000 + (i as u64) * 16 + j as u64 * 2 + u64::from(complete);
                sequence(&name, config.clone(), capacity, seed, complete);
            }
        }
    }
}

#[test]
fn empty_cache_on_a_fresh_allocator_releases_nothing() {
    for (name, config) in configs() {
        let dev = SimulatedDevice::new(1 << 30);
        let alloc = CachingAllocator::new(dev.clone(), config);
        let r = alloc.empty_cache().unwrap();
        assert_eq!((r.bytes, r.segments), (0, 0), "{name}");
        assert_eq!(dev.outstanding(), 0, "{name}");
        assert_eq!(dev.counters().allocs, 0, "{name}");
    }
}
