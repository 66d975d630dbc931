use super::*;
use crate::simulated::SimulatedDevice;

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

fn new(config: Config) -> (SimulatedDevice, CachingAllocator<SimulatedDevice>) {
    with_capacity(config, 1 << 40)
}

fn with_capacity(
    config: Config,
    capacity: u64,
) -> (SimulatedDevice, CachingAllocator<SimulatedDevice>) {
    let dev = SimulatedDevice::new(capacity);
    (dev.clone(), CachingAllocator::new(dev, config))
}

fn ok(a: &CachingAllocator<SimulatedDevice>) {
    a.check_invariants().unwrap();
}

#[test]
fn freed_block_is_reused_from_the_cache() {
    let (dev, a) = new(Config::pytorch());
    let p = a.malloc(1000, S0).unwrap();
    a.free(p).unwrap();
    let q = a.malloc(900, S0).unwrap();
    assert_eq!(p, q);
    assert_eq!(dev.counters().allocs, 1);
    ok(&a);
}

#[test]
fn invariant_check_catches_a_statistic_that_drifted() {
    let (_, a) = new(Config::pytorch());
    let p = a.malloc(3 * MIB, S0).unwrap();
    ok(&a);
    // 512 bytes more than the blocks account for, as a missed update would leave it.
    a.state
        .lock()
        .core
        .stats
        .active_bytes
        .increase(PoolKind::Large, 512);
    let err = a.check_invariants().unwrap_err();
    assert!(err.contains("stats differ"), "{err}");
    assert!(err.contains("active_bytes"), "{err}");
    a.state
        .lock()
        .core
        .stats
        .active_bytes
        .decrease(PoolKind::Large, 512);
    ok(&a);
    a.free(p).unwrap();
    ok(&a);
}

#[test]
fn segment_sizes_follow_pytorch() {
    let segment_for = |size: u64| {
        let (dev, a) = new(Config::pytorch());
        a.malloc(size, S0).unwrap();
        dev.segments()[0].1
    };
    assert_eq!(segment_for(512), 2 * MIB, "small: 2 MiB segment");
    assert_eq!(segment_for(MIB), 2 * MIB, "≤ 1 MiB is small");
    assert_eq!(segment_for(MIB + 1), 20 * MIB, "1–10 MiB: 20 MiB segment");
    assert_eq!(segment_for(10 * MIB - 512), 20 * MIB);
    assert_eq!(
        segment_for(10 * MIB - 1),
        10 * MIB,
        "the rounded size decides"
    );
    assert_eq!(segment_for(10 * MIB), 10 * MIB, "≥ 10 MiB: own size");
    assert_eq!(segment_for(11 * MIB + 1), 12 * MIB, "rounded up to 2 MiB");
    // Small requests share a segment; a 1 MiB + 512 B request then takes the
    // 20 MiB segment whose remainder serves a 10 MiB request.
    let (dev, a) = new(Config::pytorch());
    a.malloc(512, S0).unwrap();
    a.malloc(MIB, S0).unwrap();
    a.malloc(MIB + 1, S0).unwrap();
    a.malloc(10 * MIB, S0).unwrap();
    assert_eq!(dev.segments().len(), 2);
    ok(&a);
}

#[test]
fn split_and_merge_in_a_segment() {
    let (_, a) = new(Config::pytorch());
    let p: Vec<DevicePtr> = (0..3).map(|_| a.malloc(512, S0).unwrap()).collect();
    assert_eq!(
        p[1].0,
        p[0].0 + 512,
        "blocks are carved from the front of the segment"
    );
    assert_eq!(p[2].0, p[1].0 + 512);
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 1);
    assert_eq!(snap.segments[0].blocks.len(), 4);
    a.free(p[1]).unwrap();
    ok(&a);
    let st = a.stats();
    assert_eq!(st.inactive_split.all().current, 2);
    assert_eq!(st.inactive_split_bytes.all().current, 512 + 2 * MIB - 1536);
    a.free(p[0]).unwrap();
    ok(&a);
    assert_eq!(
        a.snapshot().segments[0].blocks.len(),
        3,
        "freed neighbours merged"
    );
    a.free(p[2]).unwrap();
    ok(&a);
    let snap = a.snapshot();
    assert_eq!(snap.segments[0].blocks.len(), 1, "whole segment free again");
    assert_eq!(a.stats().inactive_split_bytes.all().current, 0);
}

#[test]
fn large_blocks_split_only_with_a_remainder_over_1mib() {
    let (_, a) = new(Config::pytorch());
    // 19.5 MiB request → 20 MiB segment, remainder 0.5 MiB: not split.
    let p = a.malloc(19 * MIB + MIB / 2, S0).unwrap();
    assert_eq!(a.stats().allocated_bytes.all().current, 20 * MIB);
    a.free(p).unwrap();
    // 2 MiB from the cached 20 MiB segment: split, remainder 18 MiB.
    let q = a.malloc(2 * MIB, S0).unwrap();
    assert_eq!(q, p);
    assert_eq!(a.stats().allocated_bytes.all().current, 2 * MIB);
    assert_eq!(a.stats().inactive_split_bytes.all().current, 18 * MIB);
    ok(&a);
}

#[test]
fn best_fit_takes_smallest_then_lowest_address() {
    let (_, a) = new(Config::pytorch());
    let big = a.malloc(40 * MIB, S0).unwrap();
    let x = a.malloc(30 * MIB, S0).unwrap();
    let y = a.malloc(30 * MIB, S0).unwrap();
    a.free(big).unwrap();
    a.free(x).unwrap();
    a.free(y).unwrap();
    let lowest = x.min(y);
    assert_eq!(
        a.malloc(25 * MIB, S0).unwrap(),
        lowest,
        "two 30 MiB blocks: the lower one"
    );
    assert_eq!(a.malloc(25 * MIB, S0).unwrap(), x.max(y));
    assert_eq!(a.malloc(25 * MIB, S0).unwrap(), big);
    ok(&a);
}

#[test]
fn max_split_size_rules() {
    let (dev, a) = new(Config::parse("pytorch,max_split_size_mb:64").unwrap());
    let big = a.malloc(100 * MIB, S0).unwrap();
    a.free(big).unwrap();
    // A small request never takes the oversize block.
    let s = a.malloc(30 * MIB, S0).unwrap();
    assert_ne!(s, big);
    // An oversize request takes it only within 20 MiB.
    let o = a.malloc(70 * MIB, S0).unwrap();
    assert_ne!(o, big, "100 MiB is ≥ 20 MiB more than 70 MiB");
    let o2 = a.malloc(90 * MIB, S0).unwrap();
    assert_eq!(o2, big);
    assert_eq!(a.stats().oversize_allocations.current, 2);
    assert!(a.stats().oversize_segments.current >= 2);
    assert_eq!(dev.counters().allocs, 3);
    ok(&a);
}

#[test]
fn streams_have_their_own_pools() {
    let (dev, a) = new(Config::pytorch());
    let p = a.malloc(4096, S0).unwrap();
    a.free(p).unwrap();
    let q = a.malloc(4096, S1).unwrap();
    assert_ne!(p, q);
    assert_eq!(dev.counters().allocs, 2);
    ok(&a);
}

#[test]
fn record_stream_defers_reuse_until_the_event_completes() {
    let (dev, a) = new(Config::pytorch());
    let p = a.malloc(4096, S0).unwrap();
    a.record_stream(p, S1).unwrap();
    a.record_stream(p, S0).unwrap(); // own stream: no event needed
    a.free(p).unwrap();
    ok(&a);
    let events = dev.pending_events();
    assert_eq!(events.len(), 1);
    assert_eq!(
        a.stats().active.all().current,
        1,
        "still active while awaiting"
    );
    let q = a.malloc(4096, S0).unwrap();
    assert_ne!(p, q, "must not hand out a block stream 1 may still use");
    dev.complete_event(events[0]);
    let r = a.malloc(4096, S0).unwrap();
    assert_eq!(r, p, "reused once the event completed");
    ok(&a);
}

#[test]
fn empty_cache_waits_and_releases_free_segments_only() {
    let (dev, a) = new(Config::pytorch());
    let keep = a.malloc(4096, S0).unwrap(); // small segment stays partly used
    let big = a.malloc(50 * MIB, S0).unwrap();
    let other = a.malloc(30 * MIB, S0).unwrap();
    a.record_stream(other, S1).unwrap();
    a.free(big).unwrap();
    a.free(other).unwrap();
    let r = a.empty_cache().unwrap();
    assert_eq!(
        r,
        Released {
            bytes: 80 * MIB,
            segments: 2
        }
    );
    assert!(
        dev.pending_events().is_empty(),
        "empty_cache waited for the event"
    );
    assert_eq!(dev.segments().len(), 1);
    let f = a.fragmentation();
    assert_eq!(f.reserved, 2 * MIB);
    assert_eq!(f.free, 2 * MIB - 4096);
    ok(&a);
    a.free(keep).unwrap();
    assert_eq!(a.empty_cache().unwrap().segments, 1);
    assert_eq!(dev.outstanding(), 0);
    assert_eq!(a.usage(), Usage::default());
}

#[test]
fn without_oom_flush_cached_segments_stay_until_empty_cache() {
    // A CUDA graph's private pool: its free blocks are still used by the
    // captured graph, so an out-of-memory must not give them back.
    let config = Config {
        oom_flush: false,
        ..Config::pytorch()
    };
    let (dev, a) = with_capacity(config, 100 * MIB);
    let p = a.malloc(60 * MIB, S0).unwrap();
    a.free(p).unwrap();
    let e = a.malloc(70 * MIB, S0).unwrap_err();
    assert!(matches!(e, AllocError::OutOfMemory(_)), "{e}");
    assert_eq!(dev.segments().len(), 1, "the cached segment stays");
    assert_eq!(a.stats().num_device_free, 0);
    assert_eq!(a.usage().reserved, 60 * MIB);
    ok(&a);
    // Only the owner's empty_cache gives it back.
    assert_eq!(a.empty_cache().unwrap().bytes, 60 * MIB);
    assert!(a.malloc(70 * MIB, S0).is_ok());
    ok(&a);
}

#[test]
fn oom_flushes_the_cache_and_retries() {
    let (dev, a) = with_capacity(Config::pytorch(), 100 * MIB);
    let p = a.malloc(60 * MIB, S0).unwrap();
    a.free(p).unwrap();
    // 70 MiB does not fit beside the cached 60 MiB segment: flush and retry.
    let q = a.malloc(70 * MIB, S0).unwrap();
    let st = a.stats();
    assert_eq!(st.num_alloc_retries, 1);
    assert_eq!(st.num_ooms, 0);
    assert_eq!(st.num_device_free, 1);
    assert_eq!(dev.segments().len(), 1);
    ok(&a);
    // 40 MiB can never fit beside the live 70 MiB.
    let e = a.malloc(40 * MIB, S0).unwrap_err();
    let AllocError::OutOfMemory(report) = &e else {
        panic!("{e}")
    };
    assert_eq!(report.requested, 40 * MIB);
    assert_eq!(report.device_total, 100 * MIB);
    assert_eq!(report.device_free, 30 * MIB);
    assert_eq!(report.allocated, 70 * MIB);
    assert_eq!(report.reserved, 70 * MIB);
    let msg = e.to_string();
    for needle in [
        "40.00 MiB",
        "100.00 MiB total",
        "30.00 MiB free",
        "reserved but unallocated",
        "largest free block",
        "fragmentation",
    ] {
        assert!(msg.contains(needle), "{needle:?} missing from: {msg}");
    }
    assert_eq!(a.stats().num_ooms, 1);
    ok(&a);
    // Still works afterwards.
    a.free(q).unwrap();
    assert!(a.malloc(40 * MIB, S0).is_ok());
    ok(&a);
}

#[test]
fn injected_device_failures_go_through_the_ladder() {
    let (dev, a) = new(Config::pytorch());
    dev.fail_next_allocations(1);
    assert!(
        a.malloc(4096, S0).is_ok(),
        "second try after the flush succeeds"
    );
    assert_eq!(a.stats().num_alloc_retries, 1);
    dev.fail_allocations_above(Some(8 * MIB));
    assert!(matches!(
        a.malloc(64 * MIB, S0),
        Err(AllocError::OutOfMemory(_))
    ));
    ok(&a);
}

#[test]
fn memory_cap_bounds_reserved_memory() {
    let (_, a) = new(Config::pytorch());
    a.set_memory_cap(Some(MemoryCap::Bytes(64 * MIB))).unwrap();
    let p = a.malloc(40 * MIB, S0).unwrap();
    assert!(matches!(
        a.malloc(30 * MIB, S0),
        Err(AllocError::OutOfMemory(_))
    ));
    assert!(a.usage().reserved <= 64 * MIB);
    a.free(p).unwrap();
    let q = a.malloc(50 * MIB, S0).unwrap();
    assert!(a.usage().reserved <= 64 * MIB);
    assert_eq!(a.stats().num_alloc_retries, 2);
    a.free(q).unwrap();
    // A fractional cap resolves against the device total (1 TiB here).
    a.set_memory_cap(Some(MemoryCap::Fraction(0.5))).unwrap();
    assert_eq!(a.memory_cap(), Some(1 << 39));
    a.set_memory_cap(None).unwrap();
    assert_eq!(a.memory_cap(), None);
    ok(&a);
}

#[test]
fn lowering_the_cap_releases_free_segments() {
    let (dev, a) = new(Config::pytorch());
    let p = a.malloc(40 * MIB, S0).unwrap();
    a.free(p).unwrap();
    a.set_memory_cap(Some(MemoryCap::Bytes(20 * MIB))).unwrap();
    assert_eq!(dev.segments().len(), 0);
    ok(&a);
}

#[test]
fn cache_info_counts_what_the_device_would_still_give() {
    let (_, a) = with_capacity(Config::pytorch(), 256 * MIB);
    // Nothing cached: the device's free memory.
    assert_eq!(a.cache_info().unwrap(), 256 * MIB);
    let p = a.malloc(40 * MIB, S0).unwrap();
    assert_eq!(a.cache_info().unwrap(), 216 * MIB);
    // Within a cap, only what the cap still allows.
    a.set_memory_cap(Some(MemoryCap::Bytes(64 * MIB))).unwrap();
    assert_eq!(a.cache_info().unwrap(), 24 * MIB);
    // A cached free block larger than that headroom is the answer.
    a.free(p).unwrap();
    assert_eq!(a.fragmentation().largest_free_block, 40 * MIB);
    assert_eq!(a.cache_info().unwrap(), 40 * MIB);
    ok(&a);
}
#[test]
fn misuse_is_an_error_not_corruption() {
    let (_, a) = new(Config::pytorch());
    assert_eq!(a.malloc(0, S0), Err(AllocError::ZeroSize));
    assert_eq!(
        a.malloc(u64::MAX, S0),
        Err(AllocError::SizeTooLarge(u64::MAX))
    );
    assert_eq!(
        a.malloc(crate::MAX_REQUEST + 1, S0),
        Err(AllocError::SizeTooLarge(crate::MAX_REQUEST + 1))
    );
    let p = a.malloc(4096, S0).unwrap();
    let q = a.malloc(4096, S0).unwrap();
    assert_eq!(
        a.free(DevicePtr(p.0 + 512)),
        Err(AllocError::InteriorPointer {
            ptr: DevicePtr(p.0 + 512),
            block: p
        })
    );
    assert_eq!(
        a.free(DevicePtr(12345)),
        Err(AllocError::UnknownPointer(DevicePtr(12345)))
    );
    a.free(q).unwrap();
    assert_eq!(a.free(q), Err(AllocError::DoubleFree(q)));
    assert_eq!(a.record_stream(q, S1), Err(AllocError::DoubleFree(q)));
    assert!(a.record_stream(DevicePtr(7), S1).is_err());
    ok(&a);
    a.free(p).unwrap();
    assert!(a.free(p).is_err());
    ok(&a);
    assert_eq!(a.stats().allocation.all().current, 0);
}

#[test]
fn stats_peaks_and_reset() {
    let (_, a) = new(Config::pytorch());
    let p = a.malloc(30 * MIB, S0).unwrap();
    let q = a.malloc(1000, S0).unwrap();
    a.free(p).unwrap();
    let st = a.stats();
    assert_eq!(st.allocated_bytes.all().peak, 30 * MIB + 1024);
    assert_eq!(st.allocated_bytes.all().current, 1024);
    assert_eq!(st.requested_bytes.all().current, 1000);
    assert_eq!(st.allocated_bytes.pool(PoolKind::Large).peak, 30 * MIB);
    assert_eq!(st.segment.all().current, 2);
    a.reset_peak_stats();
    assert_eq!(a.stats().allocated_bytes.all().peak, 1024);
    a.free(q).unwrap();
    assert_eq!(a.stats().allocation.all().allocated, 2);
    assert_eq!(a.stats().allocation.all().freed, 2);
}

#[test]
fn no_caching_returns_every_block_at_once() {
    let (dev, a) = new(Config::no_caching());
    let p = a.malloc(1000, S0).unwrap();
    assert_eq!(dev.segments(), vec![(p, 1024)]);
    a.free(p).unwrap();
    assert_eq!(dev.outstanding(), 0);
    let q = a.malloc(1000, S0).unwrap();
    a.record_stream(q, S1).unwrap();
    a.free(q).unwrap();
    assert_eq!(dev.outstanding(), 1, "held until stream 1 is done");
    dev.complete_all_events();
    a.process_events().unwrap();
    assert_eq!(dev.outstanding(), 0);
    assert_eq!(dev.counters().allocs, 2);
    ok(&a);
}

#[test]
fn garbage_collection_frees_old_unsplit_blocks() {
    let (dev, a) = new(Config::parse("pytorch,garbage_collection_threshold:0.5").unwrap());
    a.set_memory_cap(Some(MemoryCap::Bytes(100 * MIB))).unwrap();
    let p = a.malloc(30 * MIB, S0).unwrap();
    let q = a.malloc(30 * MIB, S0).unwrap();
    a.free(p).unwrap();
    // Reserved 60 MiB > 50 MiB threshold: the next miss collects the free 30 MiB segment.
    let _r = a.malloc(32 * MIB, S0).unwrap();
    assert_eq!(a.stats().num_device_free, 1);
    assert_eq!(a.stats().num_alloc_retries, 0);
    assert_eq!(dev.segments().len(), 2);
    a.free(q).unwrap();
    ok(&a);
}

#[test]
fn recording_writes_the_trace_format() {
    use std::sync::{Arc, Mutex};
    let (_, a) = new(Config::pytorch());
    let before = a.malloc(100, S0).unwrap();
    let lines = Arc::new(Mutex::new(Vec::new()));
    let sink = lines.clone();
    a.start_recording(Box::new(move |e| sink.lock().unwrap().push(e.to_string())));
    let p = a.malloc(5000, S1).unwrap();
    a.free(before).unwrap();
    a.free(p).unwrap();
    a.empty_cache().unwrap();
    assert!(a.stop_recording());
    assert!(!a.stop_recording());
    assert_eq!(
        *lines.lock().unwrap(),
        vec!["a 0 100 0", "a 1 5000 1", "f 0", "f 1", "e"]
    );
}

#[test]
fn allocator_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<CachingAllocator<SimulatedDevice>>();
}

#[test]
fn huge_pool_is_kept_for_huge_requests() {
    let (dev, a) = new(default_plain());
    let h = a.malloc(300 * MIB, S0).unwrap();
    assert_eq!(dev.segments(), vec![(h, 300 * MIB)]);
    a.free(h).unwrap();
    let l = a.malloc(100 * MIB, S0).unwrap();
    assert!(
        l.0 < h.0 || l.0 >= h.0 + 300 * MIB,
        "a large request does not carve the huge segment"
    );
    // A huge request under half the free huge segment does not take it either.
    let big = a.malloc(700 * MIB, S0).unwrap();
    a.free(big).unwrap();
    let small_huge = a.malloc(300 * MIB, S0).unwrap();
    assert_ne!(small_huge, big);
    let st = a.stats();
    assert_eq!(
        st.allocated_bytes.pool(PoolKind::Huge).current,
        st.allocated_bytes.pool(PoolKind::Large).current
    );
    ok(&a);
}

/// The plain-segment policy with a huge pool from 256 MiB.
fn default_plain() -> Config {
    Config::parse("segments,huge_size_mb:256").unwrap()
}

/// A huge segment whose 300 MiB block went free and a 260 MiB block took
/// again: 40 MiB of free tail in the huge pool. Returns the segment's address.
fn huge_segment_with_a_free_tail(a: &CachingAllocator<SimulatedDevice>) -> DevicePtr {
    let h = a.malloc(300 * MIB, S0).unwrap();
    a.free(h).unwrap();
    assert_eq!(a.malloc(260 * MIB, S0).unwrap(), h);
    h
}

#[test]
fn a_request_the_device_has_no_room_for_takes_a_free_tail_of_another_kind() {
    // The huge segment takes the whole device: no segment of any size fits.
    let (dev, a) = with_capacity(default_plain(), 300 * MIB);
    assert!(a.config().oom_other_kinds);
    let h = huge_segment_with_a_free_tail(&a);
    let l = a.malloc(30 * MIB, S0).unwrap();
    assert!(l.0 >= h.0 + 260 * MIB && l.0 + 30 * MIB <= h.0 + 300 * MIB);
    assert_eq!(dev.segments(), vec![(h, 300 * MIB)]);
    let st = a.stats();
    assert_eq!((st.num_other_kind_fits, st.num_ooms), (1, 0));
    ok(&a);
    // A small request finds room the same way in the rest of that tail.
    let s = a.malloc(1000, S0).unwrap();
    assert!(s.0 >= l.0 + 30 * MIB && s.0 < h.0 + 300 * MIB);
    assert_eq!(a.stats().num_other_kind_fits, 2);
    ok(&a);
    // Freed, the blocks merge back into the huge segment's free tail.
    a.free(s).unwrap();
    a.free(l).unwrap();
    ok(&a);
    assert_eq!(a.malloc(40 * MIB, S0).unwrap().0, h.0 + 260 * MIB);
    assert_eq!(a.stats().num_other_kind_fits, 3);
    // Nothing of any kind fits: out of memory, as before.
    let e = a.malloc(30 * MIB, S0).unwrap_err();
    assert!(matches!(e, AllocError::OutOfMemory(_)), "{e}");
    ok(&a);
}

#[test]
fn with_oom_other_kinds_off_a_free_tail_of_another_kind_stays_unused() {
    let config = Config::parse("segments,huge_size_mb:256,oom_other_kinds:false").unwrap();
    let (_, a) = with_capacity(config, 300 * MIB);
    huge_segment_with_a_free_tail(&a);
    let e = a.malloc(30 * MIB, S0).unwrap_err();
    assert!(matches!(e, AllocError::OutOfMemory(_)), "{e}");
    assert_eq!(a.stats().num_other_kind_fits, 0);
    ok(&a);
}

#[test]
fn kinds_stay_apart_while_the_device_has_room() {
    let (dev, a) = with_capacity(default_plain(), 400 * MIB);
    let h = huge_segment_with_a_free_tail(&a);
    let l = a.malloc(30 * MIB, S0).unwrap();
    assert!(l.0 + 30 * MIB <= h.0 || l.0 >= h.0 + 300 * MIB);
    assert_eq!(dev.segments().len(), 2);
    assert_eq!(a.stats().num_other_kind_fits, 0);
    ok(&a);
}

/// Note [Plain segments never wait in steady state]: a training loop whose
/// shapes change every step makes no device free under `segments` (each
/// `cuMemFree` waits for the whole device); segments go back only on
/// `empty_cache()`. Fails if a release rule comes back.
#[test]
fn plain_segments_free_nothing_in_a_steady_variable_shape_loop() {
    let (dev, a) = new(Config::segments());
    assert!(!a.is_expandable());
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let weights = a.malloc(300 * MIB, S0).unwrap();
    for step in 0..400 {
        // Activations of a batch whose size varies 1x..8x, a huge one now and then.
        let scale = 1 + next() % 8;
        let mut live = Vec::new();
        for layer in 0..12u64 {
            let bytes = (layer + 1) * scale * MIB / 2 + next() % 4096;
            live.push(a.malloc(bytes, S0).unwrap());
        }
        if step % 7 == 0 {
            live.push(a.malloc((256 + next() % 512) * MIB, S0).unwrap());
        }
        live.push(a.malloc(1 + next() % (64 << 10), S0).unwrap());
        for p in live.into_iter().rev() {
            a.free(p).unwrap();
        }
    }
    let st = a.stats();
    assert_eq!(st.num_device_free, 0, "a segment went back in steady state");
    assert_eq!(dev.counters().frees, 0);
    assert_eq!(dev.counters().synchronizes, 0);
    assert!(st.num_device_alloc > 0);
    ok(&a);
    // empty_cache gives back every entirely free segment.
    a.free(weights).unwrap();
    let released = a.empty_cache().unwrap();
    assert_eq!(released.segments, st.num_device_alloc);
    assert_eq!(dev.segments(), vec![]);
}

/// `default` maps pages (expandable segments) on a device with the virtual
/// memory API, and is the `segments` policy, with a notice, on one without.
#[test]
fn default_picks_expandable_segments_where_the_device_has_them() {
    let (dev, a) = new(Config::default());
    assert!(a.is_expandable());
    assert!(a.notices().is_empty(), "{:?}", a.notices());
    let p = a.malloc(30 * MIB, S0).unwrap();
    assert!(dev.counters().vmm_maps > 0);
    assert_eq!(dev.counters().allocs, 0, "no plain segment");
    a.free(p).unwrap();
    ok(&a);
    let plain = SimulatedDevice::new(1 << 34).without_vmm();
    let a = CachingAllocator::new(plain.clone(), Config::default());
    assert!(!a.is_expandable());
    let notices = a.notices();
    assert_eq!(notices.len(), 1, "{notices:?}");
    assert!(notices[0].starts_with("default: ") && notices[0].contains("`segments`"));
    let p = a.malloc(30 * MIB, S0).unwrap();
    assert_eq!(plain.counters().allocs, 1);
    assert_eq!(plain.counters().vmm_maps, 0);
    a.free(p).unwrap();
    ok(&a);
}

mod expandable {
    use super::*;
    use crate::allocator::expandable::{MARKER_INTERVAL, MAX_MARKERS};

    const PAGE: u64 = 2 * MIB;

    /// The expandable preset with 2 MiB pages in every pool (the arithmetic
    /// below counts pages), shadows off: a page that moves is unmapped where
    /// it was, and the tests count those unmaps (shadows have tests of their own).
    fn small_pages() -> Config {
        Config {
            expandable_page: PAGE,
            expandable_shadows: false,
            ..Config::expandable()
        }
    }

    #[test]
    fn large_pool_pages_are_the_configured_multiple() {
        let (dev, a) = new(Config {
            expandable_page_divisor: 0,
            ..Config::expandable()
        });
        a.malloc(3 * MIB, S0).unwrap();
        assert_eq!(
            a.usage().reserved,
            8 * MIB,
            "one 8 MiB page in the large pool"
        );
        a.malloc(512 * 1024, S0).unwrap();
        assert_eq!(
            a.usage().reserved,
            10 * MIB,
            "the small pool maps 2 MiB pages"
        );
        assert_eq!(dev.counters().vmm_creates, 2);
        ok(&a);
    }

    #[test]
    fn pages_are_mapped_under_blocks_only() {
        let (dev, a) = new(small_pages());
        assert!(a.is_expandable());
        let p = a.malloc(5 * MIB / 2, S0).unwrap();
        assert_eq!(
            a.usage().reserved,
            2 * PAGE,
            "2.5 MiB needs two 2 MiB pages"
        );
        let q = a.malloc(3 * MIB / 2, S0).unwrap(); // shares the second page
        assert_eq!(q.0, p.0 + 5 * MIB / 2);
        assert_eq!(a.usage().reserved, 2 * PAGE);
        assert_eq!(dev.used(), 2 * PAGE);
        ok(&a);
        a.free(p).unwrap();
        a.free(q).unwrap();
        assert_eq!(a.usage().reserved, 2 * PAGE, "pages stay mapped as cache");
        ok(&a);
        let r = a.empty_cache().unwrap();
        assert_eq!(
            r,
            Released {
                bytes: 2 * PAGE,
                segments: 1
            }
        );
        assert_eq!(dev.outstanding(), 0);
        assert_eq!(a.usage().reserved, 0);
        let st = a.stats();
        assert_eq!(
            (
                st.num_page_create,
                st.num_map,
                st.num_unmap,
                st.num_page_release
            ),
            // The two pages lie side by side: empty_cache unmaps them in one call.
            (2, 2, 1, 2)
        );
        assert_eq!(dev.counters().vmm_pages_unmapped, 2);
        ok(&a);
    }

    #[test]
    fn idle_pages_move_instead_of_growing_past_the_peak() {
        let (dev, a) = new(Config {
            expandable_shadows: false,
            ..small_pages()
        });
        let x = a.malloc(10 * MIB, S0).unwrap();
        let y = a.malloc(10 * MIB, S0).unwrap();
        a.free(x).unwrap();
        // 12 MiB fits no hole: it goes to the end of the range; the 5 idle pages
        // of x's hole are unmapped and mapped there, one new page is created.
        let z = a.malloc(12 * MIB, S0).unwrap();
        assert!(z.0 >= y.0 + 10 * MIB);
        let st = a.stats();
        assert_eq!(st.reserved_bytes.all().peak, 22 * MIB);
        // Unmapped, or (its own stream's) reused at once and unmapped once
        // the stream is past them.
        assert_eq!(st.num_unmap + st.num_pages_reused_early, 5);
        assert_eq!(st.num_page_create, 11);
        assert_eq!(dev.counters().vmm_creates, 11);
        ok(&a);
        // A fixed-segment allocator needs 32 MiB for the same sequence.
        let (_, b) = new(Config::pytorch());
        let x = b.malloc(10 * MIB, S0).unwrap();
        b.malloc(10 * MIB, S0).unwrap();
        b.free(x).unwrap();
        b.malloc(12 * MIB, S0).unwrap();
        assert_eq!(b.stats().reserved_bytes.all().peak, 32 * MIB);
    }

    #[test]
    fn cap_recycles_then_fails_with_a_report() {
        let (_, a) = new(small_pages());
        a.set_memory_cap(Some(MemoryCap::Bytes(16 * MIB))).unwrap();
        let x = a.malloc(8 * MIB, S0).unwrap();
        let _y = a.malloc(8 * MIB, S0).unwrap();
        a.free(x).unwrap();
        // No hole fits 8 MiB + 512 B: at the end of the range it needs five
        // pages, the cap allows four and x's four idle pages are all there is.
        assert!(matches!(
            a.malloc(8 * MIB + 512, S0),
            Err(AllocError::OutOfMemory(_))
        ));
        ok(&a);
        let z = a.malloc(6 * MIB + 512, S0).unwrap();
        assert!(a.usage().reserved <= 16 * MIB);
        ok(&a);
        let e = a.malloc(4 * MIB, S0).unwrap_err();
        assert!(matches!(e, AllocError::OutOfMemory(_)), "{e}");
        assert!(e.to_string().contains("capped at 16.00 MiB"), "{e}");
        assert_eq!(a.stats().num_ooms, 2);
        ok(&a);
        a.free(z).unwrap();
        assert!(
            a.malloc(4 * MIB, S0).is_ok(),
            "works again once memory is free"
        );
        ok(&a);
    }

    #[test]
    fn device_full_recycles_idle_pages_of_other_pools() {
        let dev = SimulatedDevice::new(8 * MIB);
        let a = CachingAllocator::new(dev.clone(), small_pages());
        let small = a.malloc(512 * 1024, S0).unwrap(); // small pool: one page
        let large = a.malloc(6 * MIB, S0).unwrap(); // large pool: three pages
        a.free(small).unwrap();
        a.free(large).unwrap();
        // 8 MiB needs four pages: the device has none left, all four come from idle pages.
        let p = a.malloc(8 * MIB, S0).unwrap();
        assert_eq!(p, large);
        assert_eq!(dev.counters().vmm_creates, 4);
        ok(&a);
    }

    #[test]
    fn recycling_takes_idle_pages_of_the_size_it_lacks_first() {
        const S2: StreamId = StreamId(2);
        // 2 MiB small-pool pages and 8 MiB large-pool pages (the preset's);
        // without shadows, so that every page taken is unmapped.
        let (dev, a) = new(Config {
            expandable_shadows: false,
            expandable_page_divisor: 0,
            ..Config::expandable()
        });
        let pair = |stream| {
            let p = a.malloc(512, stream).unwrap();
            a.free(p).unwrap();
        };
        // Nothing is idle while these are created.
        let y = a.malloc(8 * MIB, S1).unwrap();
        let z = a.malloc(8 * MIB, S0).unwrap();
        let small: Vec<_> = (0..4).map(|_| a.malloc(MIB, S0).unwrap()).collect();
        let m = a.malloc(MIB, S0).unwrap(); // a third small page
        pair(S2); // stream 2's small page
        for p in small {
            a.free(p).unwrap(); // two small pages, idle longest
        }
        // An interval of operations elsewhere, so that the next free on
        // stream 0 records a marker behind the small pages' frees.
        for _ in 0..MARKER_INTERVAL {
            pair(S2);
        }
        a.free(m).unwrap();
        a.free(y).unwrap();
        dev.complete_all_events();
        assert_eq!(dev.counters().vmm_creates, 6, "4 small pages, 2 large");
        // Another 8 MiB on stream 0 would lift reserved memory past the peak:
        // an idle page moves. Longest idle first, stream 0's three small
        // pages come before stream 1's 8 MiB page, but this request lacks an
        // 8 MiB page: that one moves, and the small pages stay mapped.
        let before = dev.counters();
        let w = a.malloc(8 * MIB, S0).unwrap();
        ok(&a);
        let again: Vec<_> = (0..4).map(|_| a.malloc(MIB, S0).unwrap()).collect();
        let c = dev.counters();
        assert_eq!((c.vmm_creates, c.vmm_releases), (6, 0), "{c:?}");
        assert_eq!(
            (
                c.vmm_unmaps - before.vmm_unmaps,
                c.vmm_maps - before.vmm_maps
            ),
            (1, 1),
            "one page moved: {c:?}"
        );
        for p in again.into_iter().chain([w, z]) {
            a.free(p).unwrap();
        }
        ok(&a);
    }

    #[test]
    fn a_near_fit_over_mapped_pages_comes_before_a_best_fit_without() {
        for (idle, taken) in [(6 * MIB, true), (20 * MIB, false)] {
            let (dev, a) = new(small_pages());
            let x = a.malloc(4 * MIB, S0).unwrap();
            let _b = a.malloc(2 * MIB, S0).unwrap();
            let c = a.malloc(idle, S0).unwrap();
            let _d = a.malloc(2 * MIB, S0).unwrap();
            // x's hole: its pages gone; c's hole: its pages mapped, idle.
            a.free(x).unwrap();
            a.empty_cache().unwrap();
            a.free(c).unwrap();
            let before = dev.counters();
            let p = a.malloc(4 * MIB, S0).unwrap();
            let after = dev.counters();
            if taken {
                // Up to four times the best fit's size: the mapped hole, no call.
                assert_eq!(p, c);
                assert_eq!(after, before);
            } else {
                // Larger than that: the best fit, its pages mapped.
                assert_eq!(p, x);
                assert_eq!(after.vmm_maps - before.vmm_maps, 2);
            }
            ok(&a);
        }
    }

    #[test]
    fn pages_of_blocks_awaiting_events_are_not_recycled() {
        let dev = SimulatedDevice::new(4 * MIB);
        let a = CachingAllocator::new(dev.clone(), small_pages());
        let p = a.malloc(4 * MIB, S0).unwrap();
        a.record_stream(p, S1).unwrap();
        a.free(p).unwrap();
        // The only pages belong to a block stream 1 may still use: the new
        // block goes elsewhere in the range, and its pages come from p's only
        // after a recycling round waited for the device (and so for stream 1).
        let events = dev.pending_events();
        assert_eq!(events.len(), 2, "stream 1's event and stream 0's marker");
        let q = a.malloc(4 * MIB, S0).unwrap();
        assert_ne!(
            q, p,
            "p's block was still awaiting its event when q was placed"
        );
        assert!(
            dev.pending_events().is_empty(),
            "the event completed before p's pages moved"
        );
        assert_eq!(a.stats().num_sync_all_streams, 0, "no device-wide wait");
        assert_eq!(dev.counters().synchronizes, 0);
        assert!(a.stats().num_event_waits >= 2, "{:?}", a.stats());
        assert_eq!(
            dev.counters().vmm_creates,
            2,
            "no page beyond the device: p's two pages moved"
        );
        assert_eq!(a.stats().num_unmap, 2);
        ok(&a);
    }

    #[test]
    fn falls_back_without_the_virtual_memory_api() {
        /// A device that has no VMM methods (the trait's defaults).
        struct Plain(SimulatedDevice);
        impl Device for Plain {
            type Event = crate::simulated::SimEvent;
            fn allocate(&self, bytes: u64) -> Result<DevicePtr, DeviceError> {
                self.0.allocate(bytes)
            }
            fn free(&self, ptr: DevicePtr, bytes: u64) -> Result<(), DeviceError> {
                self.0.free(ptr, bytes)
            }
            fn mem_info(&self) -> Result<crate::device::MemInfo, DeviceError> {
                self.0.mem_info()
            }
            fn record_event(&self, s: StreamId) -> Result<Self::Event, DeviceError> {
                self.0.record_event(s)
            }
            fn event_completed(&self, e: &Self::Event) -> Result<bool, DeviceError> {
                self.0.event_completed(e)
            }
            fn wait_event(&self, e: &Self::Event) -> Result<(), DeviceError> {
                self.0.wait_event(e)
            }
            fn release_event(&self, e: Self::Event) {
                self.0.release_event(e)
            }
            fn synchronize(&self) -> Result<(), DeviceError> {
                self.0.synchronize()
            }
        }
        let a = CachingAllocator::new(Plain(SimulatedDevice::unlimited()), Config::expandable());
        assert!(!a.is_expandable());
        assert!(
            a.notices()[0].contains("using plain segments"),
            "{:?}",
            a.notices()
        );
        let p = a.malloc(MIB, S0).unwrap();
        a.free(p).unwrap();
        a.check_invariants().unwrap();
    }

    #[test]
    fn a_stream_far_behind_is_asked_about_once_an_interval_not_on_every_free() {
        // The simulated device completes no event until told: every marker
        // stays outstanding, as on a GPU far behind the host.
        let (dev, a) = new(Config::expandable());
        let pairs = 20_000;
        for _ in 0..pairs {
            let p = a.malloc(4096, S0).unwrap();
            a.free(p).unwrap();
        }
        let c = dev.counters();
        assert_eq!(
            c.events_recorded, MAX_MARKERS as u64,
            "markers stop at the bound"
        );
        let intervals = 2 * pairs / MARKER_INTERVAL;
        assert!(
            c.event_queries <= intervals,
            "{} queries for {} operations",
            c.event_queries,
            2 * pairs
        );
        ok(&a);
    }

    #[test]
    fn snapshot_and_report_count_mapped_bytes_only() {
        let (_, a) = new(small_pages());
        let _p = a.malloc(3 * MIB, S0).unwrap();
        let snap = a.snapshot();
        assert_eq!(snap.segments.len(), 1);
        assert_eq!(snap.segments[0].mapped_size, 4 * MIB);
        assert!(snap.segments[0].total_size >= 1 << 30);
        let f = a.fragmentation();
        assert_eq!(f.reserved, 4 * MIB);
        assert_eq!(f.free, MIB);
        assert_eq!(f.largest_free_block, MIB);
        assert_eq!(f.segments[0].size, 4 * MIB);
        assert_eq!(a.stats().inactive_split_bytes.all().current, 0);
    }
}

#[test]
fn expandable_range_outgrows_the_device_so_holes_do_not_exhaust_address_space() {
    // 64 MiB device; 2 MiB pages. Fill it with 2 MiB blocks, free every
    // other one: 32 MiB of memory is idle but scattered in 2 MiB holes. A
    // 30 MiB block needs contiguous *address space* only: the range is
    // larger than the device, so it fits after the live blocks and takes
    // the idle pages.
    let dev = SimulatedDevice::new(64 * MIB);
    let config = Config {
        expandable_page: 2 * MIB,
        ..Config::expandable()
    };
    let a = CachingAllocator::new(dev.clone(), config);
    let blocks: Vec<DevicePtr> = (0..32).map(|_| a.malloc(2 * MIB, S0).unwrap()).collect();
    for p in blocks.iter().step_by(2) {
        a.free(*p).unwrap();
    }
    let big = a.malloc(30 * MIB, S0).unwrap();
    assert!(big.0 >= blocks[31].0 + 2 * MIB);
    assert!(dev.used() <= 64 * MIB);
    ok(&a);
}

#[test]
fn expandable_ranges_of_thousands_of_streams_fit_the_address_space() {
    // The first pools get the largest ranges (256 GiB on this device); later
    // ones start at 2 GiB and double as they grow, so 3000 streams fit in
    // the simulated 127 TiB of address space. (With 256 GiB each, a few
    // hundred did.)
    let (dev, a) = new(Config::expandable());
    let live: Vec<DevicePtr> = (0..3000)
        .map(|s| a.malloc(4096 + 3 * MIB * (s % 2), StreamId(s)).unwrap())
        .collect();
    assert_eq!(a.stats().num_ooms, 0);
    let snap = a.snapshot();
    let sizes: Vec<u64> = snap.segments.iter().map(|s| s.total_size).collect();
    assert_eq!(sizes.iter().filter(|&&s| s == 256 << 30).count(), 64);
    assert!(sizes.iter().all(|&s| s == 256 << 30 || s == 2 << 30));
    // A pool that outgrows its range gets one twice as large.
    let big = a.malloc(3 << 30, StreamId(2999)).unwrap();
    let snap = a.snapshot();
    assert!(snap.segments.iter().any(|s| s.total_size == 6 << 30));
    ok(&a);
    a.free(big).unwrap();
    for p in live {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(dev.outstanding(), 0);
    ok(&a);
}

/// An expandable allocator (2 MiB pages, soft limit at the peak, no hard
/// limit; early reuse as `early` says; shadows off, so that moved pages
/// are counted as unmaps) with a 4 MiB hole (2 pages) behind a
/// live block, freed before `small_ops` small-pool operations that record
/// markers (left pending unless the caller completes them). Returns the live
/// block too.
fn hole_behind_markers(
    dev: &SimulatedDevice,
    small_ops: u32,
    early: bool,
) -> (CachingAllocator<SimulatedDevice>, DevicePtr) {
    let (a, _, keep) = hole_with(dev, small_ops, early, false);
    (a, keep)
}

/// [`hole_behind_markers`] with shadows as `shadows` says; returns x too.
fn hole_with(
    dev: &SimulatedDevice,
    small_ops: u32,
    _early: bool,
    shadows: bool,
) -> (CachingAllocator<SimulatedDevice>, DevicePtr, DevicePtr) {
    let config = Config {
        expandable_shadows: shadows,
        expandable_page: 2 * MIB,
        idle_slack: 0.0,
        idle_slack_hard: 10.0,
        ..Config::expandable()
    };
    let a = CachingAllocator::new(dev.clone(), config);
    let x = a.malloc(4 * MIB, S0).unwrap();
    let keep = a.malloc(MIB + 512, S0).unwrap(); // after x: x's hole stays a hole
    a.free(x).unwrap();
    small_traffic(&a, small_ops);
    (a, x, keep)
}

#[test]
fn expandable_moves_quiescent_pages_without_waiting_for_the_device() {
    // Soft limit at the peak, no hard limit: only pages no queued work can
    // touch may move, and nothing ever waits for the device.
    let run = |complete_markers: bool| {
        let dev = SimulatedDevice::new(1 << 30);
        let (a, keep) = hole_behind_markers(&dev, 200, false);
        if complete_markers {
            dev.complete_all_events();
        }
        let before = dev.counters();
        let y = a.malloc(6 * MIB, S0).unwrap(); // fits no hole: needs 3 pages past the peak
        let after = dev.counters();
        assert_eq!(
            after.synchronizes,
            before.synchronizes,
            "never waits for the device: {:?} {:?}",
            a.stats().num_sync_all_streams,
            a.usage()
        );
        a.free(y).unwrap();
        a.free(keep).unwrap();
        a.check_invariants().unwrap();
        (
            after.vmm_unmaps - before.vmm_unmaps,
            after.vmm_creates - before.vmm_creates,
        )
    };
    let (unmaps, creates) = run(true);
    assert_eq!(
        (unmaps, creates),
        (2, 1),
        "x's two quiescent pages moved, one page created"
    );
    let (unmaps, creates) = run(false);
    assert_eq!(
        (unmaps, creates),
        (0, 3),
        "x's pages may still be in use: grown instead"
    );
}

/// An expandable allocator with shadows (2 MiB pages, soft limit at the
/// peak, no hard limit) in which x's two pages were moved under y: returns
/// it with x's address, y and the live block between them.
fn moved_with_shadows(
    dev: &SimulatedDevice,
    early: bool,
) -> (
    CachingAllocator<SimulatedDevice>,
    DevicePtr,
    DevicePtr,
    DevicePtr,
) {
    let (a, x, keep) = hole_with(dev, 200, early, true);
    dev.complete_all_events();
    let before = dev.counters();
    let y = a.malloc(6 * MIB, S0).unwrap(); // fits no hole: x's pages move
    let after = dev.counters();
    assert_eq!(
        after.vmm_unmaps, before.vmm_unmaps,
        "moved without unmapping"
    );
    assert_eq!(after.vmm_maps - before.vmm_maps, 3);
    assert_eq!(after.vmm_creates - before.vmm_creates, 1);
    let stale = a.stale_mappings();
    assert_eq!(stale.len(), 2, "x's old mappings stay: {stale:?}");
    assert!(stale.iter().all(|&(p, n, _)| n == 2 * MIB && p.0 < keep.0));
    a.check_invariants().unwrap();
    (a, x, y, keep)
}

/// Small-pool traffic advances the clock: markers are recorded.
fn small_traffic(a: &CachingAllocator<SimulatedDevice>, ops: u32) {
    for _ in 0..ops {
        let p = a.malloc(4096, S0).unwrap();
        a.free(p).unwrap();
    }
}

#[test]
fn expandable_shadow_takes_its_page_back_with_no_driver_call() {
    let dev = SimulatedDevice::new(1 << 30);
    let (a, x, y, keep) = moved_with_shadows(&dev, true);
    a.free(y).unwrap();
    small_traffic(&a, 200);
    dev.complete_all_events();
    let reserved = a.usage().reserved;
    let before = dev.counters();
    let x2 = a.malloc(4 * MIB, S0).unwrap();
    let after = dev.counters();
    assert_eq!(x2, x, "best fit: x's hole");
    assert_eq!(after.vmm_maps, before.vmm_maps, "no map");
    assert_eq!(after.vmm_unmaps, before.vmm_unmaps, "no unmap");
    assert_eq!(after.vmm_creates, before.vmm_creates);
    assert_eq!(a.stats().num_pages_revived, 2);
    assert_eq!(a.usage().reserved, reserved);
    // The pages' mappings under y's old place are the shadows now.
    let stale = a.stale_mappings();
    assert_eq!(stale.len(), 2, "{stale:?}");
    assert!(stale.iter().all(|&(p, _, _)| p.0 > keep.0));
    a.check_invariants().unwrap();
    // empty_cache unmaps the shadows with the idle pages.
    a.free(x2).unwrap();
    a.free(keep).unwrap();
    a.empty_cache().unwrap();
    assert!(a.stale_mappings().is_empty());
    assert!(dev.mappings().is_empty());
    assert_eq!(a.usage().reserved, 0);
    a.check_invariants().unwrap();
}

#[test]
fn expandable_shadow_does_not_take_a_page_queued_work_may_touch() {
    // y's pages may still be in use: freed while another stream used it
    // (its event pending). x's place gets other pages (its shadows unmapped
    // first) instead of taking them back.
    {
        let other_stream = true;
        let dev = SimulatedDevice::new(1 << 30);
        let (a, x, y, keep) = moved_with_shadows(&dev, false);
        if other_stream {
            a.record_stream(y, StreamId(7)).unwrap();
        }
        a.free(y).unwrap();
        small_traffic(&a, 200); // markers recorded, left pending
        let before = dev.counters();
        let x2 = a.malloc(4 * MIB, S0).unwrap();
        let after = dev.counters();
        assert_eq!(x2, x);
        assert_eq!(
            a.stats().num_pages_revived,
            0,
            "other stream: {other_stream}"
        );
        assert_eq!(after.vmm_maps - before.vmm_maps, 2, "two pages mapped at x");
        assert_eq!(
            after.vmm_unmaps - before.vmm_unmaps,
            2,
            "x's shadows went first"
        );
        a.check_invariants().unwrap();
        a.free(x2).unwrap();
        a.free(keep).unwrap();
        a.empty_cache().unwrap();
        assert!(dev.mappings().is_empty());
        a.check_invariants().unwrap();
    }
}

#[test]
fn expandable_steps_around_an_old_mapping_queued_work_may_use() {
    // Pages at the peak: x's hole (2 pages, freed with its stream's markers
    // pending) and w's (3 pages, quiescent). y needs 4 pages: w's 3 and one
    // of x's, reused early (its old mapping at x stays until the stream is
    // past x's free). z fits x's hole best, but mapping there would first
    // wait for the stream: it takes w's hole, the next best fit, instead.
    let dev = SimulatedDevice::new(1 << 30);
    let config = Config {
        expandable_page: 2 * MIB,
        idle_slack: 0.0,
        idle_slack_hard: 0.0,
        ..Config::expandable()
    };
    let a = CachingAllocator::new(dev.clone(), config);
    let x = a.malloc(4 * MIB, S0).unwrap();
    let k1 = a.malloc(MIB + 512, S0).unwrap();
    let w = a.malloc(6 * MIB, S0).unwrap();
    let k2 = a.malloc(MIB + 512, S0).unwrap();
    a.free(w).unwrap();
    small_traffic(&a, 200);
    dev.complete_all_events();
    a.free(x).unwrap();
    small_traffic(&a, 200); // markers after x's free, left pending
    let y = a.malloc(8 * MIB, S0).unwrap();
    assert!(y.0 > k2.0, "fits no hole");
    assert!(a.stats().num_pages_reused_early >= 1, "{:?}", a.stats());
    assert!(!a.stale_mappings().is_empty());
    let waits = a.stats().num_marker_waits;
    let z = a.malloc(4 * MIB, S0).unwrap();
    assert_eq!(z, w, "the next best fit, with no wait");
    assert_eq!(a.stats().num_marker_waits, waits);
    a.check_invariants().unwrap();
    for p in [y, z, k1, k2] {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert!(dev.mappings().is_empty());
    a.check_invariants().unwrap();
}

#[test]
fn expandable_cross_stream_waits_on_the_device_not_the_host() {
    // x's pages, freed on stream 1 whose work may still use them, are all
    // there is when stream 0 needs pages past the peak. With
    // `expandable_cross_stream`, stream 0 is made to wait for stream 1 on the
    // device and takes them at once; otherwise the host waits for a marker.
    let run = |cross: bool| {
        let dev = SimulatedDevice::new(1 << 30);
        let config = Config {
            expandable_page: 2 * MIB,
            idle_slack: 0.0,
            idle_slack_hard: 0.0,
            expandable_cross_stream: cross,
            ..Config::expandable()
        };
        let a = CachingAllocator::new(dev.clone(), config);
        let x = a.malloc(4 * MIB, S1).unwrap();
        let keep = a.malloc(MIB + 512, S1).unwrap();
        a.free(x).unwrap(); // its marker stays pending
        let reserved = a.usage().reserved;
        let y = a.malloc(4 * MIB, S0).unwrap();
        let st = a.stats();
        let moved = (
            st.num_marker_waits,
            st.num_stream_waits,
            dev.counters().stream_waits,
            a.usage().reserved == reserved,
        );
        a.check_invariants().unwrap();
        a.free(y).unwrap();
        a.free(keep).unwrap();
        a.empty_cache().unwrap();
        assert!(dev.mappings().is_empty());
        a.check_invariants().unwrap();
        moved
    };
    assert_eq!(run(true), (0, 1, 1, true), "no host wait, x's pages reused");
    let (host_waits, stream_waits, _, same) = run(false);
    assert!(
        host_waits >= 1 && stream_waits == 0 && same,
        "the host waited"
    );
}

/// Slabs without thread caches in front, so that every call reaches them.
fn slabs(max_kb: u64) -> Config {
    Config::parse(&format!("segments,thread_cache:0,slab_max_kb:{max_kb}")).unwrap()
}

#[test]
fn slab_chunks_of_a_class_share_a_segment_and_the_last_freed_goes_first() {
    let (dev, a) = new(slabs(1024));
    // 1000 and 900 bytes round to 1024: one class, 1 KiB chunks, carved in order.
    let p: Vec<DevicePtr> = (0..4).map(|_| a.malloc(1000, S0).unwrap()).collect();
    for w in p.windows(2) {
        assert_eq!(w[1].0, w[0].0 + 1024);
    }
    a.free(p[1]).unwrap();
    a.free(p[2]).unwrap();
    ok(&a);
    assert_eq!(a.malloc(900, S0).unwrap(), p[2]);
    assert_eq!(a.malloc(900, S0).unwrap(), p[1]);
    // Another class gets a slab of its own.
    let q = a.malloc(5000, S0).unwrap();
    let snap = a.snapshot();
    let seg_of = |x: DevicePtr| {
        snap.segments
            .iter()
            .position(|s| x.0 >= s.address.0 && x.0 < s.address.0 + s.total_size)
    };
    assert_ne!(seg_of(q), seg_of(p[0]));
    assert_eq!(dev.counters().allocs, 2);
    // A chunk is its class's size: 5000 B rounds to 5120, whose class is 5 KiB.
    let s = a.stats();
    assert_eq!(s.allocated_bytes.all().current, 4 * 1024 + 5 * 1024);
    assert_eq!(s.requested_bytes.all().current, 2 * 1000 + 2 * 900 + 5000);
    ok(&a);
}

#[test]
fn an_empty_slab_is_recut_for_another_class_without_a_device_call() {
    let (dev, a) = new(slabs(1024));
    let p = a.malloc(1000, S0).unwrap();
    a.free(p).unwrap();
    let q = a.malloc(100 * 1024, S0).unwrap();
    assert_eq!(
        q, p,
        "the empty slab, re-cut, serves the new class from its start"
    );
    assert_eq!(dev.counters().allocs, 1);
    ok(&a);
}

#[test]
fn slabs_and_the_bins_trade_free_segments_without_device_calls() {
    let (dev, a) = new(slabs(64));
    // An empty slab becomes a free segment of the bins before they grow.
    let p = a.malloc(1000, S0).unwrap();
    a.free(p).unwrap();
    let big = a.malloc(512 * 1024, S0).unwrap();
    assert_eq!(big, p);
    assert_eq!(dev.counters().allocs, 1);
    ok(&a);
    // And a whole free segment of the bins becomes a slab.
    a.free(big).unwrap();
    let small = a.malloc(2000, S0).unwrap();
    assert_eq!(small, p);
    assert_eq!(dev.counters().allocs, 1);
    ok(&a);
}

#[test]
fn empty_cache_releases_empty_slabs_and_keeps_used_ones() {
    let (dev, a) = new(slabs(1024));
    let keep = a.malloc(1000, S0).unwrap();
    let gone = a.malloc(300 * 1024, S0).unwrap();
    a.free(gone).unwrap();
    let released = a.empty_cache().unwrap();
    assert_eq!((released.segments, released.bytes), (1, 2 * MIB));
    assert_eq!(a.usage().reserved, 2 * MIB);
    ok(&a);
    a.free(keep).unwrap();
    assert_eq!(a.empty_cache().unwrap().segments, 1);
    assert_eq!(a.usage().reserved, 0);
    assert_eq!(dev.counters().frees, 2);
    ok(&a);
}

/// A segment handed out whole leaves the free-segment candidates: a loop
/// that takes and frees the same whole segment keeps the set small.
#[test]
fn free_segment_candidates_stay_bounded_in_a_steady_loop() {
    for config in [Config::default(), Config::pytorch()] {
        let (_, a) = new(config);
        for _ in 0..10_000 {
            let p = a.malloc(30 * MIB, S0).unwrap();
            a.free(p).unwrap();
        }
        let n: usize = a
            .state
            .lock()
            .core
            .free_candidates
            .iter()
            .map(|s| s.len())
            .sum();
        assert!(
            n <= 2,
            "{n} candidates after a steady loop over one segment"
        );
        ok(&a);
    }
}

/// A stream whose fit would need pages mapped takes another stream's free
/// block over mapped pages once that stream's work is past it: no page
/// moves, and the block's free then waits for the borrowing stream's work.
#[test]
fn expandable_borrows_another_streams_idle_block_and_guards_its_free() {
    for borrow in [true, false] {
        let (dev, a) = new(Config {
            expandable_borrow: borrow,
            ..Config::expandable()
        });
        // A free block over mapped pages, not merged with the range's free end.
        let p = a.malloc(16 * MIB, S0).unwrap();
        let _keep = a.malloc(16 * MIB, S0).unwrap();
        a.free(p).unwrap();
        // Stream 0's marker completes: its work is past the free.
        dev.complete_all_events();
        let (maps, waits) = (dev.counters().vmm_maps, a.stats().num_stream_waits);
        let q = a.malloc(16 * MIB, S1).unwrap();
        ok(&a);
        if !borrow {
            assert_ne!(
                q, p,
                "without borrowing, stream 1 maps pages in its own range"
            );
            assert!(dev.counters().vmm_maps > maps);
            continue;
        }
        assert_eq!(q, p, "stream 1 takes stream 0's free block");
        assert_eq!(dev.counters().vmm_maps, maps, "no page moved");
        assert_eq!(
            a.stats().num_stream_waits,
            waits,
            "stream 0 was past it: no wait"
        );
        assert_eq!(a.stats().num_blocks_borrowed, 1);
        // Freed, it awaits an event on stream 1; stream 0 may not reuse it before.
        a.free(q).unwrap();
        let pending = dev.pending_events();
        assert!(!pending.is_empty(), "the free is guarded by an event");
        let r = a.malloc(16 * MIB, S0).unwrap();
        assert_ne!(r, p, "stream 1 may still use it");
        dev.complete_all_events();
        a.free(r).unwrap();
        // Its exact fit again, once the event completed.
        assert_eq!(a.malloc(16 * MIB, S0).unwrap(), p);
        ok(&a);
    }
}

/// A block the other stream may still use is taken with a wait for that
/// stream's work on the device (`expandable_cross_stream`), not on the host.
#[test]
fn expandable_borrows_a_busy_block_with_a_device_wait() {
    let (dev, a) = new(Config::expandable());
    let p = a.malloc(16 * MIB, S0).unwrap();
    let _keep = a.malloc(16 * MIB, S0).unwrap();
    a.free(p).unwrap();
    assert!(
        !dev.pending_events().is_empty(),
        "stream 0's marker is pending"
    );
    let waits = a.stats().num_stream_waits;
    let q = a.malloc(16 * MIB, S1).unwrap();
    assert_eq!(q, p);
    assert_eq!(
        a.stats().num_stream_waits,
        waits + 1,
        "stream 1 waits on the device"
    );
    assert_eq!(a.stats().num_marker_waits, 0, "no host wait");
    ok(&a);
}

/// A block used on a stream that is being captured into a CUDA graph is
/// freed with its guarding event deferred until the capture ends (an event
/// recorded during the capture would join the graph), as PyTorch does.
#[test]
fn a_guarded_free_during_a_capture_waits_for_the_capture_to_end() {
    let (dev, a) = new(Config::pytorch());
    let p = a.malloc(4096, S0).unwrap();
    a.record_stream(p, S1).unwrap();
    dev.set_capturing(S1, true);
    let recorded = dev.counters().events_recorded;
    a.free(p).unwrap();
    ok(&a);
    assert_eq!(
        dev.counters().events_in_capture,
        0,
        "nothing recorded behind the capture"
    );
    assert_eq!(
        dev.counters().events_recorded,
        recorded,
        "the guard is deferred"
    );
    assert_eq!(
        a.stats().active.all().current,
        1,
        "still active, as awaiting events"
    );
    let q = a.malloc(4096, S0).unwrap();
    assert_ne!(q, p, "stream 1 may still use it");
    ok(&a);
    // The capture ends: the next allocation records the guard.
    dev.set_capturing(S1, false);
    let r = a.malloc(4096, S0).unwrap();
    assert_ne!(r, p, "its event has not completed yet");
    assert_eq!(dev.counters().events_recorded, recorded + 1);
    ok(&a);
    dev.complete_all_events();
    assert_eq!(
        a.malloc(4096, S0).unwrap(),
        p,
        "reused once the event completed"
    );
    assert_eq!(dev.counters().events_in_capture, 0);
    ok(&a);
}

/// With expandable segments, no marker is recorded on a stream being
/// captured, and a block borrowed by that stream is guarded only once the
/// capture ends.
#[test]
fn expandable_records_nothing_behind_a_capture() {
    let (dev, a) = new(Config::expandable());
    let p = a.malloc(16 * MIB, S0).unwrap();
    let _keep = a.malloc(16 * MIB, S0).unwrap();
    a.free(p).unwrap();
    dev.complete_all_events();
    let q = a.malloc(16 * MIB, S1).unwrap();
    assert_eq!(q, p, "borrowed");
    dev.set_capturing(S1, true);
    // Frees on the captured stream, and of the borrowed block: no event.
    let mine: Vec<DevicePtr> = (0..300).map(|_| a.malloc(MIB, S1).unwrap()).collect();
    for m in mine {
        a.free(m).unwrap();
    }
    a.free(q).unwrap();
    ok(&a);
    assert_eq!(dev.counters().events_in_capture, 0);
    dev.set_capturing(S1, false);
    a.free(a.malloc(4096, S0).unwrap()).unwrap();
    assert!(
        !dev.pending_events().is_empty(),
        "the borrowed block's guard is recorded once the capture ended"
    );
    ok(&a);
    dev.complete_all_events();
    assert_eq!(a.malloc(16 * MIB, S0).unwrap(), p);
    ok(&a);
}

/// `borrow_holes`: before creating a segment, a stream takes a free block
/// inside another stream's partly used segment, waiting on the device for
/// that stream's queued work; the block's free is guarded by an event on
/// the borrowing stream before its owner may reuse it.
#[test]
fn plain_segments_borrow_another_streams_hole_and_guard_its_free() {
    for borrow in [true, false] {
        let (dev, a) = new(Config {
            borrow_holes: borrow,
            ..Config::pytorch()
        });
        // Stream 0: a 20 MiB medium segment with 4 MiB in use.
        let p = a.malloc(4 * MIB, S0).unwrap();
        let segments = a.stats().segment.all().current;
        let waits = a.stats().num_stream_waits;
        let q = a.malloc(4 * MIB, S1).unwrap();
        ok(&a);
        if !borrow {
            assert_eq!(a.stats().segment.all().current, segments + 1);
            assert_eq!(a.stats().num_blocks_borrowed, 0);
            continue;
        }
        assert_eq!(
            a.stats().segment.all().current,
            segments,
            "no new segment: stream 1 took the hole after stream 0's block"
        );
        assert_eq!(q.0, p.0 + 4 * MIB);
        assert_eq!(a.stats().num_blocks_borrowed, 1);
        assert_eq!(
            a.stats().num_stream_waits,
            waits + 1,
            "stream 0's queued work is waited for on the device"
        );
        a.free(q).unwrap();
        assert!(!dev.pending_events().is_empty(), "the free is guarded");
        let r = a.malloc(16 * MIB - 4 * MIB, S0).unwrap();
        assert_ne!(r, q, "stream 1 may still use it");
        a.free(r).unwrap();
        dev.complete_all_events();
        assert_eq!(a.malloc(4 * MIB, S0).unwrap(), q, "the owner's again");
        ok(&a);
    }
}

/// Small requests borrow holes too: a stream's first small block goes into
/// another stream's partly used 2 MiB segment instead of a segment of its
/// own (each stream of a serving program would otherwise hold one).
#[test]
fn small_requests_borrow_holes_in_another_streams_small_segment() {
    for borrow in [true, false] {
        let (dev, a) = new(Config {
            borrow_holes: borrow,
            ..Config::pytorch()
        });
        let p = a.malloc(4096, S0).unwrap();
        let segments = a.stats().segment.all().current;
        let q = a.malloc(4096, S1).unwrap();
        ok(&a);
        if !borrow {
            assert_eq!(a.stats().segment.all().current, segments + 1);
            continue;
        }
        assert_eq!(a.stats().segment.all().current, segments, "no new segment");
        assert_eq!(q.0, p.0 + 4096);
        assert_eq!(a.stats().num_blocks_borrowed, 1);
        a.free(q).unwrap();
        assert!(!dev.pending_events().is_empty(), "the free is guarded");
        dev.complete_all_events();
        assert_eq!(a.malloc(4096, S0).unwrap(), q, "the owner's again");
        ok(&a);
    }
}

/// A request served by slabs makes a slab of a segment of its own: a hole
/// in another stream's plain small segment is no slab.
#[test]
fn slab_requests_borrow_no_holes() {
    let (_dev, a) = new(Config {
        borrow_holes: true,
        slab_max: 64 * 1024,
        ..Config::pytorch()
    });
    // Stream 0: a plain small segment (requests above the slab limit), partly used.
    let p = a.malloc(512 * 1024, S0).unwrap();
    let segments = a.stats().segment.all().current;
    let q = a.malloc(4096, S1).unwrap();
    ok(&a);
    assert_eq!(a.stats().num_blocks_borrowed, 0);
    assert_eq!(
        a.stats().segment.all().current,
        segments + 1,
        "a slab of its own"
    );
    a.free(q).unwrap();
    a.free(p).unwrap();
    ok(&a);
}

/// With more streams than one search looks at, the searches take the other
/// streams in turn: a hole in the last of 40 streams is found by the second
/// growth at the latest.
#[test]
fn with_many_streams_every_streams_holes_are_looked_at_in_turn() {
    let (_dev, a) = new(Config {
        borrow_holes: true,
        ..Config::pytorch()
    });
    // Streams 0..39 known to the allocator, each with a small block.
    let small: Vec<_> = (0..40)
        .map(|s| a.malloc(4096, StreamId(s)).unwrap())
        .collect();
    // Stream 39: a 20 MiB medium segment with 4 MiB in use, 16 MiB free.
    let last = StreamId(39);
    let p = a.malloc(4 * MIB, last).unwrap();
    // (The small blocks of streams 1..39 took holes of stream 0's small segment.)
    let borrowed = a.stats().num_blocks_borrowed;
    let mut mine = Vec::new();
    for _ in 0..2 {
        // Stream 0 has no free large block: each request grows.
        mine.push(a.malloc(4 * MIB, S0).unwrap());
        if a.stats().num_blocks_borrowed > borrowed {
            break;
        }
    }
    assert_eq!(
        a.stats().num_blocks_borrowed,
        borrowed + 1,
        "stream 39's hole found"
    );
    assert!(mine.iter().any(|&q| q.0 == p.0 + 4 * MIB));
    ok(&a);
    for q in mine.into_iter().chain(small).chain([p]) {
        a.free(q).unwrap();
    }
    ok(&a);
}

/// A stream being captured borrows no hole: the device wait would join
/// the graph.
#[test]
fn no_hole_is_borrowed_behind_a_capture() {
    let (dev, a) = new(Config {
        borrow_holes: true,
        ..Config::pytorch()
    });
    let _p = a.malloc(4 * MIB, S0).unwrap();
    dev.set_capturing(S1, true);
    let segments = a.stats().segment.all().current;
    let _q = a.malloc(4 * MIB, S1).unwrap();
    assert_eq!(a.stats().segment.all().current, segments + 1);
    assert_eq!(a.stats().num_blocks_borrowed, 0);
    assert_eq!(dev.counters().events_in_capture, 0);
    ok(&a);
}

/// `empty_cache` after a capture guards and waits for the blocks freed
/// during it, so their segments go back; during the capture it keeps them.
#[test]
fn empty_cache_after_a_capture_releases_what_was_freed_during_it() {
    let (dev, a) = new(Config::pytorch());
    let p = a.malloc(4096, S0).unwrap();
    a.record_stream(p, S1).unwrap();
    dev.set_capturing(S1, true);
    a.free(p).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(
        a.usage().reserved,
        2 * MIB,
        "still guarded behind the capture"
    );
    assert_eq!(dev.counters().events_in_capture, 0);
    ok(&a);
    dev.set_capturing(S1, false);
    let released = a.empty_cache().unwrap();
    assert_eq!(released.bytes, 2 * MIB);
    assert_eq!(a.usage().reserved, 0);
    assert_eq!(a.stats().active.all().current, 0);
    ok(&a);
}

/// A large block whose mapping alone would bring reserved memory near the
/// device's capacity, while the rest is far from it, gets big pages where
/// they lie wholly under it (granules only at its edges): all granules
/// there made pages of both sizes churn under a cap.
#[test]
fn a_large_mapping_short_of_the_limit_keeps_its_big_pages() {
    let (dev, a) = new(Config {
        memory_cap: Some(crate::config::MemoryCap::Bytes(100 * MIB)),
        expandable_page_divisor: 0,
        ..Config::expandable()
    });
    let keep = a.malloc(20 * MIB, S0).unwrap();
    let before = dev.counters().vmm_creates;
    // 24 MiB mapped, and 77 more: past 98% of the 100 MiB cap only with this mapping.
    let big = a.malloc(77 * MIB, S0).unwrap();
    let created = dev.counters().vmm_creates - before;
    assert!(
        created <= 16,
        "{created} pages for 77 MiB: big pages expected under the block"
    );
    ok(&a);
    a.free(big).unwrap();
    a.free(keep).unwrap();
    ok(&a);
}

/// A large `expandable_slack` lets idle pages stay mapped; it does not put
/// mappings far from the device's limit under pressure, so blocks still get
/// big pages (with a slack of 0.5 or more every mapping took granules).
#[test]
fn a_large_slack_keeps_big_pages() {
    for slack in ["0.01", "0.5", "2"] {
        let (dev, a) = new(Config::parse(&format!(
            "expandable,expandable_slack:{slack},expandable_page_divisor:0"
        ))
        .unwrap());
        let first = a.malloc(8 * MIB, S0).unwrap();
        let before = dev.counters().vmm_maps;
        let p = a.malloc(64 * MIB, S0).unwrap();
        let maps = dev.counters().vmm_maps - before;
        assert!(
            maps <= 9,
            "slack {slack}: {maps} maps for 64 MiB, 8 MiB pages expected"
        );
        a.free(p).unwrap();
        a.free(first).unwrap();
        ok(&a);
    }
}

/// The emulation of PyTorch's expandable segments maps its large pool in
/// PyTorch's 20 MiB pages (`kLargeBuffer`), each whole: 30 MiB takes two
/// pages, 40 MiB reserved, where `expandable`'s 8 MiB pages hold 32.
#[test]
fn pytorch_expandable_segments_map_20_mib_pages() {
    for (conf, maps, reserved) in [
        ("pytorch,expandable_segments:True", 2, 40 * MIB),
        ("expandable,expandable_page_divisor:0", 4, 32 * MIB),
    ] {
        let (dev, a) = new(Config::parse(conf).unwrap());
        let p = a.malloc(30 * MIB, S0).unwrap();
        assert_eq!(dev.counters().vmm_maps, maps, "{conf}");
        assert_eq!(a.usage().reserved, reserved, "{conf}");
        a.free(p).unwrap();
        ok(&a);
    }
}

/// `expandable_page_divisor`: large-pool pages are at most the peak
/// allocated bytes over the divisor, so a small workload maps granules and
/// pages grow with it to the configured size; an odd number of granules
/// (20 MiB = 10 granules, halved to 5) goes to one granule next.
#[test]
fn expandable_pages_scale_with_the_workload() {
    // (config, sizes allocated in turn, the page size each maps, in MiB)
    let cases: [(&str, &[(u64, u64)]); 3] = [
        ("expandable", &[(30, 2), (600, 4), (600, 8), (24, 8)]),
        ("expandable,expandable_page_divisor:0", &[(30, 8)]),
        (
            "expandable,expandable_page_mb:20",
            &[(30, 2), (1400, 10), (1400, 20)],
        ),
    ];
    for (conf, steps) in cases {
        let (dev, a) = new(Config::parse(conf).unwrap());
        for &(mib, page) in steps {
            let p = a.malloc(mib * MIB, S0).unwrap();
            let under = dev
                .mappings()
                .into_iter()
                .filter(|&(at, n)| at.0 >= p.0 && at.0 + n <= p.0 + mib * MIB)
                .map(|(_, n)| n / MIB)
                .max();
            assert_eq!(
                under,
                Some(page),
                "{conf}: {mib} MiB after the earlier blocks"
            );
            ok(&a);
        }
    }
}

/// Without caching, a block freed during a capture whose guard cannot be
/// recorded after it (the device synchronizes instead) gives its segment
/// back to the device at once, as any other free does.
#[test]
fn without_caching_a_deferred_free_gives_its_segment_back() {
    let (dev, a) = new(Config::no_caching());
    let p = a.malloc(4 * MIB, S0).unwrap();
    a.record_stream(p, S1).unwrap();
    dev.set_capturing(S1, true);
    a.free(p).unwrap();
    assert_eq!(dev.segments().len(), 1, "held behind the capture");
    dev.set_capturing(S1, false);
    dev.fail_calls(crate::simulated::calls::RECORD_EVENT, 1);
    let q = a.malloc(4 * MIB, S0).unwrap();
    assert_eq!(
        dev.segments().len(),
        1,
        "p's segment went back; only q's is left"
    );
    a.free(q).unwrap();
    assert_eq!(a.usage().reserved, 0);
    ok(&a);
}

/// A cap above the hard limit lets no more pages be created than no cap
/// does: a large request that finds recently freed pages (not yet past a
/// marker) takes them back, instead of creating new ones up to the cap.
#[test]
fn a_cap_above_the_hard_limit_creates_no_more_than_no_cap() {
    let reserved_after = |cap: Option<u64>| {
        let (_dev, a) = new(Config {
            memory_cap: cap.map(crate::config::MemoryCap::Bytes),
            ..Config::expandable()
        });
        let x = a.malloc(96 * MIB, S0).unwrap();
        let w = a.malloc(2 * MIB, S0).unwrap();
        a.free(x).unwrap();
        // Too big for x's hole: new pages, or x's pages moved under it.
        let z = a.malloc(144 * MIB, S0).unwrap();
        let reserved = a.usage().reserved;
        ok(&a);
        a.free(z).unwrap();
        a.free(w).unwrap();
        reserved
    };
    let free = reserved_after(None);
    assert!(
        free < 200 * MIB,
        "{free}: x's pages should serve z with no cap"
    );
    let capped = reserved_after(Some(240 * MIB));
    assert!(
        capped <= free,
        "under a 240 MiB cap {capped} bytes reserved, with none {free}"
    );
}

/// An expandable allocator's out-of-memory report says whether its large
/// pools map pages larger than the device's granularity now (pages scaled
/// to a small workload are granules already), which decides the advice.
#[test]
fn an_expandable_oom_report_knows_its_page_size() {
    for (conf, big) in [
        ("expandable", false),
        (
            "expandable,expandable_page_divisor:0,expandable_reback:false",
            true,
        ),
        // Pinned big pages gave their free part back before the failure.
        ("expandable,expandable_page_divisor:0", false),
    ] {
        let (_dev, a) = new(Config {
            memory_cap: Some(crate::config::MemoryCap::Bytes(64 * MIB)),
            ..Config::parse(conf).unwrap()
        });
        let e = a.malloc(100 * MIB, S0).unwrap_err();
        let AllocError::OutOfMemory(report) = &e else {
            panic!("{e}")
        };
        assert!(report.expandable, "{conf}");
        assert_eq!(report.big_pages, big, "{conf}");
        ok(&a);
    }
}

/// Under a cap, a request that fails only because the cache's free bytes are
/// scattered (fewer bytes missing under the cap than the cache holds unused,
/// though fewer unused than requested) is reported as fragmentation, with
/// the advice that addresses it, not as a cap to raise.
#[test]
fn an_oom_under_a_cap_from_scattered_free_bytes_says_fragmentation() {
    let (_dev, a) = new(Config {
        memory_cap: Some(crate::config::MemoryCap::Bytes(100 * MIB)),
        ..Config::pytorch()
    });
    let x = a.malloc(40 * MIB, S0).unwrap();
    let y = a.malloc(40 * MIB, S0).unwrap();
    a.free(x).unwrap();
    a.free(y).unwrap();
    // 20 MiB in the first segment, 25 in the second: 35 MiB free, scattered.
    let c = a.malloc(20 * MIB, S0).unwrap();
    let d = a.malloc(25 * MIB, S0).unwrap();
    let e = a.malloc(50 * MIB, S0).unwrap_err();
    let AllocError::OutOfMemory(report) = &e else {
        panic!("{e}")
    };
    assert_eq!((report.reserved, report.allocated), (80 * MIB, 45 * MIB));
    assert!(report.fragmented(), "{report:?}");
    let msg = e.to_string();
    assert!(msg.contains("no block large enough"), "{msg}");
    assert!(!msg.contains("Raise the memory cap"), "{msg}");
    // Short of the cap by more than the cache holds unused: the cap it is.
    let f = a.malloc(70 * MIB, S0).unwrap_err();
    let AllocError::OutOfMemory(report) = &f else {
        panic!("{f}")
    };
    assert!(!report.fragmented(), "{report:?}");
    assert!(f.to_string().contains("Raise the memory cap"), "{f}");
    a.free(c).unwrap();
    a.free(d).unwrap();
    ok(&a);
}

#[test]
fn expandable_early_reuses_its_own_streams_pages_without_waiting() {
    // The same cap two pages short, early reuse on: x's pages serve y on x's
    // stream at once, mapped again there; their old mappings stay until the
    // stream is past them, and `empty_cache` drops them.
    let dev = SimulatedDevice::new(1 << 30);
    let (a, keep) = hole_behind_markers(&dev, 300, true);
    let reserved = a.usage().reserved;
    a.set_memory_cap(Some(crate::config::MemoryCap::Bytes(reserved + 2 * MIB)))
        .unwrap();
    let before = dev.counters();
    let y = a.malloc(6 * MIB, S0).unwrap();
    let after = dev.counters();
    assert_eq!(after.event_waits, before.event_waits, "no wait at all");
    assert_eq!(after.synchronizes, before.synchronizes);
    assert_eq!(after.vmm_unmaps, before.vmm_unmaps, "nothing unmapped yet");
    assert_eq!(a.stats().num_pages_reused_early, 2);
    let stale = a.stale_mappings();
    assert_eq!(stale.len(), 2, "x's two old mappings: {stale:?}");
    assert!(stale
        .iter()
        .all(|&(p, n, pooled)| n == 2 * MIB && !pooled && p.0 < keep.0));
    assert!(a.usage().reserved <= reserved + 2 * MIB, "within the cap");
    a.check_invariants().unwrap();
    // A block placed over x's old place waits for the stream and unmaps
    // the old mappings first.
    a.free(y).unwrap();
    a.free(keep).unwrap();
    a.empty_cache().unwrap();
    assert!(a.stale_mappings().is_empty());
    assert_eq!(a.usage().reserved, 0);
    assert!(dev.mappings().is_empty());
    a.check_invariants().unwrap();
}

/// `default` with every large-pool page one 2 MiB granule.
fn granule_pages() -> Config {
    Config {
        expandable_page: 2 * MIB,
        expandable_page_divisor: 0,
        ..Config::default()
    }
}

/// `empty_cache` unmaps each run of pages side by side with one call (as
/// `cuMemUnmap` allows), not page by page: after a large run its cost is
/// the calls, and a run of 40 pages is one call.
#[test]
fn empty_cache_unmaps_each_run_of_pages_in_one_call() {
    let (dev, a) = new(granule_pages());
    let x = a.malloc(80 * MIB, S0).unwrap();
    let keep = a.malloc(2 * MIB, S0).unwrap();
    let y = a.malloc(40 * MIB, S0).unwrap();
    a.free(x).unwrap();
    a.free(y).unwrap();
    let before = dev.counters();
    a.empty_cache().unwrap();
    let after = dev.counters();
    // x's 40 pages and y's 20: two runs, keep's page in between stays.
    assert_eq!(after.vmm_pages_unmapped - before.vmm_pages_unmapped, 60);
    assert_eq!(after.vmm_unmaps - before.vmm_unmaps, 2);
    assert_eq!(after.vmm_releases - before.vmm_releases, 60);
    assert_eq!(a.usage().reserved, 2 * MIB);
    ok(&a);
    a.free(keep).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(dev.outstanding(), 0);
}

/// A run the device refuses to unmap whole is unmapped page by page, and a
/// page it still refuses stays mapped and counted (nothing leaks).
#[test]
fn a_refused_run_is_unmapped_page_by_page() {
    use crate::simulated::calls;
    let (dev, a) = new(granule_pages());
    let x = a.malloc(8 * MIB, S0).unwrap();
    a.free(x).unwrap();
    // The run's call fails, then the first page's call; the rest succeed.
    dev.fail_calls_after(calls::VMM_UNMAP, 0, 2);
    assert!(a.empty_cache().is_err());
    // Three pages unmapped and pooled, one still mapped: all still counted.
    assert_eq!(a.usage().reserved, 8 * MIB);
    assert_eq!(dev.counters().vmm_pages_unmapped, 3);
    a.check_invariants().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.usage().reserved, 0);
    assert_eq!(dev.outstanding(), 0);
}

/// Driver calls a step after warm-up under `default`: a training loop with
/// fixed shapes maps, unmaps and releases nothing once its first steps have
/// mapped what it needs, and never synchronizes the device.
#[test]
fn default_makes_no_driver_call_per_step_for_fixed_shapes() {
    let (dev, a) = new(Config::default());
    assert!(a.is_expandable());
    let sizes: Vec<u64> = (1..=24u64)
        .map(|i| (i * 37 % 11 + 1) * 3 * MIB + i * 4096)
        .chain([300, 4096, 70_000, 900 * 1024])
        .collect();
    let step = |a: &CachingAllocator<SimulatedDevice>| {
        let mut live: Vec<DevicePtr> = Vec::new();
        for (i, &s) in sizes.iter().enumerate() {
            live.push(a.malloc(s, S0).unwrap());
            if i % 3 == 2 {
                a.free(live.remove(0)).unwrap();
            }
        }
        for p in live.into_iter().rev() {
            a.free(p).unwrap();
        }
    };
    for _ in 0..3 {
        step(&a);
    }
    let before = (a.stats(), dev.counters());
    for _ in 0..50 {
        step(&a);
    }
    let (st, c) = (a.stats(), dev.counters());
    assert_eq!(st.num_map, before.0.num_map, "maps after warm-up");
    assert_eq!(st.num_unmap, before.0.num_unmap, "unmaps after warm-up");
    assert_eq!(st.num_page_release, before.0.num_page_release);
    assert_eq!(c.synchronizes, 0);
    assert_eq!((c.allocs, c.frees), (0, 0));
    ok(&a);
}
