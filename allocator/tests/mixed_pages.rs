//! Mixed page sizes in expandable segments: big pages where there
//! is room, granularity-sized ones at blocks' edges (`expandable_edges:small`)
//! or everywhere near the limit (the default, `expandable_edges:pressure`; at the
//! edges only where just the mapping at hand would reach it),
//! the pool of unmapped pages kept per size. Each test checks the mappings
//! the simulated device holds (which rejects partial unmaps and misaligned
//! maps) and the allocator's invariants, page map included.

use cachealloc_core::{CachingAllocator, Config, DevicePtr, SimulatedDevice, StreamId};

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);

fn config(edges: &str) -> Config {
    // Pages of the preset's 8 MiB whatever the workload's size.
    Config::parse(&format!(
        "expandable,expandable_edges:{edges},expandable_page_divisor:0"
    ))
    .unwrap()
}

/// The device's mappings from `p` on, up to `bytes` past it, as (offset in MiB, MiB).
fn mapped_under(dev: &SimulatedDevice, p: DevicePtr, bytes: u64) -> Vec<(u64, u64)> {
    dev.mappings()
        .into_iter()
        .filter(|&(a, n)| a.0 + n > p.0 && a.0 < p.0 + bytes)
        .map(|(a, n)| ((a.0 - p.0) / MIB, n / MIB))
        .collect()
}

#[test]
fn with_room_a_block_gets_whole_big_pages() {
    let dev = SimulatedDevice::new(1 << 40);
    let a = CachingAllocator::new(dev.clone(), config("pressure"));
    let p = a.malloc(10 * MIB, S0).unwrap();
    assert_eq!(mapped_under(&dev, p, 16 * MIB), vec![(0, 8), (8, 8)]);
    assert_eq!(a.stats().num_map, 2);
    a.check_invariants().unwrap();
}

#[test]
fn small_edges_map_only_the_granules_under_the_block() {
    let dev = SimulatedDevice::new(1 << 40);
    let a = CachingAllocator::new(dev.clone(), config("small"));
    let p = a.malloc(20 * MIB, S0).unwrap();
    assert_eq!(
        mapped_under(&dev, p, 32 * MIB),
        vec![(0, 8), (8, 8), (16, 2), (18, 2)]
    );
    assert_eq!(a.usage().reserved, 20 * MIB);
    // The next block starts in the granule after: it maps its own edge
    // granules and a big page only where a whole aligned one lies under it.
    let q = a.malloc(15 * MIB, S0).unwrap();
    assert_eq!(q.0, p.0 + 20 * MIB);
    assert_eq!(
        mapped_under(&dev, p, 40 * MIB),
        vec![
            (0, 8),
            (8, 8),
            (16, 2),
            (18, 2),
            (20, 2),
            (22, 2),
            (24, 8),
            (32, 2),
            (34, 2)
        ]
    );
    a.check_invariants().unwrap();
    a.free(p).unwrap();
    a.free(q).unwrap();
    a.empty_cache().unwrap();
    assert!(dev.mappings().is_empty());
    assert_eq!(dev.outstanding(), 0);
    a.check_invariants().unwrap();
}

#[test]
fn pooled_pages_of_another_size_make_room_on_a_full_device() {
    // 10 MiB device: x (6 MiB, three granules) and y (2 MiB) leave 2 MiB.
    let dev = SimulatedDevice::new(10 * MIB);
    let a = CachingAllocator::new(dev.clone(), config("small"));
    let x = a.malloc(6 * MIB, S0).unwrap();
    let y = a.malloc(2 * MIB, S0).unwrap();
    assert_eq!(y.0, x.0 + 6 * MIB);
    assert_eq!(
        mapped_under(&dev, x, 8 * MIB),
        vec![(0, 2), (2, 2), (4, 2), (6, 2)]
    );
    a.free(x).unwrap();
    // 8 MiB fits not in x's hole: it goes after y, on one aligned big page.
    // x's three granules are recycled (after a wait for its stream's marker) and,
    // being of no use to it, released to make room for the big page.
    let w = a.malloc(8 * MIB, S0).unwrap();
    assert_eq!(w.0, y.0 + 2 * MIB);
    assert_eq!(mapped_under(&dev, w, 8 * MIB), vec![(0, 8)]);
    let c = dev.counters();
    assert_eq!(c.vmm_releases, 3, "the pooled granules given back");
    assert_eq!(c.vmm_creates, 3 + 1 + 1);
    assert_eq!(a.stats().num_sync_all_streams, 0, "no device-wide wait");
    assert!(a.stats().num_event_waits >= 1);
    assert_eq!(a.usage().reserved, 10 * MIB);
    assert_eq!(dev.used(), 10 * MIB);
    a.check_invariants().unwrap();
}

#[test]
fn near_the_limit_only_granules_are_mapped_and_the_end_page_is_trimmed() {
    // 64 MiB device: pressure once a mapping would bring reserved memory
    // within 2% (idle_slack_hard) of it.
    let dev = SimulatedDevice::new(64 * MIB);
    let a = CachingAllocator::new(dev.clone(), config("pressure"));
    let small = a.malloc(512, S0).unwrap(); // the small pool's one page
    let x = a.malloc(48 * MIB, S0).unwrap();
    assert_eq!(mapped_under(&dev, x, 48 * MIB).len(), 6, "six big pages");
    // Whole big pages would need 16 MiB (64 in all): only this mapping
    // would reach the limit, so the big page wholly under it stays big and
    // its end takes granules (14 MiB: one big page and 3 granules).
    let y = a.malloc(14 * MIB, S0).unwrap();
    assert_eq!(y.0, x.0 + 48 * MIB);
    assert_eq!(
        mapped_under(&dev, y, 14 * MIB),
        vec![(0, 8), (8, 2), (10, 2), (12, 2)]
    );
    assert_eq!(a.usage().reserved, 64 * MIB);
    a.free(x).unwrap();
    // Enough operations for a marker; once its event completed, x's pages
    // are quiescent (no queued work can touch them).
    for _ in 0..70 {
        let s = a.malloc(512, S0).unwrap();
        a.free(s).unwrap();
    }
    dev.complete_all_events();
    // 13 MiB at the start of x's hole: the big page at 8..16 MiB would lie
    // mostly past its end; it is unmapped and granules take its place.
    let z = a.malloc(13 * MIB, S0).unwrap();
    assert_eq!(z, x);
    assert_eq!(
        mapped_under(&dev, z, 14 * MIB),
        vec![(0, 8), (8, 2), (10, 2), (12, 2)]
    );
    assert!(dev.used() <= 64 * MIB);
    a.check_invariants().unwrap();
    a.free(y).unwrap();
    a.free(z).unwrap();
    a.free(small).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(dev.outstanding(), 0);
    a.check_invariants().unwrap();
}
