//! The core policy: caching, splitting, best fit, PyTorch's segment sizes,
//! streams, `record_stream`, `empty_cache`, the out-of-memory ladder, caps,
//! misuse, statistics, recording, the huge pool, kinds, and how `default`
//! chooses expandable segments.

use super::*;

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
