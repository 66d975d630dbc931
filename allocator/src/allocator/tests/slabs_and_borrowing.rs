//! Slabs, borrowing another stream's free blocks and holes, guarded frees
//! and CUDA graph captures.

use super::*;

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
