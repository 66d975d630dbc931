//! Unit tests of the allocator, one file per feature; the helpers they share.

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

/// An expandable allocator with shadows (2 MiB pages, soft limit at the
/// peak, no hard limit) in which x's two pages were moved under y: returns
/// it with x's address, y and the live block between them.
pub(in crate::allocator) fn moved_with_shadows(
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

/// Slabs without thread caches in front, so that every call reaches them.
fn slabs(max_kb: u64) -> Config {
    Config::parse(&format!("segments,thread_cache:0,slab_max_kb:{max_kb}")).unwrap()
}

/// `default` with every large-pool page one 2 MiB granule.
fn granule_pages() -> Config {
    Config {
        expandable_page: 2 * MIB,
        expandable_page_divisor: 0,
        ..Config::default()
    }
}

mod capture_reuse;
mod expandable_moves;
mod expandable_pages;
mod policy;
mod slabs_and_borrowing;
