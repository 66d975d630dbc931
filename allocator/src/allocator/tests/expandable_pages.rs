//! Expandable segments: pages, markers, ranges, page sizes scaled to the
//! workload, empty_cache's unmapping, early reuse and out-of-memory reports.

use super::*;

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
