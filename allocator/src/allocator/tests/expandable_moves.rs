//! Expandable segments: ranges and address space, pages that move between
//! blocks, shadows, old mappings queued work may use, cross-stream waits.

use super::*;

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
