//! Blocks shared with other processes (CUDA IPC): what backs a block
//! (`CachingAllocator::export_block`), and the pins that keep the pages
//! under a shared block of an expandable segment where they are until the
//! block is freed (Note [Shared blocks are pinned]): neither reback nor
//! share moves them. Each test checks the simulated device's mappings and
//! copies and the allocator's invariants (pins included).

use cachealloc_core::{
    AllocError, BlockBacking, CachingAllocator, Config, DevicePtr, SimulatedDevice, StreamId,
};

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

fn conf(s: &str) -> Config {
    Config::parse(s).unwrap()
}

/// The pages `export_block` names, checked against the device: each is
/// mapped at its place, side by side from `base`, and together they cover
/// the block. Returns the page sizes.
fn check_pages(dev: &SimulatedDevice, block: DevicePtr, size: u64, b: &BlockBacking) -> Vec<u64> {
    let BlockBacking::Pages {
        base,
        pages,
        offset,
    } = b
    else {
        panic!("an expandable block is backed by pages: {b:?}");
    };
    assert_eq!(base.0 + offset, block.0);
    let maps = dev.page_mappings();
    let mut at = base.0;
    for &(handle, bytes) in pages {
        assert!(
            maps.contains(&(DevicePtr(at), handle, bytes)),
            "page {handle} of {bytes} bytes is not mapped at {at:#x}: {maps:?}"
        );
        at += bytes;
    }
    assert!(at >= block.0 + size, "the pages end before the block");
    assert!(
        at - pages.last().unwrap().1 < block.0 + size,
        "a page past the block"
    );
    pages.iter().map(|p| p.1).collect()
}

#[test]
fn a_block_of_a_plain_segment_is_backed_by_its_segment_and_not_pinned() {
    let dev = SimulatedDevice::new(1 << 30);
    let a = CachingAllocator::new(dev.clone(), conf("segments"));
    let x = a.malloc(3 * MIB, S0).unwrap();
    let y = a.malloc(5 * MIB, S0).unwrap();
    let segs = dev.segments();
    for p in [x, y] {
        let b = a.export_block(p).unwrap();
        let BlockBacking::Segment { base, size, offset } = b else {
            panic!("{b:?}")
        };
        assert!(segs.contains(&(base, size)), "{segs:?}");
        assert_eq!(base.0 + offset, p.0);
        assert!(offset + 3 * MIB <= size);
    }
    assert_eq!(a.pinned_blocks(), (0, 0), "plain segments never move");
    a.check_invariants().unwrap();
    a.free(x).unwrap();
    a.free(y).unwrap();
}

#[test]
fn a_block_of_an_expandable_segment_is_backed_by_the_pages_under_it() {
    // 8 MiB pages: a 20 MiB block at the start of a range lies on three.
    let dev = SimulatedDevice::new(1 << 30);
    let a = CachingAllocator::new(
        dev.clone(),
        conf("expandable,expandable_page_divisor:0,expandable_edges:big"),
    );
    let x = a.malloc(20 * MIB, S0).unwrap();
    let sizes = check_pages(&dev, x, 20 * MIB, &a.export_block(x).unwrap());
    assert_eq!(sizes, vec![8 * MIB; 3]);
    assert_eq!(a.pinned_blocks(), (1, 20 * MIB));
    // A second block on the last page: backed by that page alone, at an offset.
    let y = a.malloc(2 * MIB, S0).unwrap();
    let b = a.export_block(y).unwrap();
    assert_eq!(check_pages(&dev, y, 2 * MIB, &b), vec![8 * MIB]);
    let BlockBacking::Pages { offset, .. } = b else {
        unreachable!()
    };
    assert_eq!(offset, 4 * MIB);
    // Sharing again changes nothing.
    assert_eq!(a.export_block(y).unwrap(), b);
    assert_eq!(a.pinned_blocks(), (2, 22 * MIB));
    a.check_invariants().unwrap();
    a.free(x).unwrap();
    a.free(y).unwrap();
    assert_eq!(a.pinned_blocks(), (0, 0));
    a.empty_cache().unwrap();
    assert_eq!(dev.outstanding(), 0);
}

#[test]
fn a_block_over_pages_of_two_sizes_names_each() {
    // Granule pages at the edges, 8 MiB pages wholly under the block.
    let dev = SimulatedDevice::new(1 << 30);
    let a = CachingAllocator::new(
        dev.clone(),
        conf("expandable,expandable_page_divisor:0,expandable_edges:small"),
    );
    let x = a.malloc(3 * MIB, S0).unwrap();
    let y = a.malloc(21 * MIB, S0).unwrap();
    let sizes = check_pages(&dev, y, 21 * MIB, &a.export_block(y).unwrap());
    assert!(sizes.len() > 2, "{sizes:?}");
    assert!(
        sizes.contains(&(2 * MIB)) && sizes.contains(&(8 * MIB)),
        "{sizes:?}"
    );
    a.check_invariants().unwrap();
    a.free(x).unwrap();
    a.free(y).unwrap();
}

/// A 6 MiB and a 2 MiB block share the first 8 MiB page of a 64 MiB
/// device; the 6 MiB one is freed and a 54 MiB block follows: 2 MiB left
/// (the set-up of `tests/reback.rs`). Returns the 2 MiB block and the big one.
fn page_partly_free(
    dev: &SimulatedDevice,
    a: &CachingAllocator<SimulatedDevice>,
) -> (DevicePtr, DevicePtr) {
    let x = a.malloc(6 * MIB, S0).unwrap();
    let pin = a.malloc(2 * MIB, S0).unwrap();
    assert_eq!(dev.mappings(), vec![(x, 8 * MIB)]);
    a.free(x).unwrap();
    let big = a.malloc(54 * MIB, S0).unwrap();
    assert_eq!(dev.used(), 62 * MIB);
    (pin, big)
}

fn reback_config() -> Config {
    conf("expandable,expandable_page_divisor:0,expandable_reback:true")
}

#[test]
fn reback_leaves_the_page_of_a_shared_block_where_it_is() {
    let dev = SimulatedDevice::new(64 * MIB);
    let a = CachingAllocator::new(dev.clone(), reback_config());
    let (pin, big) = page_partly_free(&dev, &a);
    let b = a.export_block(pin).unwrap();
    let maps = dev.page_mappings();
    let before = dev.counters();
    // Unshared, the 8 MiB page would give its free 6 MiB back for this
    // request (tests/reback.rs); shared, it stays: out of memory instead.
    let err = a.malloc(6 * MIB + MIB / 2, S0).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err:?}");
    assert_eq!(a.stats().num_pages_rebacked, 0);
    assert_eq!(dev.counters().copies, before.copies, "nothing copied");
    assert_eq!(dev.page_mappings(), maps, "nothing moved");
    check_pages(&dev, pin, 2 * MIB, &b);
    a.check_invariants().unwrap();
    // Once the block is freed (its consumers are done), nothing is pinned.
    a.free(pin).unwrap();
    assert_eq!(a.pinned_blocks(), (0, 0));
    let q = a.malloc(6 * MIB + MIB / 2, S0).unwrap();
    a.check_invariants().unwrap();
    a.free(q).unwrap();
    a.free(big).unwrap();
}

#[test]
fn a_shared_block_pins_only_its_own_pages() {
    // The big block is shared: its pages lie wholly under it, and the
    // partly free page beside it still gives its free part back.
    let dev = SimulatedDevice::new(64 * MIB);
    let a = CachingAllocator::new(dev.clone(), reback_config());
    let (pin, big) = page_partly_free(&dev, &a);
    let b = a.export_block(big).unwrap();
    let q = a.malloc(6 * MIB + MIB / 2, S0).unwrap();
    assert_eq!(a.stats().num_pages_rebacked, 1);
    check_pages(&dev, big, 54 * MIB, &b);
    a.check_invariants().unwrap();
    for p in [pin, big, q] {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!((dev.used(), dev.outstanding()), (0, 0));
}

/// Four 2.5 MiB blocks tile 10 MiB of a range of 2 MiB pages; the second
/// and fourth are freed (the set-up of `tests/share.rs`): granule 1 holds
/// the first block's tail, granule 2 the third block's head, at disjoint
/// offsets. Returns the first and third blocks.
fn two_partial_granules(a: &CachingAllocator<SimulatedDevice>) -> (DevicePtr, DevicePtr) {
    let blocks: Vec<DevicePtr> = (0..4).map(|_| a.malloc(5 * MIB / 2, S0).unwrap()).collect();
    a.free(blocks[1]).unwrap();
    a.free(blocks[3]).unwrap();
    (blocks[0], blocks[2])
}

#[test]
fn share_leaves_the_pages_of_a_shared_block_where_they_are() {
    let config =
        conf("expandable,expandable_page_mb:2,expandable_page_divisor:0,expandable_share:true");
    // Nothing shared: granules 1 and 2 share a page for the request
    // (tests/share.rs). Either block shared: its granules keep their pages;
    // the other two granules' live bytes meet, so nothing can share, and
    // the request fails.
    for shared in [None, Some(0), Some(1)] {
        let dev = SimulatedDevice::new(10 * MIB);
        let a = CachingAllocator::new(dev.clone(), config.clone());
        let (x, c) = two_partial_granules(&a);
        let Some(i) = shared else {
            let e = a.malloc(4 * MIB, S0).unwrap();
            assert_eq!(a.stats().num_pages_shared, 1);
            a.check_invariants().unwrap();
            for p in [x, c, e] {
                a.free(p).unwrap();
            }
            continue;
        };
        let p = [x, c][i];
        let b = a.export_block(p).unwrap();
        let maps = dev.page_mappings();
        let err = a.malloc(4 * MIB, S0).unwrap_err();
        assert!(matches!(err, AllocError::OutOfMemory(_)), "{err:?}");
        assert_eq!(a.stats().num_pages_shared, 0);
        assert_eq!(dev.counters().copies, 0);
        assert_eq!(dev.page_mappings(), maps, "nothing moved");
        check_pages(&dev, p, 5 * MIB / 2, &b);
        a.check_invariants().unwrap();
        a.free(p).unwrap();
        assert_eq!(a.pinned_blocks(), (0, 0));
        let e = a.malloc(4 * MIB, S0).unwrap();
        a.check_invariants().unwrap();
        a.free(e).unwrap();
        a.free([x, c][1 - i]).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(dev.outstanding(), 0);
    }
}

#[test]
fn a_shared_block_freed_while_other_streams_use_it_is_unpinned_at_once() {
    let dev = SimulatedDevice::new(1 << 30).with_auto_complete(false);
    let a = CachingAllocator::new(dev.clone(), conf("expandable"));
    let x = a.malloc(10 * MIB, S0).unwrap();
    a.export_block(x).unwrap();
    a.record_stream(x, S1).unwrap();
    a.free(x).unwrap();
    // Awaiting its event: not reused yet, but no longer shared.
    assert_eq!(a.pinned_blocks(), (0, 0));
    a.check_invariants().unwrap();
    dev.complete_all_events();
    a.process_events().unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn bad_pointers_are_errors_and_pin_nothing() {
    for preset in ["segments", "expandable"] {
        let dev = SimulatedDevice::new(1 << 30);
        let a = CachingAllocator::new(dev.clone(), conf(preset));
        let x = a.malloc(4 * MIB, S0).unwrap();
        let y = a.malloc(4 * MIB, S0).unwrap();
        a.free(y).unwrap();
        let e = a.export_block(DevicePtr(0xdead_0000)).unwrap_err();
        assert!(
            matches!(e, AllocError::UnknownPointer(_)),
            "{preset}: {e:?}"
        );
        let e = a.export_block(DevicePtr(x.0 + 512)).unwrap_err();
        assert!(
            matches!(e, AllocError::InteriorPointer { .. }),
            "{preset}: {e:?}"
        );
        let e = a.export_block(y).unwrap_err();
        assert!(
            matches!(e, AllocError::DoubleFree(_) | AllocError::UnknownPointer(_)),
            "{preset}: {e:?}"
        );
        assert_eq!(a.pinned_blocks(), (0, 0), "{preset}");
        a.check_invariants().unwrap();
        a.free(x).unwrap();
    }
}

#[test]
fn a_block_handed_out_by_a_thread_cache_can_be_shared_and_a_parked_one_cannot() {
    let dev = SimulatedDevice::new(1 << 30);
    let a = CachingAllocator::new(dev.clone(), conf("segments,thread_cache:4"));
    // Freed and taken back through the calling thread's cache.
    let x = a.malloc(MIB, S0).unwrap();
    a.free(x).unwrap();
    let y = a.malloc(MIB, S0).unwrap();
    assert_eq!(x, y);
    assert!(matches!(
        a.export_block(y).unwrap(),
        BlockBacking::Segment { .. }
    ));
    a.check_invariants().unwrap();
    a.free(y).unwrap();
    // Parked in the cache: freed, so refused.
    let z = a.malloc(2 * MIB, S0).unwrap();
    a.free(z).unwrap();
    assert!(a.export_block(z).is_err());
    a.check_invariants().unwrap();
}
