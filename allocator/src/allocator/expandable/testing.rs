//! What the unit tests of the expandable files share: an allocator on a
//! simulated device, its expandable state under the lock, and the ranges
//! and free blocks to call the feature's methods on.

use super::{Expandable, Tail};
use crate::allocator::{CachingAllocator, Core, State};
use crate::bins::Entry;
use crate::block::{BlockState, PoolId, PoolKind, SegmentId};
use crate::config::Config;
use crate::device::{Device, DevicePtr, StreamId};
use crate::simulated::SimulatedDevice;

pub(super) const MIB: u64 = 1 << 20;
/// The simulated device's granularity.
pub(super) const PAGE: u64 = 2 * MIB;
pub(super) const S0: StreamId = StreamId(0);
pub(super) const S1: StreamId = StreamId(1);

pub(super) type Alloc = CachingAllocator<SimulatedDevice>;
pub(super) type Event = <SimulatedDevice as Device>::Event;

/// The expandable preset with pages of `page` bytes in the large pools,
/// not scaled to the workload nor larger after `empty_cache`, and shadows
/// as `shadows` says: page counts the tests can work out.
pub(super) fn fixed_pages(page: u64, shadows: bool) -> Config {
    Config {
        expandable_page: page,
        expandable_page_divisor: 0,
        expandable_regrow_pages: false,
        expandable_shadows: shadows,
        ..Config::expandable()
    }
}

/// An allocator with `config` on a simulated device of 1 TiB.
pub(super) fn alloc(config: Config) -> (SimulatedDevice, Alloc) {
    let dev = SimulatedDevice::new(1 << 40);
    (dev.clone(), CachingAllocator::new(dev, config))
}

/// Blocks of `sizes` on stream 0, each followed by a live block of a page
/// (so that none merges with the next), freed in order: their addresses.
pub(super) fn holes(a: &Alloc, sizes: &[u64]) -> Vec<DevicePtr> {
    let holes: Vec<DevicePtr> = sizes
        .iter()
        .map(|&size| {
            let p = a.malloc(size, S0).unwrap();
            a.malloc(PAGE, S0).unwrap();
            p
        })
        .collect();
    for &p in &holes {
        a.free(p).unwrap();
    }
    holes
}

/// Runs `f` on the allocator's expandable state, its core and its device,
/// under its lock.
pub(super) fn with_state<R>(
    a: &Alloc,
    f: impl FnOnce(&mut Expandable<Event>, &mut Core<Event>, &SimulatedDevice) -> R,
) -> R {
    let mut st = a.state.lock();
    let State { core, vmm, .. } = &mut *st;
    f(vmm, core, &a.device)
}

/// The large pool of stream slot `slot`.
pub(super) fn large(slot: u32) -> PoolId {
    PoolId::new(slot, PoolKind::Large)
}

/// The first range of `pool`.
pub(super) fn first_range<E>(vmm: &Expandable<E>, pool: PoolId) -> SegmentId {
    vmm.ranges[pool.index()][0]
}

/// The block of `seg` at `addr` as the bins list it (it is free).
pub(super) fn free_block<E>(core: &Core<E>, seg: SegmentId, addr: u64) -> Entry {
    let mut cur = Some(core.segment(seg).head);
    while let Some(id) = cur {
        let b = core.blocks.get(id.0);
        if b.addr == addr {
            assert_eq!(b.state, BlockState::Free, "block at {addr:#x}");
            return Entry {
                size: b.size,
                addr,
                id,
            };
        }
        cur = b.next;
    }
    panic!("no block at {addr:#x}");
}

/// Free block `e` as the tail of a block carved at its start: the whole
/// block stays free.
pub(super) fn whole<E>(core: &Core<E>, e: Entry) -> Tail {
    let b = core.blocks.get(e.id.0);
    Tail {
        seg: b.segment,
        start: e.addr,
        end: e.addr + e.size,
        since: b.freed_at,
    }
}
