//! Giving back the free part of expandable pages partly under live blocks
//! before an allocation fails (`expandable_reback`): the live granules move
//! to new granule pages at the same addresses, the big page goes back. Each
//! test checks the simulated device's mappings and copies and the
//! allocator's invariants, page map included.

use cachealloc_core::simulated::calls;
use cachealloc_core::{AllocError, CachingAllocator, Config, DevicePtr, SimulatedDevice, StreamId};

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);

/// `expandable` with 8 MiB pages whatever the workload's size.
fn config(reback: bool) -> Config {
    Config::parse(&format!(
        "expandable,expandable_page_divisor:0,expandable_reback:{reback}"
    ))
    .unwrap()
}

/// On a 64 MiB device: a 6 MiB and a 2 MiB block share the first 8 MiB
/// page; the 6 MiB one is freed, so the page holds 6 MiB free and the 2 MiB
/// block at its end; a 54 MiB block fills the device but for 2 MiB.
/// Returns the allocator, the 2 MiB block and the 54 MiB one.
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
    let x = a.malloc(6 * MIB, S0).unwrap();
    let pin = a.malloc(2 * MIB, S0).unwrap();
    assert_eq!(pin.0, x.0 + 6 * MIB);
    assert_eq!(
        dev.mappings(),
        vec![(x, 8 * MIB)],
        "one big page under both"
    );
    a.free(x).unwrap();
    let big = a.malloc(54 * MIB, S0).unwrap();
    assert_eq!(dev.used(), 62 * MIB);
    a.check_invariants().unwrap();
    (dev, a, pin, big)
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
    a.check_invariants().unwrap();
    for p in [pin, big, q] {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!((dev.used(), dev.outstanding()), (0, 0));
}

#[test]
fn a_run_that_fits_copies_nothing() {
    let dev = SimulatedDevice::new(1 << 40);
    let a = CachingAllocator::new(dev.clone(), config(true));
    let x = a.malloc(6 * MIB, S0).unwrap();
    let pin = a.malloc(2 * MIB, S0).unwrap();
    a.free(x).unwrap();
    let q = a.malloc(7 * MIB, S0).unwrap();
    assert_eq!(dev.counters().copies, 0);
    assert_eq!(a.stats().num_pages_rebacked, 0);
    for p in [pin, q] {
        a.free(p).unwrap();
    }
    a.check_invariants().unwrap();
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
    a.check_invariants().unwrap();
    for p in [pin, big, q] {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!((dev.used(), dev.outstanding()), (0, 0));
}

#[test]
fn with_no_room_for_the_copy_the_allocation_fails_cleanly() {
    // The 54 MiB block made 56: the device is full, so not even the one
    // granule the pinned block needs can be created first.
    let dev = SimulatedDevice::new(64 * MIB);
    let a = CachingAllocator::new(dev.clone(), config(true));
    let x = a.malloc(6 * MIB, S0).unwrap();
    let pin = a.malloc(2 * MIB, S0).unwrap();
    a.free(x).unwrap();
    let big = a.malloc(56 * MIB, S0).unwrap();
    assert_eq!(dev.used(), 64 * MIB);
    let err = a.malloc(6 * MIB + MIB / 2, S0).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err:?}");
    assert_eq!(a.stats().num_pages_rebacked, 0);
    assert_eq!(a.usage().reserved, dev.used());
    a.check_invariants().unwrap();
    for p in [pin, big] {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!((dev.used(), dev.outstanding()), (0, 0));
}

#[test]
fn under_a_cap_the_swap_stays_within_it() {
    let dev = SimulatedDevice::new(1 << 40);
    let mut config = config(true);
    config.memory_cap = Some(cachealloc_core::MemoryCap::Bytes(64 * MIB));
    let a = CachingAllocator::new(dev.clone(), config);
    let x = a.malloc(6 * MIB, S0).unwrap();
    let pin = a.malloc(2 * MIB, S0).unwrap();
    a.free(x).unwrap();
    let big = a.malloc(54 * MIB, S0).unwrap();
    let q = a.malloc(6 * MIB + MIB / 2, S0).unwrap();
    assert_eq!(a.stats().num_pages_rebacked, 1);
    assert!(a.stats().reserved_bytes.all().peak <= 64 * MIB);
    assert_eq!(a.usage().reserved, dev.used());
    a.check_invariants().unwrap();
    for p in [pin, big, q] {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!((dev.used(), dev.outstanding()), (0, 0));
}
