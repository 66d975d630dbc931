//! Giving back the free part of expandable pages partly under live blocks
//! before an allocation fails (`expandable_reback`): the live granules move
//! to new granule pages at the same addresses, the big page goes back. Each
//! test checks the simulated device's mappings and copies and the
//! allocator's invariants, page map included.

use cachealloc_core::sim_calls as calls;
use cachealloc_core::{
    AllocError, CachingAllocator, Config, DevicePtr, MemoryCap, SimulatedDevice, StreamId,
};

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);

/// `expandable` with 8 MiB pages whatever the workload's size.
fn config(reback: bool) -> Config {
    Config::parse(&format!(
        "expandable,expandable_page_divisor:0,expandable_reback:{reback}"
    ))
    .unwrap()
}

/// A 6 MiB and a 2 MiB block share the first 8 MiB page; the 6 MiB one is
/// freed, so the page holds 6 MiB free and the 2 MiB block at its end; then
/// a block of `big` bytes. Returns the 2 MiB block and the big one.
fn pin_a_page(
    a: &CachingAllocator<SimulatedDevice>,
    dev: &SimulatedDevice,
    big: u64,
) -> (DevicePtr, DevicePtr) {
    let x = a.malloc(6 * MIB, S0).unwrap();
    let pin = a.malloc(2 * MIB, S0).unwrap();
    assert_eq!(pin.0, x.0 + 6 * MIB);
    assert_eq!(
        dev.mappings(),
        vec![(x, 8 * MIB)],
        "one big page under both"
    );
    a.free(x).unwrap();
    let big = a.malloc(big, S0).unwrap();
    a.check_invariants().unwrap();
    (pin, big)
}

/// [`pin_a_page`] on a 64 MiB device with a 54 MiB block: 2 MiB left.
fn pinned_page(
    reback: bool,
) -> (
    SimulatedDevice,
    CachingAllocator<SimulatedDevice>,
    DevicePtr,
    DevicePtr,
) {
    let dev = SimulatedDevice::new(64 * MIB);
    let a = CachingAllocator::new(dev.clone(), config(reback));
    let (pin, big) = pin_a_page(&a, &dev, 54 * MIB);
    assert_eq!(dev.used(), 62 * MIB);
    (dev, a, pin, big)
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
    assert_eq!((dev.used(), dev.outstanding()), (0, 0));
}

#[test]
fn a_page_pinned_by_a_live_block_gives_its_free_part_back_before_out_of_memory() {
    // 6.5 MiB: the free 6 MiB under the pinned page are too small, and the
    // device has 2 MiB left; without the rung, out of memory.
    let (_, a, _, _) = pinned_page(false);
    let err = a.malloc(6 * MIB + MIB / 2, S0).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err:?}");
    assert_eq!(a.stats().num_pages_rebacked, 0);

    let (dev, a, pin, big) = pinned_page(true);
    let before = dev.counters();
    let q = a.malloc(6 * MIB + MIB / 2, S0).unwrap();
    let st = a.stats();
    assert_eq!((st.num_pages_rebacked, st.num_ooms), (1, 0));
    // The pinned block's granule was copied once to a new page now mapped
    // at its address; the 8 MiB page went back.
    let after = dev.counters();
    assert_eq!(after.copies - before.copies, 1);
    assert_eq!(after.copied_bytes - before.copied_bytes, 2 * MIB);
    assert_eq!(dev.mapped_bytes_in(pin, 2 * MIB), 2 * MIB);
    assert!(dev.mappings().contains(&(pin, 2 * MIB)));
    assert_eq!(dev.mapped_bytes_in(DevicePtr(pin.0 - 6 * MIB), 6 * MIB), 0);
    assert_eq!(dev.mapped_bytes_in(q, 6 * MIB + MIB / 2), 6 * MIB + MIB / 2);
    assert_eq!(a.usage().reserved, dev.used());
    assert!(dev.used() <= 64 * MIB);
    freed_and_emptied(&dev, &a, &[pin, big, q]);
}

#[test]
fn a_run_that_fits_copies_nothing() {
    let dev = SimulatedDevice::new(1 << 40);
    let a = CachingAllocator::new(dev.clone(), config(true));
    let (pin, q) = pin_a_page(&a, &dev, 7 * MIB);
    assert_eq!(dev.counters().copies, 0);
    assert_eq!(a.stats().num_pages_rebacked, 0);
    freed_and_emptied(&dev, &a, &[pin, q]);
}

#[test]
fn a_failed_copy_leaves_the_page_where_it_was() {
    let (dev, a, pin, big) = pinned_page(true);
    dev.fail_calls(calls::COPY, 1);
    let err = a.malloc(6 * MIB + MIB / 2, S0).unwrap_err();
    assert!(!matches!(err, AllocError::OutOfMemory(_)), "{err:?}");
    // The big page is still mapped under the pinned block; nothing leaked.
    assert!(dev
        .mappings()
        .contains(&(DevicePtr(pin.0 - 6 * MIB), 8 * MIB)));
    assert_eq!(dev.used(), 62 * MIB);
    assert_eq!(a.usage().reserved, dev.used());
    assert_eq!(a.stats().num_pages_rebacked, 0);
    a.check_invariants().unwrap();
    // The next try goes through.
    let q = a.malloc(6 * MIB + MIB / 2, S0).unwrap();
    assert_eq!(a.stats().num_pages_rebacked, 1);
    freed_and_emptied(&dev, &a, &[pin, big, q]);
}

#[test]
fn with_no_room_for_the_copy_the_allocation_fails_cleanly() {
    // A 56 MiB block instead: the device is full, so not even the one
    // granule the pinned block needs can be created first.
    let dev = SimulatedDevice::new(64 * MIB);
    let a = CachingAllocator::new(dev.clone(), config(true));
    let (pin, big) = pin_a_page(&a, &dev, 56 * MIB);
    assert_eq!(dev.used(), 64 * MIB);
    let err = a.malloc(6 * MIB + MIB / 2, S0).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err:?}");
    assert_eq!(a.stats().num_pages_rebacked, 0);
    assert_eq!(a.usage().reserved, dev.used());
    freed_and_emptied(&dev, &a, &[pin, big]);
}

#[test]
fn under_a_cap_the_swap_stays_within_it() {
    // 62 MiB reserved: the swap holds the new granule beside the old page
    // for a moment, 64 MiB, which a 64 MiB cap allows and a 63 MiB one not.
    for (cap, served) in [(64 * MIB, true), (63 * MIB, false)] {
        let dev = SimulatedDevice::new(1 << 40);
        let config = config(true)
            .into_builder()
            .memory_cap(Some(MemoryCap::Bytes(cap)))
            .build()
            .unwrap();
        let a = CachingAllocator::new(dev.clone(), config);
        let (pin, big) = pin_a_page(&a, &dev, 54 * MIB);
        let q = a.malloc(6 * MIB + MIB / 2, S0);
        assert_eq!(q.is_ok(), served, "cap {cap}: {q:?}");
        assert_eq!(a.stats().num_pages_rebacked, u64::from(served));
        assert!(a.stats().reserved_bytes.all().peak <= cap, "cap {cap}");
        assert_eq!(a.usage().reserved, dev.used());
        let mut live = vec![pin, big];
        live.extend(q.ok());
        freed_and_emptied(&dev, &a, &live);
    }
}
