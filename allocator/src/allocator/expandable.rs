//! Expandable segments on the virtual memory API.
//!
//! Each (stream, pool) gets one large virtual range; blocks tile it as in a
//! plain segment, but physical pages are mapped only under blocks that need
//! them, and reserved bytes are physical bytes. Small-pool pages are the
//! device's granularity (2 MiB on current GPUs); large-pool pages may be a
//! multiple of it (`Config::expandable_page`), which divides the number of
//! map calls at the price of coarser recycling.
//!
//! Pages that lie entirely inside free blocks are idle. A page may be
//! unmapped only when no queued GPU work can still touch it, so recycling
//! waits for the device to be idle; to pay that wait rarely, a recycling
//! round unmaps a batch of idle pages (longest idle first) into a pool of
//! unmapped physical pages, still reserved, which later mappings draw from
//! before they create new pages. A round runs when creating pages would lift
//! reserved memory past `1 + idle_slack` times the peak allocated bytes or
//! past the cap, or when the device is full; `empty_cache` unmaps every idle
//! page and releases the pool.
//!
//! The feature's data is [`Expandable`]; its parts are files of their own:
//! `ranges` (range and page sizes, limits), `map` (mapping a block's pages),
//! `gather` (the physical pages a mapping takes), `idle` (idle pages and
//! `empty_cache`), `marks` (stream markers and quiescence), `fit` (where a
//! block goes), `shadows` and `stale` (old mappings), `reback` and `share`
//! (the last rungs before out of memory), `check` (the invariants).

use crate::block::{PoolKind, SegmentId};
use crate::fasthash::FastMap;

mod check;
mod fit;
mod gather;
mod idle;
mod map;
mod marks;
mod ranges;
mod reback;
mod shadows;
mod share;
mod stale;
#[cfg(test)]
mod testing;

pub(super) use idle::holds_whole_page;
#[cfg(test)]
pub(super) use marks::{MARKER_INTERVAL, MAX_MARKERS};
#[cfg(test)]
pub(super) use ranges::next_range_size;
pub(super) use ranges::scaled_granules;

use marks::Marks;
use stale::StaleMap;

/// The expandable-segment feature's own data: the virtual ranges per pool,
/// markers per stream and the pool of unmapped physical pages (the page
/// granularity and the idle index are the core's: see `Core`).
pub(super) struct Expandable<E> {
    /// Per pool: its expandable segments (virtual ranges), oldest first.
    ranges: Vec<Vec<SegmentId>>,
    /// Device memory in bytes (sizes the expandable ranges and the pressure limit).
    range_size: u64,
    /// Expandable, per stream slot: events recorded as blocks were freed
    /// there; made on a slot's first use (`marks_mut`).
    marks: Vec<Marks<E>>,
    /// The operation count after the last device synchronize: blocks freed
    /// before it are quiescent on every stream, those with no markers yet too.
    synced_before: u64,
    /// Physical pages unmapped but kept (reserved).
    page_pool: Vec<PooledPage>,
    /// Expandable: reserved bytes when the device last had no room for a new page.
    device_full_at: Option<u64>,
    /// Reserved bytes before the last `empty_cache` that gave pages back,
    /// while reserved memory is growing back towards them (Note [Pages
    /// after empty_cache]).
    regrow_to: Option<u64>,
    /// Mappings no block uses, by place (first granule): old mappings of
    /// pages reused early (unmapped once their stream passes a marker) and,
    /// with `expandable_shadows`, of pages moved away (kept until another
    /// page is mapped there).
    stale: StaleMap,
    /// With `expandable_shadows`: where each page mapped in a range is
    /// (its first granule), to find an idle page a shadow asks back.
    mapped_at: FastMap<u64, Place>,
    /// Stream slot where [`Expandable::borrow_fit`]'s next look starts.
    borrow_from: usize,
    /// Pages mapped at several granules (`Config::expandable_share`): page
    /// → the granules it is mapped at, the one that counts it first.
    shared: FastMap<u64, Vec<Place>>,
}

/// A physical page unmapped but kept (reserved) in the pool.
#[derive(Copy, Clone, Debug)]
struct PooledPage {
    handle: u64,
    /// The pool kind its bytes are counted under.
    kind: PoolKind,
    /// Bytes.
    size: u64,
}

/// A place in an expandable range: a segment and a granule of it (a
/// page's first granule where a page is meant), ordered by segment, then
/// granule.
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub(super) struct Place {
    seg: SegmentId,
    /// Granules from the segment's start.
    at: u32,
}

/// Where idle pages are looked for besides the bins: the part of the block
/// being carved that stays free after the split (its tail), and when that
/// block became free. (A free block of the idle index is read as one too.)
#[derive(Copy, Clone, Debug)]
struct Tail {
    seg: SegmentId,
    /// Where the free part starts: the end of the block carved.
    start: u64,
    /// Where the free block being carved ends.
    end: u64,
    /// When the block being carved became free.
    since: u64,
}

impl<E> Expandable<E> {
    /// The feature's state, ranges sized for a device of `range_size` bytes.
    pub(super) fn new(range_size: u64) -> Self {
        Expandable {
            ranges: Vec::new(),
            range_size,
            marks: Vec::new(),
            synced_before: 0,
            page_pool: Vec::new(),
            device_full_at: None,
            regrow_to: None,
            stale: StaleMap::default(),
            mapped_at: FastMap::default(),
            borrow_from: 0,
            shared: FastMap::default(),
        }
    }

    /// The ranges reserved in all, the stream slots that have markers
    /// (made on first use) and the old mappings: what the per-stream cost
    /// tests count.
    #[cfg(test)]
    pub(super) fn per_stream_records(&self) -> (usize, usize, usize) {
        (
            self.ranges.iter().map(Vec::len).sum(),
            self.marks.len(),
            self.stale.values().count(),
        )
    }

    /// Whether pool `i` has expandable segments.
    pub(super) fn has_ranges(&self, i: usize) -> bool {
        self.ranges.get(i).is_some_and(|r| !r.is_empty())
    }

    /// The unmapped physical pages kept, as (pool kind counted under, bytes).
    pub(super) fn pooled_pages(&self) -> impl Iterator<Item = (PoolKind, u64)> + '_ {
        self.page_pool.iter().map(|p| (p.kind, p.size))
    }

    /// Keeps page `handle` of `size` bytes, counted under `kind`, in the
    /// pool of unmapped pages.
    #[inline]
    fn pool_page(&mut self, handle: u64, kind: PoolKind, size: u64) {
        self.page_pool.push(PooledPage { handle, kind, size });
    }

    /// Bytes held in the pool of unmapped pages.
    pub(super) fn pooled_bytes(&self) -> u64 {
        self.page_pool.iter().map(|p| p.size).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::PoolKind;

    /// A pool has ranges from its first request on; the pooled pages are
    /// told by kind and counted in bytes; the records a stream costs are
    /// its ranges and, from its first free, its markers.
    #[test]
    fn the_feature_records_ranges_pages_and_markers() {
        let (_dev, a) = alloc(fixed_pages(PAGE, true));
        let x = a.malloc(PAGE, S0).unwrap();
        with_state(&a, |vmm, _, _| {
            assert!(vmm.has_ranges(large(0).index()));
            assert!(!vmm.has_ranges(large(1).index()), "no second stream");
            assert_eq!(vmm.per_stream_records(), (1, 0, 0));
            vmm.pool_page(7, PoolKind::Small, PAGE);
            vmm.pool_page(8, PoolKind::Large, 2 * PAGE);
            let kinds: Vec<_> = vmm.pooled_pages().collect();
            assert_eq!(
                kinds,
                [(PoolKind::Small, PAGE), (PoolKind::Large, 2 * PAGE)]
            );
            assert_eq!(vmm.pooled_bytes(), 3 * PAGE);
            vmm.page_pool.clear();
        });
        a.free(x).unwrap();
        with_state(&a, |vmm, _, _| {
            assert_eq!(vmm.per_stream_records(), (1, 1, 0), "slot 0's markers");
        });
    }
}
