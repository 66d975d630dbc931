//! Expandable ranges and page sizes: how large a pool's next virtual range
//! is, which page size a mapping takes (`expandable_page` scaled to the
//! workload, larger while memory grows back after `empty_cache`), and the
//! limits on reserved memory that the recycling rounds and the choice of
//! page sizes answer to.
//!
//! Note [Pages after empty_cache]: giving a page back costs an unmap and a
//! release, whatever its size, so `empty_cache` costs per page, and a
//! program that empties the cache every step pays it every step, with a
//! create and a map for each page as its memory grows back. While reserved
//! memory grows back towards what it was before an `empty_cache` that gave
//! pages back, new mappings take pages up to [`REGROW_PAGE_FACTOR`] times
//! `expandable_page` (each range is reserved for them: `Segment::page_size`
//! is that largest page), scaled by a divisor that many times smaller, as
//! long as reserved memory stays under the soft limit and growing all the
//! way back leaves room under the cap or the device's memory (a minimum
//! capacity does not move). Past that level, where the device refuses a
//! larger page, and in a program that never empties its cache, pages are
//! `expandable_page` as before, so its memory figures do not change.

use super::Expandable;
use crate::allocator::Core;
use crate::block::{PoolId, PoolKind, Segment, SegmentId};
use crate::device::{Device, StreamId};
use crate::error::AllocError;

/// How many times `expandable_page` the pages mapped while memory grows back
/// after `empty_cache` may be (Note [Pages after empty_cache]); a power of
/// two, so that `expandable_page` is one of the range's halvings.
pub(super) const REGROW_PAGE_FACTOR: u64 = 4;

/// The widest margin below the device's memory or the cap within which
/// mappings count as under pressure (granule pages at blocks' edges). The
/// margin is the hard slack, twice `expandable_slack`, up to this bound: a
/// slack of 0.5 or more would otherwise put every mapping under pressure
/// (granule pages only, four times the map calls of 8 MiB pages).
const MAX_PRESSURE_MARGIN: f64 = 0.1;

/// Largest virtual range reserved at once: 256 GiB.
const MAX_RANGE: u64 = 1 << 38;

/// Ranges reserved at the largest size ([`range_size`]) before later pools'
/// first ranges start small: a program with a few streams gets one range
/// per pool, as large as ever; one with thousands of streams fits in the
/// address space.
const FULL_RANGES: u64 = 64;

/// Size of a pool's first range once `FULL_RANGES` are reserved: 2 GiB
/// (less on a device with less memory). Later ranges of the pool double, so
/// a pool that grows needs a few ranges only.
const FIRST_RANGE: u64 = 2 << 30;

/// Ranges reserved past which a pool's first range is half of
/// `FIRST_RANGE`, and half again at each doubling of the ranges, down to
/// `MIN_FIRST_RANGE`: a program with a million streams (a range per stream
/// and pool, two million in all) fits in the address space (128 TiB on an
/// x86-64 host) without flushing the cache to free address space. At 2 GiB
/// a range, 58,000 ranges filled it; now 44 TiB hold the first 131,072
/// ranges and 32 MiB each of the rest.
const MANY_RANGES: u64 = 4096;

/// The smallest first range of a pool (`MANY_RANGES`): 32 MiB, four of the
/// largest pages; a larger request still gets twice its size.
const MIN_FIRST_RANGE: u64 = 32 << 20;

/// Virtual bytes reserved per expandable range at most, per byte of device
/// memory. Address space is cheap and holes in it cost no memory once their
/// pages move, but a range only as large as the device would run out of
/// address space before the device runs out of memory.
const RANGE_PER_DEVICE_BYTE: u64 = 2;

/// The largest virtual range on a device of `total` bytes.
fn range_size(total: u64, page: u64) -> u64 {
    round_up(
        total.saturating_mul(RANGE_PER_DEVICE_BYTE).min(MAX_RANGE),
        page,
    )
}

/// The size of a pool's next range on a device of `total` bytes, with
/// `ranges` reserved in all: the largest ([`range_size`]) while fewer than
/// `FULL_RANGES` are; past that, twice the pool's `largest` range so far
/// (`FIRST_RANGE` for the first, less past `MANY_RANGES`), within the
/// largest, and at least twice the request of `rounded` bytes that needs it
/// (at least the request itself).
pub(in crate::allocator) fn next_range_size(
    total: u64,
    page: u64,
    ranges: u64,
    largest: u64,
    rounded: u64,
) -> u64 {
    let max = range_size(total, page);
    let first = if ranges < FULL_RANGES {
        max
    } else if ranges < MANY_RANGES {
        FIRST_RANGE
    } else {
        // Halved once from MANY_RANGES, again at each doubling.
        let halvings = 64 - (ranges / MANY_RANGES).leading_zeros();
        (FIRST_RANGE >> halvings).max(MIN_FIRST_RANGE)
    };
    let want = largest
        .saturating_mul(2)
        .max(first)
        .max(rounded.saturating_mul(2))
        .min(max)
        .max(rounded);
    round_up(want, page)
}

fn round_up(bytes: u64, page: u64) -> u64 {
    bytes.div_ceil(page).max(1) * page
}

/// The next smaller page size, in granules, after one of `big` granules:
/// half, or one granule where an odd number does not halve. Every size so
/// reached divides the larger ones, so pages of each size stay aligned to it.
pub(super) fn smaller_page(big: u32) -> u32 {
    if big % 2 == 0 {
        big / 2
    } else {
        1
    }
}

/// A big page of `big` granules, made smaller ([`smaller_page`]) down to
/// the peak allocated bytes (counting `bytes` about to be mapped) over
/// `expandable_page_divisor`.
pub(in crate::allocator) fn scaled_granules<E>(core: &Core<E>, big: u32, bytes: u64) -> u32 {
    scaled_granules_by(core, big, bytes, core.config.expandable_page_divisor)
}

/// [`scaled_granules`] with the divisor given (0: no scaling).
fn scaled_granules_by<E>(core: &Core<E>, mut big: u32, bytes: u64, divisor: u64) -> u32 {
    let g = core.granule();
    let alloc = core.stats.allocated_bytes.all();
    let scale = alloc.peak.max(alloc.current.saturating_add(bytes));
    if let Some(most) = scale.checked_div(divisor) {
        while big > 1 && u64::from(big) * g > most {
            big = smaller_page(big);
        }
    }
    big
}

/// Reserved-memory limits of the recycling rounds ([`Expandable::limits`]).
#[derive(Copy, Clone, Debug)]
pub(super) struct Limits {
    /// Past it, creating pages first takes idle pages no queued work can
    /// touch (`idle_slack` over the peak allocated bytes).
    pub(super) soft: u64,
    /// Past it, creating pages first waits for idle pages (`idle_slack_hard`).
    pub(super) hard: u64,
    /// The memory cap, `u64::MAX` for none.
    pub(super) cap: u64,
}

impl<E> Expandable<E> {
    /// Page size of the expandable segments of a pool kind: the largest
    /// page a new range of it may map (`Segment::page_size`).
    pub(in crate::allocator) fn page_size(&self, core: &Core<E>, kind: PoolKind) -> u64 {
        let g = core.granule();
        match kind {
            PoolKind::Small => g,
            PoolKind::Large | PoolKind::Huge => {
                let page = core.config.expandable_page.div_ceil(g).max(1) * g;
                if core.config.expandable_regrow_pages {
                    page * REGROW_PAGE_FACTOR
                } else {
                    page
                }
            }
        }
    }

    /// Whether mapping `bytes` now grows reserved memory back towards its
    /// level before an `empty_cache` (Note [Pages after empty_cache]).
    #[inline]
    pub(super) fn regrowing(&self, core: &Core<E>, bytes: u64) -> bool {
        let Some(to) = self
            .regrow_to
            .filter(|_| core.config.expandable_regrow_pages)
        else {
            return false;
        };
        // Below where recycling starts, too: the larger pages never make
        // the allocator recycle (or wait) sooner.
        let peak = core.stats.allocated_bytes.all().peak as f64;
        let slack = (peak * (1.0 + core.config.idle_slack)) as u64;
        // And only with room to spare: growing all the way back, with a
        // sixteenth more for what larger pages may strand at blocks' edges,
        // stays clear of the cap or the device's memory.
        let back = to.saturating_sub(core.reserved()).saturating_add(to / 16);
        core.reserved().saturating_add(bytes) <= to.min(slack)
            && !self.under_pressure(core, back.max(bytes))
    }

    /// The big page of range `s` for mapping `bytes` now, in granules:
    /// `expandable_page` scaled to the workload ([`scaled_granules`]), or
    /// while reserved memory grows back after `empty_cache`, the range's
    /// largest page, scaled by a divisor [`REGROW_PAGE_FACTOR`] times
    /// smaller (Note [Pages after empty_cache]).
    #[inline]
    pub(super) fn big_granules(&self, core: &Core<E>, s: &Segment, bytes: u64) -> u32 {
        let g = core.granule();
        let max = (s.page_size() / g) as u32;
        if !core.config.expandable_regrow_pages || max == 1 {
            return scaled_granules(core, max, bytes);
        }
        if self.regrowing(core, bytes) {
            let divisor = (core.config.expandable_page_divisor / REGROW_PAGE_FACTOR).max(1);
            return scaled_granules_by(core, max, bytes, divisor);
        }
        // `expandable_page`: the range's largest page halved (it divides it).
        let mut big = max;
        while big > 1 && u64::from(big) * g > core.config.expandable_page {
            big = smaller_page(big);
        }
        scaled_granules(core, big, bytes)
    }

    /// Reserves a range for `pool` big enough for `rounded` bytes: the first
    /// one `FIRST_RANGE` (or the cap on ranges, if smaller), each later one
    /// twice the largest before, so that a pool needs few ranges however far
    /// it grows and a thousand streams' pools fit in the address space.
    pub(in crate::allocator) fn reserve_range<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        pool: PoolId,
        stream: StreamId,
        rounded: u64,
    ) -> Result<SegmentId, AllocError> {
        let page_size = self.page_size(core, pool.kind());
        if pool.index() >= self.ranges.len() {
            self.ranges.resize_with(pool.index() + 1, Vec::new);
        }
        let largest = self.ranges[pool.index()]
            .iter()
            .map(|s| core.segment(*s).size)
            .max()
            .unwrap_or(0);
        let ranges = core.stats.segment.all().current;
        let size = next_range_size(self.range_size, page_size, ranges, largest, rounded);
        let ptr = dev.vmm_reserve(size)?;
        core.stats.num_vmm_reserve += 1;
        let seg = core.add_segment(ptr, size, stream, pool, Some(page_size));
        let head = core.segment(seg).head;
        core.bins_mut(pool).insert(size, ptr.0, head);
        self.ranges[pool.index()].push(seg);
        Ok(seg)
    }

    /// Reserved-memory limits of the recycling rounds.
    pub(super) fn limits(&self, core: &Core<E>) -> Limits {
        let peak = core.stats.allocated_bytes.all().peak as f64;
        let (soft, hard) = if core.config.expandable_recycle {
            let soft = (peak * (1.0 + core.config.idle_slack)) as u64;
            (
                soft,
                soft.max((peak * (1.0 + core.config.idle_slack_hard)) as u64),
            )
        } else {
            (u64::MAX, u64::MAX)
        };
        Limits {
            soft,
            hard,
            cap: core.cap_now().unwrap_or(u64::MAX),
        }
    }

    /// Whether mapping `bytes` more would bring reserved memory within
    /// `idle_slack_hard` (at most [`MAX_PRESSURE_MARGIN`]) of the cap, of the
    /// device's total memory, or of the level at which the device was last
    /// found full.
    pub(super) fn under_pressure(&self, core: &Core<E>, bytes: u64) -> bool {
        let limit = self.memory_limit(core);
        let margin = core.config.idle_slack_hard.min(MAX_PRESSURE_MARGIN);
        let limit = (limit as f64 * (1.0 - margin)) as u64;
        core.reserved() + bytes > limit
    }

    /// The most reserved memory can reach: the cap, the device's memory, or
    /// the level at which the device was last found full.
    fn memory_limit(&self, core: &Core<E>) -> u64 {
        let cap = self.limits(core).cap;
        cap.min(self.device_full_at.unwrap_or(u64::MAX))
            .min(self.range_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::expandable::testing::*;
    use crate::config::Config;

    /// A pool's next range: the largest while few are reserved; past
    /// `FULL_RANGES` a first range of `FIRST_RANGE` that doubles with the
    /// pool's largest; past `MANY_RANGES` first ranges halving down to
    /// `MIN_FIRST_RANGE`; twice a larger request where there is room, and
    /// never less than the request.
    #[test]
    fn ranges_start_small_only_when_many_are_reserved() {
        let (total, page) = (80 << 30, 8 * MIB);
        let max = range_size(total, page);
        assert_eq!(max, 160 << 30, "twice the device");
        assert_eq!(range_size(1 << 40, page), MAX_RANGE);
        let next =
            |ranges, largest, rounded| next_range_size(total, page, ranges, largest, rounded);
        assert_eq!(next(FULL_RANGES - 1, 0, 4096), max);
        assert_eq!(next(FULL_RANGES, 0, 4096), FIRST_RANGE);
        assert_eq!(next(FULL_RANGES, FIRST_RANGE, 4096), 2 * FIRST_RANGE);
        assert_eq!(next(MANY_RANGES, 0, 4096), FIRST_RANGE / 2);
        assert_eq!(next(64 * MANY_RANGES, 0, 4096), MIN_FIRST_RANGE);
        assert_eq!(next(64 * MANY_RANGES, 0, 100 * MIB), 200 * MIB);
        assert_eq!(next(0, 0, 200 << 30), 200 << 30, "past the largest");
    }

    /// Each smaller page size divides the larger ones, down to one granule.
    #[test]
    fn smaller_pages_divide_the_larger_ones() {
        assert_eq!((smaller_page(12), smaller_page(3)), (6, 1));
        for big in 1..=64u32 {
            let sizes: Vec<u32> =
                std::iter::successors(Some(big), |&n| (n > 1).then(|| smaller_page(n))).collect();
            assert_eq!(sizes.last(), Some(&1));
            assert!(
                sizes.windows(2).all(|w| w[1] < w[0] && w[0] % w[1] == 0),
                "{sizes:?}"
            );
        }
    }

    /// Small-pool pages are a granule; large-pool pages are
    /// `expandable_page` made smaller down to the peak allocated bytes
    /// (counting those about to be mapped) over the divisor.
    #[test]
    fn pages_follow_the_pool_kind_and_the_workload() {
        let (_dev, a) = alloc(Config {
            expandable_page_divisor: 128,
            ..fixed_pages(8 * MIB, true)
        });
        a.malloc(3 * MIB, S0).unwrap();
        with_state(&a, |vmm, core, _| {
            assert_eq!(vmm.page_size(core, PoolKind::Small), PAGE);
            assert_eq!(vmm.page_size(core, PoolKind::Large), 8 * MIB);
            // 3 MiB / 128 is less than a granule; 515 MiB / 128 two granules.
            assert_eq!(scaled_granules(core, 4, 0), 1);
            assert_eq!(scaled_granules(core, 4, 512 * MIB), 2);
            assert_eq!(scaled_granules(core, 4, 1 << 30), 4);
        });
    }

    /// While memory grows back after an `empty_cache` that gave pages back,
    /// a range maps its largest pages (`REGROW_PAGE_FACTOR` times
    /// `expandable_page`); before, `expandable_page` (Note [Pages after
    /// empty_cache]).
    #[test]
    fn pages_are_larger_while_memory_grows_back() {
        let (_dev, a) = alloc(Config {
            expandable_regrow_pages: true,
            ..fixed_pages(8 * MIB, true)
        });
        let x = a.malloc(64 * MIB, S0).unwrap();
        a.malloc(2 * MIB, S0).unwrap(); // keeps the range
        let big = |a: &Alloc| {
            with_state(a, |vmm, core, _| {
                let s = core.segment(first_range(vmm, large(0)));
                assert_eq!(s.page_size(), 8 * MIB * REGROW_PAGE_FACTOR);
                vmm.big_granules(core, s, 8 * MIB)
            })
        };
        assert_eq!(big(&a), 4, "expandable_page");
        a.free(x).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(big(&a), 16, "the range's largest page");
    }

    /// The soft and hard limits are the peak allocated bytes times
    /// `1 + idle_slack` and `1 + idle_slack_hard`; without recycling there
    /// are none; a cap bounds what mappings may reach.
    #[test]
    fn limits_follow_the_peak_and_the_cap() {
        let config = Config {
            idle_slack: 0.5,
            idle_slack_hard: 1.0,
            ..fixed_pages(PAGE, true)
        };
        let (_dev, a) = alloc(config.clone());
        a.malloc(64 * MIB, S0).unwrap();
        with_state(&a, |vmm, core, _| {
            let l = vmm.limits(core);
            assert_eq!((l.soft, l.hard, l.cap), (96 * MIB, 128 * MIB, u64::MAX));
            assert!(!vmm.under_pressure(core, 1 << 30));
            core.cap = Some(100 * MIB);
            assert_eq!(vmm.limits(core).cap, 100 * MIB);
            // Within the margin (at most 10%) of the cap: under pressure.
            assert!(!vmm.under_pressure(core, 20 * MIB));
            assert!(vmm.under_pressure(core, 28 * MIB));
        });
        let (_dev, a) = alloc(Config {
            expandable_recycle: false,
            ..config
        });
        a.malloc(64 * MIB, S0).unwrap();
        with_state(&a, |vmm, core, _| {
            let l = vmm.limits(core);
            assert_eq!((l.soft, l.hard), (u64::MAX, u64::MAX));
        });
    }
}
