//! What an allocator draws on besides its device (`cachealloc_core::supply`),
//! on simulated devices: segments from a `SegmentSource` (PyTorch's
//! `MemPool(allocator=...)`) served, cached, split, returned and refused as
//! the device's would be; blocks handed out whole (`no_split`); allocations
//! served only from cached blocks (`malloc_cached`, a `use_on_oom` pool's
//! fallback); and a memory cap shared by a group of allocators (Note [Shared
//! cap]), as PyTorch's memory fraction counts a device's private pools.

use cachealloc_core::{
    AllocError, CachingAllocator, CapGroup, Config, Device, DeviceError, DevicePtr, MemoryCap,
    SegmentSource, SimulatedDevice, StreamId,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(0x51);

/// What a source saw: (address, bytes, stream) of every allocation and free.
#[derive(Default)]
struct Calls {
    allocs: Vec<(DevicePtr, u64, StreamId)>,
    frees: Vec<(DevicePtr, u64, StreamId)>,
}

/// A segment source over a simulated device of its own (so that its
/// segments are told apart from the allocator's device's), recording calls.
#[derive(Clone)]
struct Recording {
    backing: SimulatedDevice,
    calls: Arc<Mutex<Calls>>,
    fail_frees: Arc<AtomicBool>,
}

impl Recording {
    fn new(capacity: u64) -> Self {
        Recording {
            backing: SimulatedDevice::new(capacity).without_vmm(),
            calls: Arc::default(),
            fail_frees: Arc::default(),
        }
    }

    fn allocs(&self) -> Vec<(DevicePtr, u64, StreamId)> {
        self.calls.lock().unwrap().allocs.clone()
    }

    fn frees(&self) -> Vec<(DevicePtr, u64, StreamId)> {
        self.calls.lock().unwrap().frees.clone()
    }

    /// Whether `p` lies in a segment this source handed out and still holds.
    fn holds(&self, p: DevicePtr) -> bool {
        self.backing.contains(p, 1)
    }
}

impl SegmentSource for Recording {
    fn allocate(&self, bytes: u64, stream: StreamId) -> Result<DevicePtr, DeviceError> {
        let p = self.backing.allocate(bytes)?;
        self.calls.lock().unwrap().allocs.push((p, bytes, stream));
        Ok(p)
    }

    fn free(&self, ptr: DevicePtr, bytes: u64, stream: StreamId) -> Result<(), DeviceError> {
        if self.fail_frees.load(Ordering::Relaxed) {
            return Err(DeviceError::Driver {
                name: "INJECTED".into(),
                call: "free",
            });
        }
        self.backing.free(ptr, bytes)?;
        self.calls.lock().unwrap().frees.push((ptr, bytes, stream));
        Ok(())
    }
}

/// PyTorch's policy, plain segments.
fn pytorch() -> Config {
    Config::preset("pytorch").unwrap()
}

/// A private pool whose segments come from `source`, on a device that has
/// memory of its own (the pool must not use it).
fn sourced(
    source: &Recording,
    config: Config,
) -> (SimulatedDevice, CachingAllocator<SimulatedDevice>) {
    let device = SimulatedDevice::new(1 << 30);
    let a = CachingAllocator::with_segment_source(device.clone(), config, Box::new(source.clone()));
    (device, a)
}

#[test]
fn every_segment_comes_from_the_source_with_its_stream_and_goes_back_to_it() {
    let src = Recording::new(1 << 30);
    let (device, a) = sourced(&src, pytorch());
    assert!(a.has_segment_source());
    // Two 1 MiB blocks fill one 2 MiB small segment; the third needs another,
    // as in PyTorch's test of a pool with an allocator.
    let x = a.malloc(MIB, S0).unwrap();
    let y = a.malloc(MIB, S0).unwrap();
    assert_eq!(src.allocs().len(), 1);
    let z = a.malloc(MIB, S0).unwrap();
    assert_eq!(src.allocs().len(), 2);
    assert_eq!(a.snapshot().segments.len(), 2);
    // A large request on another stream: a 20 MiB segment asked for that stream.
    let w = a.malloc(4 * MIB, S1).unwrap();
    let allocs = src.allocs();
    assert_eq!(allocs.len(), 3);
    assert_eq!(
        allocs.iter().map(|c| (c.1, c.2)).collect::<Vec<_>>(),
        [(2 * MIB, S0), (2 * MIB, S0), (20 * MIB, S1)]
    );
    for p in [x, y, z, w] {
        assert!(src.holds(p), "{p:?} is not in the source's memory");
    }
    assert_eq!(device.counters().allocs, 0, "the device gave no segment");
    assert_eq!(a.stats().reserved_bytes.all().current, 24 * MIB);
    for p in [x, y, z, w] {
        a.free(p).unwrap();
    }
    // Cached, not returned, until empty_cache.
    assert!(src.frees().is_empty());
    let again = a.malloc(MIB, S0).unwrap();
    assert!(again == x || again == z, "served from the cache");
    assert_eq!(src.allocs().len(), 3);
    a.free(again).unwrap();
    let released = a.empty_cache().unwrap();
    assert_eq!(released.segments, 3);
    let mut frees = src.frees();
    let mut allocs = allocs;
    frees.sort();
    allocs.sort();
    assert_eq!(frees, allocs, "each segment back with its size and stream");
    assert_eq!(src.backing.outstanding(), 0);
    assert_eq!(device.counters().frees, 0);
    a.check_invariants().unwrap();
}

#[test]
fn source_segments_are_split_and_merged_like_the_devices() {
    let src = Recording::new(1 << 30);
    let (_, a) = sourced(&src, pytorch());
    let big = a.malloc(40 * MIB, S0).unwrap();
    a.free(big).unwrap();
    // 30 MiB from the cached 40 MiB segment: split (PyTorch splits a large
    // block when more than 1 MiB remains), so 10 MiB stay free in it.
    let p = a.malloc(30 * MIB, S0).unwrap();
    assert_eq!(p, big);
    assert_eq!(src.allocs().len(), 1);
    let q = a.malloc(8 * MIB, S0).unwrap();
    assert_eq!(q.0, big.0 + 30 * MIB, "the split remainder");
    assert_eq!(src.allocs().len(), 1);
    a.free(p).unwrap();
    a.free(q).unwrap();
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 1);
    assert_eq!(snap.segments[0].blocks.len(), 1, "merged back whole");
    a.check_invariants().unwrap();
}

#[test]
fn a_source_out_of_memory_climbs_the_ladder_then_reports() {
    let src = Recording::new(40 * MIB);
    let (_, a) = sourced(&src, pytorch());
    let p = a.malloc(30 * MIB, S0).unwrap();
    a.free(p).unwrap();
    // 36 MiB: the source refuses while the cached 30 MiB segment is held;
    // the full flush gives it back to the source, and the retry succeeds.
    let q = a.malloc(36 * MIB, S0).unwrap();
    assert_eq!(src.frees().len(), 1);
    assert_eq!(a.stats().num_alloc_retries, 1);
    match a.malloc(8 * MIB, S0) {
        Err(AllocError::OutOfMemory(r)) => assert_eq!(r.requested, 8 * MIB),
        other => panic!("expected out of memory, got {other:?}"),
    }
    assert_eq!(a.stats().num_ooms, 1);
    a.free(q).unwrap();
    a.check_invariants().unwrap();

    // A pool that gives nothing back on its own (a CUDA graph or MemPool's
    // allocator) reports out of memory with its cached segment kept.
    let src = Recording::new(40 * MIB);
    let (_, a) = sourced(&src, Config::parse("pytorch,oom_flush:false").unwrap());
    let p = a.malloc(30 * MIB, S0).unwrap();
    a.free(p).unwrap();
    assert!(matches!(
        a.malloc(36 * MIB, S0),
        Err(AllocError::OutOfMemory(_))
    ));
    assert!(src.frees().is_empty());
    assert_eq!(a.stats().reserved_bytes.all().current, 30 * MIB);
}

#[test]
fn a_failed_return_keeps_the_segment_for_a_later_empty_cache() {
    let src = Recording::new(1 << 30);
    let (_, a) = sourced(&src, pytorch());
    let p = a.malloc(30 * MIB, S0).unwrap();
    a.free(p).unwrap();
    src.fail_frees.store(true, Ordering::Relaxed);
    assert!(a.empty_cache().is_err());
    assert_eq!(a.stats().reserved_bytes.all().current, 30 * MIB);
    a.check_invariants().unwrap();
    src.fail_frees.store(false, Ordering::Relaxed);
    assert_eq!(a.empty_cache().unwrap().segments, 1);
    assert_eq!(src.backing.outstanding(), 0);
}

#[test]
fn a_source_gets_plain_segments_whatever_the_configuration() {
    let src = Recording::new(1 << 30);
    let (device, a) = sourced(&src, Config::preset("default").unwrap());
    assert!(!a.is_expandable());
    let p = a.malloc(3 * MIB, S0).unwrap();
    assert!(src.holds(p));
    assert_eq!(device.counters().allocs, 0);
    assert!(device.mappings().is_empty(), "no page mapped on the device");
    a.free(p).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(src.backing.outstanding(), 0);
}

/// `no_split`: every allocation takes a block whole, so a pool that splits
/// needs fewer segments, as in PyTorch's test of `MemPool(no_split=True)`.
#[test]
fn no_split_hands_blocks_out_whole() {
    let run = |no_split: bool| {
        let src = Recording::new(1 << 30);
        let (_, a) = sourced(&src, pytorch());
        a.set_no_split(no_split);
        assert_eq!(a.no_split(), no_split);
        let p = a.malloc(4 * MIB, S0).unwrap();
        let q = a.malloc(4 * MIB, S0).unwrap();
        let small = [a.malloc(4096, S0).unwrap(), a.malloc(4096, S0).unwrap()];
        let snap = a.snapshot();
        let stats = a.stats();
        for x in [p, q].into_iter().chain(small) {
            a.free(x).unwrap();
        }
        a.check_invariants().unwrap();
        (snap, stats)
    };
    let (split, split_stats) = run(false);
    let (whole, whole_stats) = run(true);
    assert_eq!(split.segments.len(), 2, "one 20 MiB and one 2 MiB segment");
    assert_eq!(whole.segments.len(), 4, "a segment per allocation");
    for s in &whole.segments {
        assert_eq!(s.blocks.len(), 1, "never split: {s:?}");
    }
    // The whole block is handed out: 2 × 20 MiB + 2 × 2 MiB allocated.
    assert_eq!(whole_stats.allocated_bytes.all().current, 44 * MIB);
    assert_eq!(split_stats.allocated_bytes.all().current, 8 * MIB + 8192);
    assert_eq!(whole_stats.inactive_split.all().current, 0);
}

#[test]
fn no_split_takes_a_cached_block_whole() {
    let src = Recording::new(1 << 30);
    let (_, a) = sourced(&src, pytorch());
    a.set_no_split(true);
    let p = a.malloc(40 * MIB, S0).unwrap();
    a.free(p).unwrap();
    let q = a.malloc(30 * MIB, S0).unwrap();
    assert_eq!(q, p);
    assert_eq!(a.stats().allocated_bytes.all().current, 40 * MIB);
    // The next request cannot share the segment: a new one.
    let r = a.malloc(8 * MIB, S0).unwrap();
    assert_eq!(src.allocs().len(), 2);
    a.free(q).unwrap();
    a.free(r).unwrap();
    a.check_invariants().unwrap();
}

/// Expandable segments keep carving their ranges under `no_split` (a free
/// block there spans unmapped pages; private pools never map pages).
#[test]
fn no_split_leaves_expandable_ranges_carved() {
    let a = CachingAllocator::new(SimulatedDevice::new(1 << 30), Config::default());
    assert!(a.is_expandable());
    a.set_no_split(true);
    let p = a.malloc(4 * MIB, S0).unwrap();
    let q = a.malloc(4 * MIB, S0).unwrap();
    assert_eq!(a.stats().allocated_bytes.all().current, 8 * MIB);
    a.free(p).unwrap();
    a.free(q).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn malloc_cached_serves_only_from_cached_blocks() {
    let device = SimulatedDevice::new(1 << 30);
    let a = CachingAllocator::new(device.clone(), pytorch());
    assert_eq!(a.malloc_cached(MIB, S0).unwrap(), None, "nothing cached");
    let p = a.malloc(40 * MIB, S0).unwrap();
    a.free(p).unwrap();
    let calls = device.counters();
    assert_eq!(a.malloc_cached(50 * MIB, S0).unwrap(), None, "too large");
    assert_eq!(
        a.malloc_cached(30 * MIB, S1).unwrap(),
        None,
        "another stream's"
    );
    let q = a
        .malloc_cached(30 * MIB, S0)
        .unwrap()
        .expect("the cached block");
    assert_eq!(q, p);
    let r = a
        .malloc_cached(4 * MIB, S0)
        .unwrap()
        .expect("the split remainder");
    assert_eq!(r.0, p.0 + 30 * MIB);
    assert_eq!(device.counters().allocs, calls.allocs, "no growth");
    assert_eq!(device.counters().frees, calls.frees, "no release");
    assert_eq!(a.stats().num_alloc_retries, 0);
    assert!(matches!(a.malloc_cached(0, S0), Err(AllocError::ZeroSize)));
    a.free(q).unwrap();
    a.free(r).unwrap();
    a.check_invariants().unwrap();
    // Expandable segments serve nothing this way.
    let e = CachingAllocator::new(SimulatedDevice::new(1 << 30), Config::default());
    assert!(e.is_expandable());
    let p = e.malloc(4 * MIB, S0).unwrap();
    e.free(p).unwrap();
    assert_eq!(e.malloc_cached(4 * MIB, S0).unwrap(), None);
}

/// PyTorch's test of a memory fraction with pools (`use_on_oom`): two pools
/// of 40 MiB under an 80 MiB fraction leave the device's allocator nothing;
/// once their blocks are free, only the lending pool serves it (from its
/// cache), and no pool grows past the fraction.
#[test]
fn a_shared_cap_counts_every_member_and_the_lending_pool_serves_from_its_cache() {
    let device = SimulatedDevice::new(1 << 30);
    let main = CachingAllocator::new(device.clone(), pytorch());
    main.set_memory_cap(Some(MemoryCap::Bytes(80 * MIB)))
        .unwrap();
    let group = CapGroup::new();
    main.join_cap_group(&group, true);
    assert_eq!(group.cap(), Some(80 * MIB));
    let pool_config = Config::parse("pytorch,oom_flush:false").unwrap();
    let keep = CachingAllocator::new(device.clone(), pool_config.clone());
    let src = Recording::new(1 << 30);
    let donor =
        CachingAllocator::with_segment_source(device.clone(), pool_config, Box::new(src.clone()));
    keep.join_cap_group(&group, false);
    donor.join_cap_group(&group, false);
    keep.join_cap_group(&group, false); // a second join changes nothing
    let a = keep.malloc(40 * MIB, S0).unwrap();
    let b = donor.malloc(40 * MIB, S0).unwrap();
    assert_eq!(group.reserved(), 80 * MIB);
    assert_eq!(main.effective_cap(), Some(0));
    assert!(matches!(
        main.malloc(40 * MIB, S0),
        Err(AllocError::OutOfMemory(_))
    ));
    keep.free(a).unwrap();
    donor.free(b).unwrap();
    // Still out of memory for the device's allocator: the pools keep their
    // cached blocks; the lending pool's cache serves it.
    assert!(matches!(
        main.malloc(30 * MIB, S0),
        Err(AllocError::OutOfMemory(_))
    ));
    let c = donor.malloc_cached(30 * MIB, S0).unwrap().expect("served");
    assert_eq!(c, b);
    assert!(donor.malloc_cached(30 * MIB, S0).unwrap().is_none());
    // Neither pool may grow past the shared cap.
    assert!(matches!(
        keep.malloc(50 * MIB, S0),
        Err(AllocError::OutOfMemory(_))
    ));
    assert!(matches!(
        donor.malloc(20 * MIB, S0),
        Err(AllocError::OutOfMemory(_))
    ));
    assert_eq!(src.allocs().len(), 1);
    // A pool's cache given back makes room for the others.
    keep.empty_cache().unwrap();
    assert_eq!(group.reserved(), 40 * MIB);
    let d = main.malloc(30 * MIB, S0).unwrap();
    // The leader's cap is the group's: raising it lets the pools grow.
    main.set_memory_cap(Some(MemoryCap::Bytes(200 * MIB)))
        .unwrap();
    let e = donor.malloc(20 * MIB, S0).unwrap();
    main.set_memory_cap(None).unwrap();
    assert_eq!(group.cap(), None);
    assert_eq!(keep.effective_cap(), None);
    // A member that goes takes its bytes out of the group.
    donor.free(c).unwrap();
    donor.free(e).unwrap();
    donor.empty_cache().unwrap();
    let before = group.reserved();
    drop(keep);
    assert_eq!(group.reserved(), before);
    let held = donor.stats().reserved_bytes.all().current;
    drop(donor);
    assert_eq!(group.reserved(), before - held);
    main.free(d).unwrap();
    main.check_invariants().unwrap();
}

#[test]
fn a_cap_group_applies_to_expandable_segments_too() {
    let device = SimulatedDevice::new(1 << 30);
    let main = CachingAllocator::new(device.clone(), Config::default());
    assert!(main.is_expandable());
    main.set_memory_cap(Some(MemoryCap::Bytes(64 * MIB)))
        .unwrap();
    let group = CapGroup::new();
    main.join_cap_group(&group, true);
    let pool = CachingAllocator::new(device.clone(), pytorch());
    pool.join_cap_group(&group, false);
    let p = pool.malloc(40 * MIB, S0).unwrap();
    // 40 of the 64 MiB are the pool's: the device's allocator maps no more
    // than the rest.
    assert!(matches!(
        main.malloc(32 * MIB, S0),
        Err(AllocError::OutOfMemory(_))
    ));
    let q = main.malloc(16 * MIB, S0).unwrap();
    assert!(group.reserved() <= 64 * MIB);
    pool.free(p).unwrap();
    main.free(q).unwrap();
}
