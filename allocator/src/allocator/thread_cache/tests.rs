//! Tests of the per-thread caches through the allocator.

use crate::block::PoolKind;
use crate::config::Config;
use crate::device::{DevicePtr, StreamId};
use crate::error::AllocError;
use crate::simulated::SimulatedDevice;
use crate::trace::TraceEvent;
use crate::{BlockState, CachingAllocator};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

fn new(config: &str, capacity: u64) -> (SimulatedDevice, Arc<CachingAllocator<SimulatedDevice>>) {
    let dev = SimulatedDevice::new(capacity);
    let a = CachingAllocator::new(dev.clone(), Config::parse(config).unwrap());
    (dev, Arc::new(a))
}

fn states(a: &CachingAllocator<SimulatedDevice>) -> Vec<BlockState> {
    let snap = a.snapshot();
    snap.segments
        .iter()
        .flat_map(|s| s.blocks.iter().map(|b| b.state))
        .collect()
}

/// An interior pointer into a block a thread cache handed out again is
/// reported as one, as without thread caches.
#[test]
fn an_interior_pointer_into_a_block_served_from_a_cache_is_named() {
    let (_dev, a) = new("segments,thread_cache:8", 1 << 30);
    let p = a.malloc(4096, S0).unwrap();
    a.free(p).unwrap();
    let q = a.malloc(4096, S0).unwrap();
    assert_eq!(q, p, "served by the thread's cache");
    let e = a.free(DevicePtr(q.0 + 512)).unwrap_err();
    assert_eq!(
        e,
        AllocError::InteriorPointer {
            ptr: DevicePtr(q.0 + 512),
            block: q
        }
    );
    a.free(q).unwrap();
    a.check_invariants().unwrap();
}

/// A pointer into a block parked (freed) in a thread cache names no
/// allocation, as without thread caches: unknown, and its start a double
/// free; once the cache hands the block out again, an interior pointer.
#[test]
fn an_interior_pointer_into_a_parked_block_is_unknown() {
    let (_dev, a) = new("segments,thread_cache:8", 1 << 30);
    let p = a.malloc(4096, S0).unwrap();
    a.free(p).unwrap();
    assert!(
        states(&a).contains(&BlockState::Parked),
        "the block is parked"
    );
    let inside = DevicePtr(p.0 + 512);
    assert_eq!(
        a.free(inside).unwrap_err(),
        AllocError::UnknownPointer(inside)
    );
    assert_eq!(
        a.record_stream(inside, S1).unwrap_err(),
        AllocError::UnknownPointer(inside)
    );
    let q = a.malloc(4096, S0).unwrap();
    assert_eq!(q, p, "served by the thread's cache");
    assert_eq!(
        a.free(inside).unwrap_err(),
        AllocError::InteriorPointer {
            ptr: inside,
            block: q
        }
    );
    a.free(q).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn a_repeated_size_is_served_without_the_allocator_lock() {
    let (dev, a) = new("segments,thread_cache:8", 1 << 30);
    let p = a.malloc(1000, S0).unwrap();
    a.free(p).unwrap();
    assert!(
        states(&a).contains(&BlockState::Parked),
        "the block is parked"
    );
    let (tx, rx) = mpsc::channel();
    let a2 = a.clone();
    // Slots are per thread: a helper thread parks its own block, then
    // repeats its size while this thread holds the allocator's lock.
    let t = std::thread::spawn(move || {
        let q = a2.malloc(4096, S0).unwrap();
        a2.free(q).unwrap();
        tx.send(()).unwrap();
        // Wait until the main thread holds the lock, then repeat.
        std::thread::park();
        for _ in 0..1000 {
            let r = a2.malloc(4000, S0).unwrap();
            assert_eq!(r, q, "the parked block comes back");
            a2.free(r).unwrap();
        }
        tx.send(()).unwrap();
    });
    rx.recv().unwrap();
    let guard = a.state.lock();
    t.thread().unpark();
    let done = rx.recv_timeout(Duration::from_secs(10));
    drop(guard);
    t.join().unwrap();
    assert!(
        done.is_ok(),
        "1000 repeats finished while the allocator's lock was held"
    );
    assert_eq!(dev.counters().allocs, 1);
    a.check_invariants().unwrap();
}

#[test]
fn statistics_count_what_the_thread_cache_served() {
    let (_, a) = new("segments,thread_cache:8", 1 << 30);
    for i in 0..100u64 {
        let p = a.malloc(1000 + i % 3, S0).unwrap();
        a.free(p).unwrap();
    }
    let s = a.stats();
    assert_eq!(
        s.allocated_bytes.all().peak,
        1024,
        "one block live at a time"
    );
    assert_eq!(s.allocation.all().peak, 1);
    assert_eq!(s.allocated_bytes.all().allocated, 100 * 1024);
    let big = a.malloc(64 * MIB, S0).unwrap();
    a.free(big).unwrap();
    let big = a.malloc(64 * MIB - 100, S0).unwrap();
    let held = a.malloc(2000, S0).unwrap();
    let s = a.stats();
    let all = s.allocation.all();
    assert_eq!((all.allocated, all.freed, all.current), (103, 101, 2));
    assert_eq!(s.allocated_bytes.all().current, 64 * MIB + 2048);
    assert_eq!(s.requested_bytes.all().current, 64 * MIB - 100 + 2000);
    assert_eq!(
        s.requested_bytes.pool(PoolKind::Large).current,
        64 * MIB - 100
    );
    assert_eq!(s.active.all().current, 2);
    // The small block (1024 B) parked in its 2 MiB segment is inactive split memory.
    assert_eq!(
        s.inactive_split_bytes.pool(PoolKind::Small).current,
        2 * MIB - 2048
    );
    a.free(big).unwrap();
    a.free(held).unwrap();
    let s = a.stats();
    assert_eq!(s.allocated_bytes.all().current, 0);
    assert_eq!(s.requested_bytes.all().current, 0);
    assert!(s.allocated_bytes.all().peak >= 64 * MIB + 2048);
    a.check_invariants().unwrap();
}

#[test]
fn misuse_of_a_cached_block_is_an_error() {
    let (_, a) = new("segments,thread_cache:8", 1 << 30);
    let p = a.malloc(4096, S0).unwrap();
    a.free(p).unwrap(); // parked
    assert!(matches!(a.free(p), Err(AllocError::DoubleFree(q)) if q == p));
    let p2 = a.malloc(4096, S0).unwrap(); // from the cache
    assert_eq!(p2, p);
    a.free(p2).unwrap(); // parked again, without the allocator's lock
    assert!(matches!(a.free(p2), Err(AllocError::DoubleFree(_))));
    assert!(a.free(DevicePtr(p.0 + 512)).is_err(), "interior pointer");
    assert!(
        a.record_stream(p, S1).is_err(),
        "a parked block is not live"
    );
    // From another thread too.
    let a2 = a.clone();
    let r = std::thread::spawn(move || a2.free(p)).join().unwrap();
    assert!(matches!(r, Err(AllocError::DoubleFree(_))));
    a.check_invariants().unwrap();
}

#[test]
fn another_thread_frees_a_block_the_cache_handed_out() {
    let (dev, a) = new("segments,thread_cache:8", 1 << 30);
    let p = a.malloc(4096, S0).unwrap();
    a.free(p).unwrap();
    let p = a.malloc(4096, S0).unwrap(); // handed out by this thread's cache
    let a2 = a.clone();
    std::thread::spawn(move || a2.free(p).unwrap())
        .join()
        .unwrap();
    assert!(a.free(p).is_err(), "freed once, by the other thread");
    assert_eq!(a.stats().allocation.all().current, 0);
    a.check_invariants().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(dev.outstanding(), 0);
}

#[test]
fn a_block_used_on_another_stream_is_not_cached() {
    let (dev, a) = new("segments,thread_cache:8", 1 << 30);
    let p = a.malloc(4096, S0).unwrap();
    a.free(p).unwrap();
    let p = a.malloc(4096, S0).unwrap(); // from the cache
    a.record_stream(p, S1).unwrap();
    a.free(p).unwrap();
    let q = a.malloc(4096, S0).unwrap();
    assert_ne!(p, q, "not reused while stream 1 may use it");
    assert!(states(&a).contains(&BlockState::AwaitingEvents));
    dev.complete_all_events();
    a.free(q).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn parked_blocks_go_back_before_the_device_is_asked() {
    // One small segment fits the device.
    let (dev, a) = new("segments,thread_cache:8", 2 * MIB);
    let p = a.malloc(MIB, S0).unwrap();
    let q = a.malloc(MIB, S0).unwrap();
    a.free(p).unwrap();
    a.free(q).unwrap();
    assert_eq!(
        states(&a),
        vec![BlockState::Parked, BlockState::Parked],
        "both parked"
    );
    // Another size: only the parked blocks, merged, can serve it.
    let r = a.malloc(768 * 1024, S0);
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(dev.counters().allocs, 1);
    assert_eq!(a.stats().num_alloc_retries, 0);
    a.check_invariants().unwrap();
}

#[test]
fn empty_cache_releases_segments_of_parked_blocks() {
    let (dev, a) = new("segments,thread_cache:8", 1 << 30);
    for size in [512, 64 << 10, 16 * MIB] {
        let p = a.malloc(size, S0).unwrap();
        a.free(p).unwrap();
    }
    assert!(states(&a).contains(&BlockState::Parked));
    let before = dev.segments().len();
    let released = a.empty_cache().unwrap();
    assert_eq!(released.segments as usize, before);
    assert_eq!(dev.outstanding(), 0);
    a.check_invariants().unwrap();
}

#[test]
fn a_large_block_is_parked_only_for_an_immediate_repeat() {
    let (_, a) = new("segments,thread_cache:8", 1 << 30);
    let x = a.malloc(40 * MIB, S0).unwrap();
    let y = a.malloc(30 * MIB, S0).unwrap();
    a.free(x).unwrap(); // the last request was 30 MiB: x goes to the bins
    a.free(y).unwrap(); // parked
    assert_eq!(
        states(&a)
            .iter()
            .filter(|s| **s == BlockState::Parked)
            .count(),
        1
    );
    // Another large size first returns the parked block to the bins, so best fit sees it.
    let z = a.malloc(20 * MIB, S0).unwrap();
    assert_eq!(z, y, "best fit: the 30 MiB segment");
    a.check_invariants().unwrap();
}

/// Addresses of the parked blocks.
fn parked(a: &CachingAllocator<SimulatedDevice>) -> Vec<u64> {
    let snap = a.snapshot();
    snap.segments
        .iter()
        .flat_map(|s| s.blocks.iter())
        .filter(|b| b.state == BlockState::Parked)
        .map(|b| b.address.0)
        .collect()
}

#[test]
fn parks_that_are_never_taken_back_use_up_the_credit() {
    let (_, a) = new("segments,thread_cache:8", 1 << 30);
    // Each round asks for 8 new sizes, then frees them: every free is of a
    // wanted size, but no size comes back, so no park ever hits.
    // Asks for 8 new sizes, frees them; returns how many of them were parked.
    let park_round = |sizes: &[u64]| {
        let ptrs: Vec<DevicePtr> = sizes.iter().map(|&s| a.malloc(s, S0).unwrap()).collect();
        let before = parked(&a);
        for &p in &ptrs {
            a.free(p).unwrap();
        }
        parked(&a)
            .iter()
            .filter(|x| !before.contains(x) && ptrs.iter().any(|p| p.0 == **x))
            .count()
    };
    let parked_per_round: Vec<usize> = (0..6u64)
        .map(|round| {
            park_round(
                &(0..8)
                    .map(|i| 4096 * (1 + round * 8 + i))
                    .collect::<Vec<_>>(),
            )
        })
        .collect();
    assert_eq!(
        parked_per_round[0],
        super::INITIAL_CREDIT as usize,
        "a new slot parks on credit"
    );
    for (round, n) in parked_per_round.iter().enumerate().skip(1) {
        assert!(
            *n <= 1,
            "round {round}: without hits only a probe parks, got {parked_per_round:?}"
        );
    }
    // Hits earn credit back: a repeated size is parked by a probe, then
    // served from the cache, and new sizes park again.
    for _ in 0..2 * super::PROBE_EVERY {
        let q = a.malloc(100, S0).unwrap();
        a.free(q).unwrap();
    }
    let newly = park_round(&(0..8).map(|i| 4096 * (100 + i)).collect::<Vec<_>>());
    assert!(newly >= 4, "after hits, wanted sizes park again ({newly})");
    a.check_invariants().unwrap();
}

#[test]
fn caches_that_do_not_pay_are_turned_off_until_sizes_repeat() {
    let (_, a) = new("segments,thread_cache:8", 1 << 30);
    let on = |a: &CachingAllocator<SimulatedDevice>| {
        a.thread_cache_on.load(std::sync::atomic::Ordering::Relaxed)
    };
    assert!(on(&a));
    // A random mix over 64 slots: sizes hardly repeat.
    let mut rng = crate::sample::XorShift64::new(0x2545_f491_4f6c_dd1d);
    let mut live: Vec<Option<DevicePtr>> = vec![None; 64];
    let mut random_mix = |a: &CachingAllocator<SimulatedDevice>, ops: u64| {
        for _ in 0..ops {
            let x = rng.next();
            let slot = &mut live[(x % 64) as usize];
            match slot.take() {
                Some(p) => a.free(p).unwrap(),
                None => *slot = Some(a.malloc(512 + (x >> 40) % (8 * MIB), S0).unwrap()),
            }
        }
    };
    random_mix(&a, 4 * super::REVIEW_WINDOW);
    assert!(!on(&a), "a random mix turns the caches off");
    assert!(parked(&a).is_empty(), "turning off flushes the caches");
    a.check_invariants().unwrap();
    // More of the mix: the shadow sees no repeats, the caches stay off.
    random_mix(&a, 8 * super::REVIEW_WINDOW);
    assert!(!on(&a));
    // Repeats: the shadow sees them, and within two windows the caches are back.
    let pairs = |a: &CachingAllocator<SimulatedDevice>, n: u64| {
        for _ in 0..n {
            let p = a.malloc(4096, S0).unwrap();
            a.free(p).unwrap();
        }
    };
    pairs(&a, super::REVIEW_WINDOW);
    assert!(on(&a), "repeats turn them back on");
    // And on, they pay: still on after many more windows.
    pairs(&a, 8 * super::REVIEW_WINDOW);
    assert!(on(&a));
    for p in live.into_iter().flatten() {
        a.free(p).unwrap();
    }
    a.check_invariants().unwrap();
}

#[test]
fn a_slot_hands_out_at_most_max_live_blocks() {
    let (_, a) = new("segments,thread_cache:8", 1 << 30);
    let live = |a: &CachingAllocator<SimulatedDevice>| {
        let st = a.state.lock();
        st.caches
            .slots
            .iter()
            .flatten()
            .map(|s| s.inner.lock().live.len())
            .max()
            .unwrap_or(0)
    };
    let mut held = Vec::new();
    for _ in 0..12 {
        // Park 8 blocks of the size, then take them (hits) and keep them.
        let fresh: Vec<DevicePtr> = (0..8).map(|_| a.malloc(4096, S0).unwrap()).collect();
        for p in fresh {
            a.free(p).unwrap();
        }
        held.extend((0..8).map(|_| a.malloc(4096, S0).unwrap()));
        assert!(live(&a) <= crate::thread_slot::MAX_LIVE);
    }
    assert_eq!(
        live(&a),
        crate::thread_slot::MAX_LIVE,
        "the cap was reached"
    );
    a.check_invariants().unwrap();
    for p in held {
        a.free(p).unwrap();
    }
    a.check_invariants().unwrap();
    assert_eq!(a.usage().allocated, 0);
}

#[test]
fn without_thread_cache_nothing_is_parked() {
    for conf in [
        "pytorch",
        "default,thread_cache:0",
        "expandable",
        "no-caching",
    ] {
        let (_, a) = new(conf, 1 << 30);
        for _ in 0..3 {
            let p = a.malloc(4096, S0).unwrap();
            a.free(p).unwrap();
        }
        assert!(!states(&a).contains(&BlockState::Parked), "{conf}");
    }
}

#[test]
fn recording_sees_every_call() {
    let (_, a) = new("segments,thread_cache:8", 1 << 30);
    let p = a.malloc(4096, S0).unwrap();
    a.free(p).unwrap();
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    a.start_recording(Box::new(move |e| sink.lock().unwrap().push(*e)));
    for _ in 0..10 {
        let p = a.malloc(4096, S0).unwrap();
        a.free(p).unwrap();
    }
    a.stop_recording();
    let ev = events.lock().unwrap();
    let allocs = ev
        .iter()
        .filter(|e| matches!(e, TraceEvent::Alloc { .. }))
        .count();
    let frees = ev
        .iter()
        .filter(|e| matches!(e, TraceEvent::Free { .. }))
        .count();
    assert_eq!((allocs, frees), (10, 10));
    a.check_invariants().unwrap();
}

#[test]
fn threads_each_keep_their_own_blocks() {
    // Without slabs, so that one small segment serves all eight sizes
    // (slabs would take one segment per size class).
    let (dev, a) = new("segments,thread_cache:8,slab_max_kb:0", 1 << 30);
    let handles: Vec<_> = (0..8u64)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let size = 4096 + 512 * t;
                let first = a.malloc(size, S0).unwrap();
                a.free(first).unwrap();
                for _ in 0..10_000 {
                    let p = a.malloc(size, S0).unwrap();
                    assert_eq!(p, first);
                    a.free(p).unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let s = a.stats();
    assert_eq!(s.allocation.all().allocated, 8 * 10_001);
    assert_eq!(s.allocation.all().current, 0);
    assert_eq!(dev.counters().allocs, 1);
    a.check_invariants().unwrap();
    // The threads are gone: a flush forgets their slots.
    a.empty_cache().unwrap();
    assert!(a.state.lock().caches.slots.iter().all(Option::is_none));
}
