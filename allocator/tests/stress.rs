//! Multi-threaded stress: several threads share one allocator, allocate,
//! free, hand allocations to each other (so blocks are freed on another
//! thread than the one that allocated them), record streams, complete events
//! and empty the cache, all at once. A shared map of live ranges catches any
//! two allocations that overlap while both are held; at the end the
//! invariants hold, and freeing everything plus `empty_cache` leaves nothing
//! reserved and nothing outstanding on the device.

use cachealloc_core::sample::XorShift64;
use cachealloc_core::{AllocError, CachingAllocator, Config, DevicePtr, SimulatedDevice, StreamId};
use cachealloc_model::{
    check_expandable_stats_against_snapshot, check_stats_against_snapshot, free_segments,
};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;

const THREADS: usize = 8;
const OPS_PER_THREAD: usize = 10_000;
/// A thread frees instead of allocating once it holds this many.
const MAX_HELD: usize = 32;
const STREAMS: [StreamId; 3] = [StreamId(0), StreamId(1), StreamId(2)];

/// Log-uniform from 1 B to 32 MiB.
fn size(rng: &mut XorShift64) -> u64 {
    let e = rng.below(25);
    (1 << e) + rng.below(1 << e)
}

/// Live ranges held by any thread: inserting one that overlaps is a bug.
#[derive(Default)]
struct Held(Mutex<BTreeMap<u64, u64>>);

impl Held {
    fn insert(&self, p: DevicePtr, size: u64) {
        let mut m = self.0.lock();
        if let Some((&a, &n)) = m.range(..p.0 + size).next_back() {
            assert!(
                a + n <= p.0,
                "allocation {p}+{size} overlaps the held allocation {a:#x}+{n}"
            );
        }
        m.insert(p.0, size);
    }
    fn remove(&self, p: DevicePtr) {
        assert!(self.0.lock().remove(&p.0).is_some(), "{p} was not held");
    }
}

fn stress(name: &str, config: Config, capacity: u64, seed: u64) {
    let dev = SimulatedDevice::new(capacity);
    let alloc = Arc::new(CachingAllocator::new(dev.clone(), config));
    let handoff: Arc<Mutex<Vec<(DevicePtr, u64)>>> = Arc::default();
    let held = Arc::new(Held::default());
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (alloc, dev, handoff, held) =
                (alloc.clone(), dev.clone(), handoff.clone(), held.clone());
            std::thread::spawn(move || {
                let mut rng =
                    XorShift64::new(seed ^ 0x9e37_79b9_7f4a_7c15_u64.wrapping_mul(t as u64 + 1));
                let mut mine: Vec<(DevicePtr, u64)> = Vec::new();
                let mut ooms = 0u64;
                for _ in 0..OPS_PER_THREAD {
                    match rng.below(100) {
                        0..=39 if mine.len() < MAX_HELD => {
                            let size = size(&mut rng);
                            let stream = STREAMS[rng.below(3) as usize];
                            match alloc.malloc(size, stream) {
                                Ok(p) => {
                                    assert_eq!(p.0 % 512, 0);
                                    held.insert(p, size);
                                    mine.push((p, size));
                                }
                                Err(AllocError::OutOfMemory(_)) => ooms += 1,
                                Err(e) => panic!("malloc({size}): {e}"),
                            }
                        }
                        0..=64 if !mine.is_empty() => {
                            let (p, _) = mine.swap_remove(rng.below(mine.len() as u64) as usize);
                            held.remove(p);
                            alloc.free(p).unwrap();
                        }
                        65..=74 if !mine.is_empty() => {
                            // Hand an allocation to whichever thread picks it up.
                            let a = mine.swap_remove(rng.below(mine.len() as u64) as usize);
                            handoff.lock().push(a);
                        }
                        75..=84 => {
                            let taken = handoff.lock().pop();
                            if let Some(a) = taken {
                                mine.push(a);
                            }
                        }
                        85..=89 if !mine.is_empty() => {
                            let (p, _) = mine[rng.below(mine.len() as u64) as usize];
                            alloc
                                .record_stream(p, STREAMS[rng.below(3) as usize])
                                .unwrap();
                        }
                        90..=94 => {
                            let pending = dev.pending_events();
                            if !pending.is_empty() {
                                dev.complete_event(
                                    pending[rng.below(pending.len() as u64) as usize],
                                );
                            }
                        }
                        95 => {
                            alloc.empty_cache().unwrap();
                        }
                        96 => {
                            alloc.check_invariants().unwrap();
                        }
                        97 => {
                            // Misuse from a racing thread is an error, never corruption.
                            let bogus = DevicePtr(rng.next() | 1);
                            assert!(alloc.free(bogus).is_err());
                        }
                        98 => alloc.process_events().unwrap(),
                        _ => dev.complete_all_events(),
                    }
                }
                (mine, ooms)
            })
        })
        .collect();
    let mut remaining: Vec<(DevicePtr, u64)> = Vec::new();
    let mut ooms = 0;
    for t in threads {
        let (mine, o) = t.join().expect("a stress thread panicked");
        remaining.extend(mine);
        ooms += o;
    }
    remaining.extend(handoff.lock().drain(..));
    alloc.check_invariants().unwrap();
    let snap = alloc.snapshot();
    let max_split = alloc.config().max_split_size();
    if alloc.is_expandable() {
        // Pages reused early, pooled with only their old mapping left, are pooled too.
        let early: u64 = alloc
            .stale_mappings()
            .iter()
            .filter(|m| m.2)
            .map(|m| m.1)
            .sum();
        let pooled = dev.unmapped_page_bytes() + early;
        check_expandable_stats_against_snapshot(&alloc.stats(), &snap, max_split, pooled).unwrap();
    } else {
        check_stats_against_snapshot(&alloc.stats(), &snap, max_split, 0).unwrap();
    }
    assert_eq!(
        alloc.stats().allocation.all().current,
        remaining.len() as u64,
        "every held allocation is live, and nothing else"
    );
    for (p, size) in &remaining {
        let inside = if alloc.is_expandable() {
            dev.mapped_bytes_in(*p, *size) == *size
        } else {
            dev.contains(*p, *size)
        };
        assert!(inside, "{p}+{size} outside the device's memory");
    }
    let st = alloc.stats();
    assert!(st.num_device_alloc + st.num_page_create > 0);
    eprintln!(
        "stress {name}: {} allocations left live, {ooms} OOMs, {} device allocs",
        remaining.len(),
        alloc.stats().num_device_alloc
    );
    for (p, _) in remaining {
        held.remove(p);
        alloc.free(p).unwrap();
    }
    let released = alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    let snap = alloc.snapshot();
    assert_eq!(free_segments(&snap), 0);
    assert!(
        snap.segments.is_empty(),
        "segments left: {:?}",
        snap.segments
    );
    assert_eq!(alloc.usage().reserved, 0, "released {released:?}");
    assert_eq!(alloc.stats().active.all().current, 0);
    assert_eq!(dev.outstanding(), 0);
    assert_eq!(dev.used(), 0);
    assert!(dev.pending_events().is_empty());
}

#[test]
fn threads_share_one_allocator() {
    stress("default", Config::default(), 1 << 40, 0x5eed_0001);
    stress("segments", Config::segments(), 1 << 40, 0x5eed_0003);
}

#[test]
fn threads_share_one_allocator_pytorch_tight_device() {
    // A device small enough that threads run into the OOM flush-and-retry.
    stress(
        "pytorch, 384 MiB",
        Config::pytorch(),
        384 << 20,
        0x5eed_0002,
    );
}

#[test]
fn threads_share_one_allocator_max_split_size() {
    stress(
        "max_split_size_mb:64",
        Config::parse("pytorch,max_split_size_mb:64").unwrap(),
        2 << 30,
        0x5eed_0003,
    );
}
