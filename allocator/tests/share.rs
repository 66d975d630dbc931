//! Pages shared by granules whose live bytes lie at disjoint offsets
//! (`expandable_share`), the last rung before an expandable allocation
//! fails: the live bytes of one granule are copied into the other's page,
//! that page is mapped at both addresses and the first goes back. Each test
//! checks the simulated device's mappings and copies, that no two live
//! blocks reach the same byte of a page, and the allocator's invariants.

use cachealloc_core::sim_calls as calls;
use cachealloc_core::{
    AllocError, BlockState, CachingAllocator, Config, DevicePtr, SimulatedDevice, StreamId,
};

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);

/// `expandable` with 2 MiB pages (the device's granularity) everywhere.
fn config(share: bool) -> Config {
    Config::parse(&format!(
        "expandable,expandable_page_mb:2,expandable_page_divisor:0,expandable_share:{share}"
    ))
    .unwrap()
}

/// Four 2.5 MiB blocks A B C D tile 10 MiB of one range; B and D are freed.
/// Then granule 1 holds A's last 0.5 MiB (offsets 0..0.5 MiB), granule 2
/// holds C's first 1 MiB (offsets 1..2 MiB): disjoint, one page can serve
/// both. Granule 3 holds C's tail at 0..1.5 MiB, which meets both. Returns
/// A and C.
fn two_partial_granules(a: &CachingAllocator<SimulatedDevice>) -> (DevicePtr, DevicePtr) {
    let blocks: Vec<DevicePtr> = (0..4).map(|_| a.malloc(5 * MIB / 2, S0).unwrap()).collect();
    for w in blocks.windows(2) {
        assert_eq!(w[1].0, w[0].0 + 5 * MIB / 2, "the blocks tile the range");
    }
    assert_eq!(blocks[0].0 % (2 * MIB), 0);
    a.free(blocks[1]).unwrap();
    a.free(blocks[3]).unwrap();
    a.check_invariants().unwrap();
    (blocks[0], blocks[2])
}

/// Pairs of (page, block address) for every byte range of a page that a
/// block in use reaches; panics if two blocks reach the same byte.
fn assert_no_physical_overlap(a: &CachingAllocator<SimulatedDevice>, dev: &SimulatedDevice) {
    let maps = dev.page_mappings();
    let mut used: Vec<(u64, u64, u64, u64)> = Vec::new();
    for s in a.snapshot().segments {
        for b in s.blocks.iter().filter(|b| b.state == BlockState::Allocated) {
            let (lo, hi) = (b.address.0, b.address.0 + b.size);
            for &(m, page, n) in &maps {
                let (x, y) = (lo.max(m.0), hi.min(m.0 + n));
                if x < y {
                    used.push((page, x - m.0, y - m.0, lo));
                }
            }
        }
    }
    used.sort_unstable();
    for w in used.windows(2) {
        assert!(
            w[0].0 != w[1].0 || w[1].1 >= w[0].2,
            "blocks at {:#x} and {:#x} share bytes of page {}",
            w[0].3,
            w[1].3,
            w[0].0
        );
    }
}

/// Frees `live`, empties the cache and checks that nothing is left on the device.
fn freed_and_emptied(
    dev: &SimulatedDevice,
    a: &CachingAllocator<SimulatedDevice>,
    live: &[DevicePtr],
) {
    a.check_invariants().unwrap();
    for &p in live {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_eq!((dev.used(), dev.outstanding()), (0, 0));
}

#[test]
fn two_granules_whose_live_bytes_do_not_meet_share_a_page_before_out_of_memory() {
    // 10 MiB device: after B and D go, 4 MiB of the range is free but the
    // pages under A's and C's edges hold 2.5 MiB of it. A 4 MiB request at
    // the range's end needs one new page, and the device is full.
    for share in [false, true] {
        let dev = SimulatedDevice::new(10 * MIB);
        let a = CachingAllocator::new(dev.clone(), config(share));
        let (x, c) = two_partial_granules(&a);
        let before = dev.counters();
        let got = a.malloc(4 * MIB, S0);
        if !share {
            assert!(matches!(got, Err(AllocError::OutOfMemory(_))), "{got:?}");
            assert_eq!(a.stats().num_pages_shared, 0);
            freed_and_emptied(&dev, &a, &[x, c]);
            continue;
        }
        let e = got.unwrap();
        assert_eq!(a.stats().num_pages_shared, 1);
        // A's 0.5 MiB in granule 1 was copied into granule 2's page (or
        // C's 1 MiB into granule 1's), and one page maps both granules.
        let after = dev.counters();
        assert_eq!(after.copies - before.copies, 1);
        let g1 = DevicePtr(x.0 + 2 * MIB);
        let g2 = DevicePtr(x.0 + 4 * MIB);
        let maps = dev.page_mappings();
        let page_at = |p: DevicePtr| maps.iter().find(|m| m.0 == p).map(|m| m.1);
        assert!(
            page_at(g1).is_some() && page_at(g1) == page_at(g2),
            "{maps:?}"
        );
        assert_eq!(a.usage().reserved, dev.used());
        assert!(dev.used() <= 10 * MIB);
        assert_eq!(a.shared_mappings().len(), 1);
        assert_no_physical_overlap(&a, &dev);
        a.check_invariants().unwrap();
        freed_and_emptied(&dev, &a, &[x, c, e]);
    }
}

#[test]
fn a_run_that_fits_shares_nothing() {
    let dev = SimulatedDevice::new(1 << 30);
    let a = CachingAllocator::new(dev.clone(), config(true));
    let (x, c) = two_partial_granules(&a);
    let e = a.malloc(4 * MIB, S0).unwrap();
    assert_eq!(a.stats().num_pages_shared, 0);
    assert_eq!(dev.counters().copies, 0);
    assert!(a.shared_mappings().is_empty());
    freed_and_emptied(&dev, &a, &[x, c, e]);
}

#[test]
fn a_member_whose_blocks_are_freed_leaves_and_the_other_keeps_the_page() {
    let dev = SimulatedDevice::new(10 * MIB);
    let a = CachingAllocator::new(dev.clone(), config(true));
    let (x, c) = two_partial_granules(&a);
    let e = a.malloc(4 * MIB, S0).unwrap();
    assert_eq!(a.shared_mappings().len(), 1);
    // The aliased bytes are no free memory: the snapshot shows them, and
    // neither granule's other-offset bytes can be handed out.
    let aliased: u64 = a
        .snapshot()
        .segments
        .iter()
        .flat_map(|s| s.blocks.iter())
        .filter(|b| b.state == BlockState::Aliased)
        .map(|b| b.size)
        .sum();
    assert!(aliased > 0);
    // A goes: granule 1 leaves at the next flush, granule 2 keeps the page
    // for C alone, and its aliased bytes are free again.
    a.free(x).unwrap();
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert!(a.shared_mappings().is_empty());
    assert!(a
        .snapshot()
        .segments
        .iter()
        .flat_map(|s| s.blocks.iter())
        .all(|b| b.state != BlockState::Aliased));
    assert_eq!(a.usage().reserved, dev.used());
    assert_no_physical_overlap(&a, &dev);
    // C's granule is whole again: a block can be carved beside C there.
    let small = a.malloc(MIB + MIB / 2, S0).unwrap();
    assert_no_physical_overlap(&a, &dev);
    freed_and_emptied(&dev, &a, &[c, e, small]);
}

#[test]
fn a_page_no_member_uses_goes_back_at_empty_cache() {
    let dev = SimulatedDevice::new(10 * MIB);
    let a = CachingAllocator::new(dev.clone(), config(true));
    let (x, c) = two_partial_granules(&a);
    let e = a.malloc(4 * MIB, S0).unwrap();
    assert_eq!(a.stats().num_pages_shared, 1);
    freed_and_emptied(&dev, &a, &[x, c, e]);
    assert_eq!(dev.mappings(), vec![]);
}

#[test]
fn a_failed_copy_leaves_both_pages_where_they_were() {
    let dev = SimulatedDevice::new(10 * MIB);
    let a = CachingAllocator::new(dev.clone(), config(true));
    let (x, c) = two_partial_granules(&a);
    let maps = dev.page_mappings();
    dev.fail_calls(calls::COPY, 1);
    let err = a.malloc(4 * MIB, S0).unwrap_err();
    assert!(!matches!(err, AllocError::OutOfMemory(_)), "{err:?}");
    assert_eq!(a.stats().num_pages_shared, 0);
    assert_eq!(dev.page_mappings(), maps, "nothing moved");
    assert_eq!(a.usage().reserved, dev.used());
    a.check_invariants().unwrap();
    // The next try goes through.
    let e = a.malloc(4 * MIB, S0).unwrap();
    assert_eq!(a.stats().num_pages_shared, 1);
    assert_no_physical_overlap(&a, &dev);
    freed_and_emptied(&dev, &a, &[x, c, e]);
}

#[test]
fn a_refused_map_puts_the_members_own_page_back() {
    let dev = SimulatedDevice::new(10 * MIB);
    let a = CachingAllocator::new(dev.clone(), config(true));
    let (x, c) = two_partial_granules(&a);
    let maps = dev.page_mappings();
    // The unmap goes through; the map of the shared page is refused, the
    // member's own page is mapped back.
    dev.fail_calls_after(calls::VMM_MAP, 0, 1);
    let err = a.malloc(4 * MIB, S0).unwrap_err();
    assert!(!matches!(err, AllocError::OutOfMemory(_)), "{err:?}");
    assert_eq!(dev.page_mappings(), maps, "the member's page is back");
    assert_eq!(a.stats().num_pages_shared, 0);
    a.check_invariants().unwrap();
    freed_and_emptied(&dev, &a, &[x, c]);
}

#[test]
fn under_a_cap_pages_are_shared_as_on_a_full_device() {
    let dev = SimulatedDevice::new(1 << 40);
    let config = config(true)
        .into_builder()
        .memory_cap(Some(cachealloc_core::MemoryCap::Bytes(10 * MIB)))
        .build()
        .unwrap();
    let a = CachingAllocator::new(dev.clone(), config);
    let (x, c) = two_partial_granules(&a);
    let e = a.malloc(4 * MIB, S0).unwrap();
    assert_eq!(a.stats().num_pages_shared, 1);
    assert!(a.stats().reserved_bytes.all().peak <= 10 * MIB);
    assert_no_physical_overlap(&a, &dev);
    freed_and_emptied(&dev, &a, &[x, c, e]);
}

/// Two streams of random requests (4 B to 8 MiB, log-uniform) under a cap
/// the workload keeps running into, each failure freeing a random live
/// block: pages are shared again and again, members leave, and no two live
/// blocks ever reach the same byte of a page (the GPU pattern test runs the
/// same sequence with data checks).
#[test]
fn random_requests_under_a_cap_share_pages_without_overlap() {
    let dev = SimulatedDevice::new(1 << 40);
    let config = Config::expandable()
        .into_builder()
        .memory_cap(Some(cachealloc_core::MemoryCap::Bytes(160 * MIB)))
        .build()
        .unwrap();
    let a = CachingAllocator::new(dev.clone(), config);
    let mut x: u64 = 0x5EED_CAFE;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let mut live: Vec<DevicePtr> = Vec::new();
    let mut ooms = 0;
    for op in 1..=20_000u32 {
        let grow = live.len() < 8 || (live.len() < 400 && next(100) < 55);
        if grow {
            let exp = 2 + next(22) as u32;
            let bytes = (1u64 << exp) + next(1u64 << exp);
            let stream = StreamId(next(2));
            match a.malloc(bytes, stream) {
                Ok(p) => live.push(p),
                Err(AllocError::OutOfMemory(_)) => {
                    ooms += 1;
                    let p = live.swap_remove(next(live.len() as u64) as usize);
                    a.free(p).unwrap();
                }
                Err(e) => panic!("malloc({bytes}): {e}"),
            }
        } else {
            let p = live.swap_remove(next(live.len() as u64) as usize);
            a.free(p).unwrap();
        }
        if op % 500 == 0 {
            assert_no_physical_overlap(&a, &dev);
            a.check_invariants().unwrap();
        }
    }
    let st = a.stats();
    eprintln!(
        "{ooms} OOMs, {} pages shared, {} swapped",
        st.num_pages_shared, st.num_pages_rebacked
    );
    assert!(
        ooms > 0 && st.num_pages_shared > 0,
        "{ooms} OOMs, {} shared",
        st.num_pages_shared
    );
    assert!(st.reserved_bytes.all().peak <= 160 * MIB);
    freed_and_emptied(&dev, &a, &live);
}

#[test]
fn a_shared_page_no_member_uses_goes_back_before_out_of_memory() {
    let dev = SimulatedDevice::new(10 * MIB);
    let a = CachingAllocator::new(dev.clone(), config(true));
    let (x, c) = two_partial_granules(&a);
    let e = a.malloc(4 * MIB, S0).unwrap();
    assert_eq!(a.shared_mappings().len(), 1);
    // Every block goes: the shared page is held by aliased bytes alone,
    // which also split the range. The whole device for one block needs
    // the flush before out of memory to give that page back.
    for p in [x, c, e] {
        a.free(p).unwrap();
    }
    let whole = a.malloc(10 * MIB, S0).unwrap();
    assert!(a.shared_mappings().is_empty());
    assert_eq!(dev.used(), 10 * MIB);
    assert_no_physical_overlap(&a, &dev);
    freed_and_emptied(&dev, &a, &[whole]);
}

/// The two rungs make room for each other: a big page partly under a live
/// block can be swapped for a granule only once there is room for that
/// granule, which two small-pool granules sharing a page give.
#[test]
fn sharing_makes_room_for_a_pinned_page_to_give_its_free_part_back() {
    let config = |share: bool| {
        Config::parse(&format!(
            "expandable,expandable_page_divisor:0,expandable_share:{share}"
        ))
        .unwrap()
    };
    for share in [false, true] {
        let dev = SimulatedDevice::new(1 << 30);
        let a = CachingAllocator::new(dev.clone(), config(share));
        // Small pool: four 1 MiB blocks over two granules; the middle two
        // go, so granule 0 holds live bytes at 0..1 MiB, granule 1 at 1..2 MiB.
        let small: Vec<DevicePtr> = (0..4).map(|_| a.malloc(MIB, S0).unwrap()).collect();
        a.free(small[1]).unwrap();
        a.free(small[2]).unwrap();
        // Large pool, with room: a 6 MiB and a 2 MiB block under one 8 MiB
        // page; the 6 MiB one goes, so the page is pinned by the 2 MiB block.
        let x = a.malloc(6 * MIB, S0).unwrap();
        let pin = a.malloc(2 * MIB, S0).unwrap();
        a.free(x).unwrap();
        assert!(
            dev.page_mappings().iter().any(|m| m.2 == 8 * MIB),
            "{:?}",
            dev.page_mappings()
        );
        // Now capped at what is reserved: nothing more can be created.
        assert_eq!(dev.used(), 12 * MIB);
        a.set_memory_cap(Some(cachealloc_core::MemoryCap::Bytes(12 * MIB)))
            .unwrap();
        // 6.5 MiB: more than the pinned page's free 6 MiB; it needs the room
        // of the swap (6 MiB back), which needs the shared page's room first.
        let got = a.malloc(6 * MIB + MIB / 2, S0);
        let st = a.stats();
        assert_eq!(got.is_ok(), share, "share {share}: {got:?}");
        assert_eq!(
            (st.num_pages_shared > 0, st.num_pages_rebacked > 0),
            (share, share)
        );
        assert!(st.reserved_bytes.all().peak <= 12 * MIB);
        assert_no_physical_overlap(&a, &dev);
        let mut live = vec![small[0], small[3], pin];
        live.extend(got.ok());
        freed_and_emptied(&dev, &a, &live);
    }
}
