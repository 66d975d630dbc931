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

use super::Core;
use crate::bins::{Bins, Entry};
use crate::block::{BlockId, BlockState, PoolId, PoolKind, Segment, SegmentId, POOLS_PER_STREAM};
use crate::config::EdgePages;
use crate::device::{Device, DeviceError, DevicePtr, StreamId};
use crate::error::AllocError;
use crate::fasthash::FastMap;
use std::collections::{BTreeMap, VecDeque};

mod reback;
mod share;
mod stale;

use stale::StaleMap;

/// How many times `expandable_page` the pages mapped while memory grows back
/// after `empty_cache` may be (Note [Pages after empty_cache]); a power of
/// two, so that `expandable_page` is one of the range's halvings.
pub(super) const REGROW_PAGE_FACTOR: u64 = 4;

/// Operations (mallocs and frees, all streams) between two marker events
/// recorded on one stream as blocks are freed there.
pub(super) const MARKER_INTERVAL: u64 = 128;
/// Next best fits tried when the best fit lies over an old mapping that queued
/// work may still use, or over unmapped granules (see
/// [`Expandable::near_fit`]).
const AROUND: usize = 4;
/// How much larger than the best fit a near fit over mapped pages may be.
const MAPPED_FIT_FACTOR: u64 = 4;
/// Other streams' pools [`Expandable::borrow_fit`] looks at per request at
/// most (in turn): a program with thousands of streams pays no scan of them all.
const BORROW_POOLS: usize = 8;
/// Marker events outstanding per stream at most: enough to cover a few
/// thousand operations of queued work, so that moving a page waits for the
/// work up to its block's free and no further.
pub(super) const MAX_MARKERS: usize = 64;

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
pub(super) fn range_size(total: u64, page: u64) -> u64 {
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
pub(super) fn next_range_size(
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
fn smaller_page(big: u32) -> u32 {
    if big % 2 == 0 {
        big / 2
    } else {
        1
    }
}

/// A big page of `big` granules, made smaller ([`smaller_page`]) down to
/// the peak allocated bytes (counting `bytes` about to be mapped) over
/// `expandable_page_divisor`.
pub(super) fn scaled_granules<E>(core: &Core<E>, big: u32, bytes: u64) -> u32 {
    scaled_granules_by(core, big, bytes, core.config.expandable_page_divisor)
}

/// [`scaled_granules`] with the divisor given (0: no scaling).
fn scaled_granules_by<E>(core: &Core<E>, mut big: u32, bytes: u64, divisor: u64) -> u32 {
    let g = core.granularity.expect("expandable mode has a granularity");
    let alloc = core.stats.allocated_bytes.all();
    let scale = alloc.peak.max(alloc.current.saturating_add(bytes));
    if let Some(most) = scale.checked_div(divisor) {
        while big > 1 && u64::from(big) * g > most {
            big = smaller_page(big);
        }
    }
    big
}

/// Whether every granule under `[start, end)` of `seg` is mapped.
#[inline]
fn range_mapped<E>(core: &Core<E>, seg: SegmentId, start: u64, end: u64) -> bool {
    let g = core.granularity.expect("expandable mode has a granularity");
    let s = core.segments.get(seg.0);
    let first = ((start - s.addr) / g) as u32;
    let last = (end - s.addr).div_ceil(g) as u32;
    s.pages().expect("expandable").is_mapped(first, last)
}

/// Whether the pages under `rounded` bytes carved at the start of free
/// block `e` are all mapped already (no page would move to serve it).
#[inline]
pub(super) fn carve_mapped<E>(core: &Core<E>, e: Entry, rounded: u64) -> bool {
    range_mapped(
        core,
        core.blocks.get(e.id.0).segment,
        e.addr,
        e.addr + rounded,
    )
}

/// Whether a mapped page lies wholly inside `[start, end)` of `seg` (a free
/// block there holds idle memory).
pub(super) fn holds_whole_page(seg: &Segment, g: u64, start: u64, end: u64) -> bool {
    let Some(pages) = seg.pages() else {
        return false;
    };
    let lo = (start - seg.addr).div_ceil(g) as u32;
    let hi = ((end - seg.addr) / g) as u32;
    hi > lo && pages.within(lo, hi).next().is_some()
}

/// A marker event recorded on a stream: once it completed, the stream's
/// work up to its operation count is done.
struct Marker<E> {
    /// Blocks of the stream freed before this operation count are
    /// quiescent once the event completed.
    before: u64,
    event: E,
}

/// Expandable segments, per stream: marker events recorded on the stream
/// as blocks are freed there, oldest first. Once one completed, pages of
/// blocks freed on the stream before it can be unmapped.
pub(super) struct Marks<E> {
    queue: VecDeque<Marker<E>>,
    /// Blocks of this stream freed before this operation count are quiescent.
    quiescent_before: u64,
    /// Operation count of the last marker recorded.
    last: u64,
}

impl<E> Marks<E> {
    /// Retires the oldest marker if it has completed; whether it had.
    fn retire_front_if_done<D: Device<Event = E>>(&mut self, dev: &D) -> Result<bool, DeviceError> {
        match self.queue.front() {
            Some(m) if dev.event_completed(&m.event)? => {}
            _ => return Ok(false),
        }
        let m = self.queue.pop_front().expect("front exists");
        dev.release_event(m.event);
        self.quiescent_before = self.quiescent_before.max(m.before);
        Ok(true)
    }

    /// Queues event `e`, recorded on the stream at operation count `clock`.
    fn push(&mut self, clock: u64, e: E) {
        self.queue.push_back(Marker {
            before: clock + 1,
            event: e,
        });
        self.last = clock;
    }
}

/// The expandable-segment feature's own data: the virtual ranges per pool,
/// markers per stream and the pool of unmapped physical pages (the page
/// granularity and the idle index are the core's: see [`Core`]).
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

/// A mapping that holds no memory of its own: the old mapping of a page
/// reused early or moved ([`Expandable::stale_mappings`]).
#[derive(Copy, Clone, Debug)]
pub(super) struct OldMapping {
    pub(super) addr: u64,
    pub(super) bytes: u64,
    /// Whether the page is pooled rather than mapped under a block (for a
    /// page with several old mappings, told on its first only).
    pub(super) pooled: bool,
}

/// A mapping of a shared page at a member other than the one that counts
/// it (`Expandable::alias_mappings`): it holds no memory of its own.
#[derive(Copy, Clone, Debug)]
pub(super) struct AliasMapping {
    pub(super) addr: u64,
    pub(super) bytes: u64,
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

/// The old mapping of a page mapped again elsewhere: reused early by a block
/// of the same stream before the stream's queued work was done with it
/// (stream order makes that safe; unmapped once a marker of the stream
/// recorded after `since` completed), or, with `expandable_shadows`, moved
/// away (a *shadow*: kept until its address needs another page, and the
/// page's way back there if it is idle when a block there needs it). The
/// allocator treats the granules as unmapped.
#[derive(Copy, Clone, Debug)]
struct Stale {
    seg: SegmentId,
    /// First granule and length in granules.
    at: u32,
    len: u32,
    handle: u64,
    slot: usize,
    /// When the free block holding the page became free.
    since: u64,
}

/// A page taken out of its page map for `empty_cache`, to be unmapped
/// with the pages beside it ([`Expandable::unmap_runs`]).
struct Unmapping {
    addr: u64,
    size: u64,
    seg: SegmentId,
    at: u32,
    len: u32,
    handle: u64,
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

    /// The markers of stream slot `slot`, made on its first use: a stream
    /// costs the feature nothing until a block of it is freed (a pool's
    /// ranges likewise wait for its first request, `reserve_range`).
    #[inline]
    fn marks_mut(&mut self, slot: usize) -> &mut Marks<E> {
        if slot >= self.marks.len() {
            // As if made with the stream and dropped at each synchronize since.
            let before = self.synced_before;
            self.marks.resize_with(slot + 1, || Marks {
                quiescent_before: before,
                ..Marks::default()
            });
        }
        &mut self.marks[slot]
    }
}

impl<E> Default for Marks<E> {
    fn default() -> Self {
        Marks {
            queue: VecDeque::new(),
            quiescent_before: 0,
            last: 0,
        }
    }
}

/// How a mapping chooses its page sizes (see `map_range`).
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
enum Style {
    /// Big pages, whole ones at the edges too.
    BigEdges,
    /// Big pages wholly under the block, granules at the edges.
    SmallEdges,
    /// Granules only.
    Granules,
}

/// A page to map, planned ([`Expandable::plan`]).
#[derive(Copy, Clone, Debug)]
struct Planned {
    /// Its first granule.
    at: u32,
    /// Granules.
    len: u32,
}

/// Pages of one size a mapping needs ([`Expandable::gather_pages`]).
#[derive(Copy, Clone, Debug)]
struct Need {
    /// Bytes per page.
    size: u64,
    count: usize,
}

/// A physical page in hand while a block's pages are gathered.
#[derive(Copy, Clone)]
pub(super) struct Page {
    handle: u64,
    /// Bytes.
    size: u64,
    /// The pool its bytes are counted under; `None` for a page just created.
    counted_as: Option<PoolKind>,
}

/// Where idle pages are looked for besides the bins: the part of the block
/// being carved that stays free after the split (its tail), and when that
/// block became free. (A free block of the idle index is read as one too.)
#[derive(Copy, Clone, Debug)]
pub(super) struct Tail {
    pub(super) seg: SegmentId,
    /// Where the free part starts: the end of the block carved.
    pub(super) start: u64,
    /// Where the free block being carved ends.
    pub(super) end: u64,
    /// When the block being carved became free.
    pub(super) since: u64,
}

/// Reserved-memory limits of the recycling rounds ([`Expandable::limits`]).
#[derive(Copy, Clone, Debug)]
struct Limits {
    /// Past it, creating pages first takes idle pages no queued work can
    /// touch (`idle_slack` over the peak allocated bytes).
    soft: u64,
    /// Past it, creating pages first waits for idle pages (`idle_slack_hard`).
    hard: u64,
    /// The memory cap, `u64::MAX` for none.
    cap: u64,
}

/// An idle page: when it became idle, where it is, and its free block in
/// the idle index (`None` for the tail of the block being carved).
#[derive(Copy, Clone, Debug)]
struct IdlePage {
    since: u64,
    seg: SegmentId,
    /// Its first granule.
    at: u32,
    block: Option<u32>,
}

impl<E> Expandable<E> {
    /// Page size of the expandable segments of a pool kind: the largest
    /// page a new range of it may map (`Segment::page_size`).
    pub(super) fn page_size(&self, core: &Core<E>, kind: PoolKind) -> u64 {
        let g = core.granularity.expect("expandable mode has a granularity");
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
    fn regrowing(&self, core: &Core<E>, bytes: u64) -> bool {
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
        let g = core.granularity.expect("expandable mode has a granularity");
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
    pub(super) fn reserve_range<D: Device<Event = E>>(
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
            .map(|s| core.segments.get(s.0).size)
            .max()
            .unwrap_or(0);
        let ranges = core.stats.segment.all().current;
        let size = next_range_size(self.range_size, page_size, ranges, largest, rounded);
        let ptr = dev.vmm_reserve(size)?;
        core.stats.num_vmm_reserve += 1;
        let seg = core.add_segment(ptr, size, stream, pool, Some(page_size));
        let head = core.segments.get(seg.0).head;
        core.bins_mut(pool).insert(size, ptr.0, head);
        self.ranges[pool.index()].push(seg);
        Ok(seg)
    }

    /// Reserved-memory limits of the recycling rounds.
    fn limits(&self, core: &Core<E>) -> Limits {
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
            cap: core.cap.unwrap_or(u64::MAX),
        }
    }

    /// Maps every unmapped granule under `[start, tail.start)` of
    /// `tail.seg`, a block carved from a free block whose rest, `tail`,
    /// stays free after the split: pages wholly in the tail count as idle
    /// too.
    ///
    /// Page sizes (`Config::expandable_edges`, docs/POLICY.md): big pages
    /// (`Segment::page_size`) where a whole aligned big page is unmapped and
    /// under the block; at the edges, where a big page would lie only partly
    /// under the block, a whole big page (`Big`, and `Pressure` while there
    /// is room) or granularity-sized pages (`Small`). Under pressure
    /// (reserved memory within `idle_slack_hard` of the cap or of the
    /// device's capacity) `Pressure` maps granularity-sized pages only, and
    /// first unmaps the big page under the block's end if it reaches into the
    /// free rest and no queued work can touch it; where only this mapping
    /// would bring reserved memory there, granules at the edges only.
    pub(super) fn map_range<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        start: u64,
        tail: Tail,
    ) -> Result<(), AllocError> {
        let g = core.granularity.expect("expandable mode has a granularity");
        let (seg, end) = (tail.seg, tail.start);
        if self.regrow_to.is_some_and(|to| core.reserved() >= to) {
            self.regrow_to = None; // grown back: `expandable_page` from here on
        }
        // The hit path: a cached block over mapped pages needs nothing,
        // unless memory is so tight that its end page may be trimmed.
        if range_mapped(core, seg, start, end) && !self.under_pressure(core, 0) {
            return Ok(());
        }
        let mut style = match core.config.expandable_edges {
            EdgePages::Small => Style::SmallEdges,
            EdgePages::Big => Style::BigEdges,
            EdgePages::Pressure => {
                let plan = self.plan(core, seg, start, end, Style::BigEdges);
                let bytes: u64 = plan.iter().map(|p| u64::from(p.len) * g).sum();
                if self.under_pressure(core, 0) {
                    Style::Granules
                } else if self.under_pressure(core, bytes) {
                    // Only this mapping would reach the limit (a large
                    // block): big pages wholly under it waste nothing, so
                    // only its edges take granules. All granules here made
                    // pages of both sizes churn under a cap (gpt2_finetune at
                    // 1.05 × its peak: 45,689 pages created, 101,898 maps;
                    // now 2,479 and 14,716).
                    Style::SmallEdges
                } else {
                    Style::BigEdges
                }
            }
        };
        if style == Style::Granules {
            self.trim_end_page(core, dev, start, tail)?;
        }
        loop {
            let plan = self.plan(core, seg, start, end, style);
            if plan.is_empty() {
                return Ok(());
            }
            match self.map_plan(core, dev, seg, &plan, tail) {
                // Larger pages after `empty_cache` are a saving, not a need:
                // the device refused one, so pages as before.
                Err(AllocError::OutOfMemory(_)) if self.regrow_to.is_some() => {
                    self.regrow_to = None;
                }
                // The device or the cap is full after all: only the granules needed.
                Err(AllocError::OutOfMemory(_))
                    if style != Style::Granules
                        && core.config.expandable_edges == EdgePages::Pressure =>
                {
                    style = Style::Granules;
                    self.trim_end_page(core, dev, start, tail)?;
                }
                r => return r,
            }
        }
    }

    /// Whether mapping `bytes` more would bring reserved memory within
    /// `idle_slack_hard` (at most [`MAX_PRESSURE_MARGIN`]) of the cap, of the
    /// device's total memory, or of the level at which the device was last
    /// found full.
    fn under_pressure(&self, core: &Core<E>, bytes: u64) -> bool {
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

    /// If the big page under the end of the block `[start, tail.start)`
    /// reaches past it into the free `tail`, and no queued work can touch
    /// it, unmaps it into the pool, so that only the granules under the
    /// block get mapped again.
    fn trim_end_page<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        start: u64,
        tail: Tail,
    ) -> Result<(), AllocError> {
        let g = core.granularity.expect("expandable mode has a granularity");
        let Tail {
            seg,
            start: end,
            end: block_end,
            since,
        } = tail;
        let s = core.segments.get(seg.0);
        let base = s.addr;
        let last = (end - base).div_ceil(g) as u32;
        let pages = s.pages().expect("expandable");
        let Some((at, h, n)) = pages.covering(last - 1) else {
            return Ok(());
        };
        let (lo, hi) = (base + u64::from(at) * g, base + u64::from(at + n) * g);
        if n == 1 || hi <= base + u64::from(last) * g || lo < start || hi > block_end {
            return Ok(());
        }
        // Quiescent: freed before a marker of its stream that completed.
        if !self.quiescent(dev, s.pool.stream_slot(), since)? {
            return Ok(());
        }
        let s = core.segments.get_mut(seg.0);
        let pages = s.pages_mut().expect("expandable");
        pages.remove(at);
        if let Err(e) = dev.vmm_unmap(DevicePtr(lo), hi - lo) {
            pages.insert(at, n, h);
            return Err(e.into());
        }
        self.mapped_at.remove(&h);
        self.pool_page(h, s.pool.kind(), hi - lo);
        core.stats.num_unmap += 1;
        Ok(())
    }

    /// The pages to map under `[start, end)` of `seg`: big pages where a whole aligned big page is unmapped and
    /// under the block, granules elsewhere; with `Style::BigEdges`, an
    /// unmapped big page only partly under the block is mapped whole; with
    /// `Style::Granules`, granules only.
    fn plan(
        &self,
        core: &Core<E>,
        seg: SegmentId,
        start: u64,
        end: u64,
        style: Style,
    ) -> Vec<Planned> {
        let g = core.granularity.expect("expandable mode has a granularity");
        let s = core.segments.get(seg.0);
        let pages = s.pages().expect("expandable");
        let big = match style {
            Style::Granules => 1,
            Style::BigEdges | Style::SmallEdges => self.big_granules(core, s, end - start),
        };
        // Growing back after `empty_cache`: the gaps beside big pages take
        // the largest page that fits too (Note [Pages after empty_cache]).
        let regrowing = big > 1 && self.regrowing(core, end - start);
        let limit = (s.size / g) as u32;
        let first = ((start - s.addr) / g) as u32;
        let last = (end - s.addr).div_ceil(g) as u32;
        let mut plan = Vec::new();
        for (mut a, mut b) in pages.gaps(first, last) {
            if style == Style::BigEdges && big > 1 {
                let a0 = a / big * big;
                if pages.is_unmapped(a0, a) {
                    a = a0;
                }
                let b0 = (b.div_ceil(big) * big).min(limit);
                if pages.is_unmapped(b, b0) {
                    b = b0;
                }
            }
            let mut at = a;
            while at < b {
                let mut n = if big > 1 && at % big == 0 && at + big <= b {
                    big
                } else {
                    1
                };
                if n == 1 && regrowing {
                    // The largest halving of the big page that fits here.
                    let mut m = smaller_page(big);
                    while m > 1 && (at % m != 0 || at + m > b) {
                        m = smaller_page(m);
                    }
                    n = m;
                }
                plan.push(Planned { at, len: n });
                at += n;
            }
        }
        plan
    }

    /// Gathers the physical pages for `plan` and maps them.
    fn map_plan<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        seg: SegmentId,
        plan: &[Planned],
        tail: Tail,
    ) -> Result<(), AllocError> {
        let g = core.granularity.expect("expandable mode has a granularity");
        let s = core.segments.get(seg.0);
        let (base, kind) = (s.addr, s.pool.kind());
        let mut need: Vec<Need> = Vec::with_capacity(2);
        for p in plan {
            let size = u64::from(p.len) * g;
            match need.iter_mut().find(|n| n.size == size) {
                Some(n) => n.count += 1,
                None => need.push(Need { size, count: 1 }),
            }
        }
        // Pages whose shadows lie exactly where pages are planned: wanted back.
        let want: Vec<u64> = match core.config.expandable_shadows {
            true => plan
                .iter()
                .filter_map(|p| self.shadow_at(seg, p.at, p.len))
                .collect(),
            false => Vec::new(),
        };
        let mut gathered = Vec::with_capacity(plan.len());
        if let Err(e) = self.gather_pages(core, dev, &need, &want, tail, &mut gathered) {
            self.return_pages(core, dev, gathered)?;
            return Err(e);
        }
        for &Planned { at, len: n } in plan {
            let size = u64::from(n) * g;
            let back = self.shadow_at(seg, at, n);
            let j = gathered
                .iter()
                .rposition(|p| Some(p.handle) == back)
                .or_else(|| gathered.iter().rposition(|p| p.size == size))
                .expect("one page per planned page");
            let page = gathered.swap_remove(j);
            if Some(page.handle) == back {
                // Still mapped there: the shadow becomes the mapping, no call.
                self.stale.remove(&Place { seg, at });
                core.stats.num_pages_revived += 1;
            } else {
                // An old mapping there (the tail of this very block may have
                // given its page up) goes first.
                if let Err(e) = self.clear_stale_in(core, dev, seg, at, at + n) {
                    gathered.push(page);
                    self.return_pages(core, dev, gathered)?;
                    return Err(e);
                }
                let addr = DevicePtr(base + u64::from(at) * g);
                if let Err(e) = dev.vmm_map(addr, page.handle, size) {
                    gathered.push(page);
                    self.return_pages(core, dev, gathered)?;
                    return Err(e.into());
                }
                core.stats.num_map += 1;
            }
            core.segments
                .get_mut(seg.0)
                .pages_mut()
                .expect("expandable")
                .insert(at, n, page.handle);
            if core.config.expandable_shadows {
                self.mapped_at.insert(page.handle, Place { seg, at });
            }
            match page.counted_as {
                None => core.stats.reserved_bytes.increase(kind, size),
                Some(old) => core.stats.reserved_bytes.move_group(old, kind, size),
            }
        }
        Ok(())
    }

    /// Collects physical pages, `count` of each `size` in `need`: from the
    /// pool of unmapped pages first; then, where creating pages would pass
    /// the soft limit or the cap, or the device is full, one recycling
    /// round; then new pages, as far as the cap allows, after giving back
    /// pooled pages of sizes this request cannot use where they are in the way.
    fn gather_pages<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        need: &[Need],
        want: &[u64],
        tail: Tail,
        out: &mut Vec<Page>,
    ) -> Result<(), AllocError> {
        for &h in want {
            self.take_back(core, dev, h, tail)?;
        }

        let Limits {
            soft: soft_limit,
            hard: hard_limit,
            cap,
        } = self.limits(core);
        // 0: nothing recycled yet; 1: quiescent idle pages taken; 2: waited
        // for the device; 3: device full after that, pooled pages given back.
        let mut stage = 0;
        loop {
            // Pooled pages wanted back go first (counted once a round, not per page).
            let mut wanted = match want.is_empty() {
                true => 0,
                false => self
                    .page_pool
                    .iter()
                    .filter(|p| want.contains(&p.handle))
                    .count(),
            };
            let mut grow = 0;
            let mut short = None;
            let mut sizes: Vec<u64> = Vec::with_capacity(need.len());
            for &Need { size, count } in need {
                let mut have = out.iter().filter(|p| p.size == size).count();
                while have < count {
                    let pool = &self.page_pool;
                    let back = match wanted {
                        0 => None,
                        _ => pool
                            .iter()
                            .rposition(|p| p.size == size && want.contains(&p.handle)),
                    };
                    wanted -= usize::from(back.is_some());
                    let i = back.or_else(|| pool.iter().rposition(|p| p.size == size));
                    let Some(i) = i else {
                        break;
                    };
                    let p = self.page_pool.swap_remove(i);
                    out.push(Page {
                        handle: p.handle,
                        size,
                        counted_as: Some(p.kind),
                    });
                    have += 1;
                }
                if have < count {
                    grow += (count - have) as u64 * size;
                    short.get_or_insert((size, count - have));
                    sizes.push(size);
                }
            }
            let Some((size, missing)) = short else {
                return Ok(());
            };
            // Past the soft limit, take idle pages no queued work can touch
            // (free): past the hard limit or the cap, wait for the device.
            if stage < 1 && core.reserved() + grow > soft_limit.min(cap) {
                self.recycle(core, dev, tail, grow, false, &sizes)?;
                stage = 1;
                continue;
            }
            if stage < 2 && core.reserved() + grow > hard_limit.min(cap) {
                // Only the excess over the hard limit must come from idle
                // pages; the rest may be created. A cap above the hard limit
                // never lets more be created: with the excess counted from
                // the cap, one large request lifted reserved memory to the
                // cap for good (gpt2_finetune under a cap of 1.05 × its peak:
                // reserved 1.050 × peak and 39,070 maps; now 1.020 and
                // 14,716, as with no cap). Above the cap (lowered below use),
                // idle pages go back until reserved memory plus the growth
                // fits under it, which may be more than the growth itself.
                let need = core.reserved() + grow;
                let past_hard = need.saturating_sub(hard_limit).min(grow);
                let excess = need.saturating_sub(cap).max(past_hard);
                self.recycle(core, dev, tail, excess, true, &sizes)?;
                stage = 2;
                continue;
            }
            // What is left in the pool is of sizes this request cannot use
            // (it took every page of the sizes it lacks): give back enough of
            // it to stay within the soft limit, the cap, and what the device
            // held when it was last full.
            let room = soft_limit
                .min(cap)
                .min(self.device_full_at.unwrap_or(u64::MAX));
            let over = (core.reserved() + grow).saturating_sub(room);
            if over > 0 {
                self.release_pooled(core, dev, over)?;
            }
            if core.reserved() + grow > cap {
                return Err(AllocError::OutOfMemory(Box::default()));
            }
            // The checks above hold for the whole growth, which only shrinks
            // as pages are made: the missing pages of this size are made in
            // one go (a round per page cost a scan of `out` and the pool
            // each, quadratic in the pages of one request).
            let mut made_bytes = out_new_bytes(out);
            for _ in 0..missing {
                match dev.vmm_create_page(size) {
                    Ok(handle) => {
                        out.push(Page {
                            handle,
                            size,
                            counted_as: None,
                        });
                        made_bytes += size;
                        grow -= size;
                        core.stats.num_page_create += 1;
                        // The device had room for this much after all.
                        let now = core.reserved() + made_bytes;
                        if let Some(full) = self.device_full_at.as_mut() {
                            *full = (*full).max(now);
                        }
                    }
                    Err(DeviceError::OutOfMemory) if stage < 3 => {
                        self.device_full_at = Some(core.reserved() + made_bytes);
                        if stage < 2 {
                            self.recycle(core, dev, tail, grow, true, &sizes)?;
                        }
                        // Device full: pooled pages of other sizes make room.
                        self.release_pooled(core, dev, grow)?;
                        stage = 3;
                        break;
                    }
                    Err(DeviceError::OutOfMemory) => {
                        self.device_full_at = Some(core.reserved() + made_bytes);
                        return Err(AllocError::OutOfMemory(Box::default()));
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }

    /// Releases pooled pages (most recently pooled first) until `bytes` are
    /// given back or the pool is empty. The caller has taken the pages it
    /// can use: what is left is of other sizes.
    fn release_pooled<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        bytes: u64,
    ) -> Result<(), AllocError> {
        let mut freed = 0;
        while freed < bytes {
            let Some(&p) = self.page_pool.last() else {
                break;
            };
            let mut places = self.stale.of_page(p.handle);
            places.sort_unstable();
            self.unmap_stale_keys(core, dev, places)?;
            dev.vmm_release_page(p.handle)?;
            self.page_pool.pop(); // only once released: a failure keeps it pooled
            core.stats.num_page_release += 1;
            core.stats.reserved_bytes.decrease(p.kind, p.size);
            freed += p.size;
        }
        Ok(())
    }

    /// One recycling round: move the pages needed now (`need` bytes) plus
    /// `recycle_batch` of the peak, longest idle first, into the pool, taking
    /// only pages no queued work can touch. With `wait`, if that is not
    /// enough, wait for the streams that freed the next idle pages (their
    /// marker events, oldest first, or an event recorded now) and for blocks
    /// awaiting events, one at a time, until it is: never for the whole device.
    fn recycle<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        tail: Tail,
        need: u64,
        wait: bool,
        sizes: &[u64],
    ) -> Result<(), AllocError> {
        let peak = core.stats.allocated_bytes.all().peak;
        let batch = need.saturating_add((peak as f64 * core.config.recycle_batch) as u64);
        self.retire_stale(core, dev)?;
        // Quiescent pages of the sizes wanted first (one of another size is
        // given back and a new one created, and its pool goes short of it),
        // then of any size.
        let mut got = 0;
        for sizes in [sizes, &[]] {
            if got < batch {
                got +=
                    self.take_idle_pages(core, dev, Some(tail), batch - got, false, None, sizes)?;
            }
        }
        if !wait {
            return Ok(());
        }
        // The stream's own pages serve it in stream order: reused now,
        // their old mappings dropped once the stream is past them.
        let own = Some(core.segments.get(tail.seg.0).pool.stream_slot());
        for sizes in [sizes, &[]] {
            if got < need {
                got +=
                    self.take_idle_pages(core, dev, Some(tail), batch - got, false, own, sizes)?;
            }
        }
        let requester = core.segments.get(tail.seg.0).pool.stream_slot();
        let mut waited_on: Vec<usize> = Vec::new();
        while got < need {
            // The longest idle page that is not quiescent yet: wait for its stream.
            if let Some((since, slot)) = self.oldest_busy_idle(core, dev, tail)? {
                if core.config.expandable_cross_stream
                    && slot != requester
                    && !waited_on.contains(&slot)
                {
                    // On the device: the requesting stream's later work waits
                    // for everything that stream queued so far, and its idle
                    // pages serve the request now.
                    waited_on.push(slot);
                    self.stream_wait(core, dev, slot, requester)?;
                    got += self.take_idle_pages(
                        core,
                        dev,
                        Some(tail),
                        batch - got,
                        false,
                        Some(slot),
                        &[],
                    )?;
                    continue;
                }
                self.wait_quiescent(core, dev, slot, since)?;
            } else if !Self::wait_one_pending(core, dev)? {
                break; // nothing left to wait for
            }
            got += self.take_idle_pages(core, dev, Some(tail), batch - got, false, None, &[])?;
        }
        Ok(())
    }

    /// Records a marker on the stream of `pool` as a block of it is freed:
    /// one per `MARKER_INTERVAL` operations, at most `MAX_MARKERS` outstanding
    /// (the oldest retired first if complete).
    pub(super) fn mark_free<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        pool: PoolId,
    ) {
        let slot = pool.stream_slot();
        let clock = core.clock;
        let m = self.marks_mut(slot);
        if !m.queue.is_empty() && clock < m.last + MARKER_INTERVAL {
            return;
        }
        if m.queue.len() >= MAX_MARKERS && !m.retire_front_if_done(dev).unwrap_or(false) {
            // Asked again only an interval later: a query is a driver call,
            // and a stream far behind would make every free pay one.
            m.last = clock;
            return;
        }
        // (Not behind a CUDA graph capture: the marker would join the graph.)
        let stream = core.stream_list[slot];
        if dev.stream_capturing(stream) {
            return;
        }
        if let Ok(e) = dev.record_event(stream) {
            m.push(clock, e);
            core.stats.num_events_recorded += 1;
        }
    }

    /// Whether a block of stream slot `slot` that became free at `since` is
    /// quiescent (no queued work can touch it), retiring completed markers.
    fn quiescent<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        slot: usize,
        since: u64,
    ) -> Result<bool, AllocError> {
        // A stream without markers yet: quiescent up to the last synchronize
        // (as its markers, made now, would say), and no marker is made for
        // a look.
        let Some(m) = self.marks.get_mut(slot) else {
            return Ok(since < self.synced_before);
        };
        while since >= m.quiescent_before {
            if !m.retire_front_if_done(dev)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Blocks until a block of stream slot `slot` freed at `since` is
    /// quiescent: waits for the stream's markers, oldest first, and if none
    /// recorded after `since` is left, for an event recorded now.
    fn wait_quiescent<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        slot: usize,
        since: u64,
    ) -> Result<(), AllocError> {
        let clock = core.clock;
        let stream = core.stream_list[slot];
        let m = self.marks_mut(slot);
        while since >= m.quiescent_before {
            let marker = match m.queue.pop_front() {
                Some(front) => front,
                None => Marker {
                    before: clock + 1,
                    event: dev.record_event(stream)?,
                },
            };
            let waited = dev.wait_event(&marker.event);
            dev.release_event(marker.event);
            waited?;
            m.quiescent_before = m.quiescent_before.max(marker.before);
            core.stats.num_event_waits += 1;
            core.stats.num_marker_waits += 1;
        }
        Ok(())
    }

    /// Waits for the oldest event guarding a block freed while other streams
    /// used it, and returns the block to the bins if that was its last;
    /// returns whether there was one. (Expandable allocators have no slabs
    /// and always cache: a freed block goes straight to the bins.)
    fn wait_one_pending<D: Device<Event = E>>(
        core: &mut Core<E>,
        dev: &D,
    ) -> Result<bool, AllocError> {
        let Some(i) = core.pending.iter().position(|(_, q)| !q.is_empty()) else {
            return Ok(false);
        };
        let (ev, id) = core.pending[i].1.pop_front().expect("not empty");
        if let Err(e) = dev.wait_event(&ev) {
            core.pending[i].1.push_front((ev, id));
            return Err(e.into());
        }
        dev.release_event(ev);
        core.stats.num_event_waits += 1;
        core.pending.retain(|(_, q)| !q.is_empty());
        if core.event_done(id) {
            let (kind, slab) = core.release_block(id);
            debug_assert!(!slab && core.config.caching);
            core.merge_counted(id, kind);
        }
        Ok(true)
    }

    /// Makes stream slot `waiter` wait on the device for the work stream slot
    /// `slot` queued so far, through an event recorded now that joins the
    /// slot's markers.
    #[cold]
    fn stream_wait<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        slot: usize,
        waiter: usize,
    ) -> Result<(), AllocError> {
        let (from, to) = (core.stream_list[slot], core.stream_list[waiter]);
        if let Some(e) = core.wait_for_stream(dev, from, to, false)? {
            self.marks_mut(slot).push(core.clock, e);
        }
        Ok(())
    }

    /// After a device synchronize every marker has completed.
    fn drop_markers<D: Device<Event = E>>(&mut self, core: &Core<E>, dev: &D) {
        let clock = core.clock;
        self.synced_before = clock + 1;
        for m in &mut self.marks {
            for marker in m.queue.drain(..) {
                dev.release_event(marker.event);
            }
            m.quiescent_before = clock + 1;
        }
    }

    /// Waits for the device, forgets the markers (every stream is past
    /// them) and unmaps every old mapping: what `empty_cache` and the swap
    /// of pinned pages start from.
    fn settle<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
    ) -> Result<(), AllocError> {
        dev.synchronize()?;
        self.drop_markers(core, dev);
        let places = self.stale.places();
        self.unmap_stale_keys(core, dev, places)
    }

    /// Puts gathered pages back after a failure: pooled ones to the pool, new ones to the device.
    fn return_pages<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        pages: Vec<Page>,
    ) -> Result<(), AllocError> {
        let mut result = Ok(());
        for page in pages {
            match page.counted_as {
                Some(kind) => self.pool_page(page.handle, kind, page.size),
                None => {
                    if let Err(e) = dev.vmm_release_page(page.handle) {
                        // Kept (pooled and counted) rather than lost.
                        self.pool_page(page.handle, PoolKind::Large, page.size);
                        core.stats
                            .reserved_bytes
                            .increase(PoolKind::Large, page.size);
                        if result.is_ok() {
                            result = Err(e.into());
                        }
                        continue;
                    }
                    core.stats.num_page_release += 1;
                }
            }
        }
        result
    }

    /// Appends the mappings wholly inside `[start, end)` of `seg` (idle pages
    /// if that is free) to `out`, as [`IdlePage`]s; returns their bytes.
    fn collect_idle(
        &self,
        core: &Core<E>,
        Tail {
            seg,
            start,
            end,
            since,
        }: Tail,
        block: Option<u32>,
        sizes: &[u64],
        out: &mut Vec<IdlePage>,
    ) -> u64 {
        let g = core.granularity.expect("expandable mode has a granularity");
        let s = core.segments.get(seg.0);
        let lo = (start - s.addr).div_ceil(g) as u32;
        let hi = ((end - s.addr) / g) as u32;
        if hi <= lo {
            return 0;
        }
        let pages = s.pages().expect("expandable");
        let mut bytes = 0;
        for (at, _, n) in pages.within(lo, hi) {
            let size = u64::from(n) * g;
            if sizes.is_empty() || sizes.contains(&size) {
                out.push(IdlePage {
                    since,
                    seg,
                    at,
                    block,
                });
                bytes += size;
            }
        }
        bytes
    }

    /// The entry of the idle index after `cursor` (the first with `None`).
    fn next_idle(&self, core: &Core<E>, cursor: Option<(u64, u32)>) -> Option<(u64, u32)> {
        use std::ops::Bound::{Excluded, Unbounded};
        let from = cursor.map_or(Unbounded, Excluded);
        core.idle_index.range((from, Unbounded)).next().copied()
    }

    /// The free block `id` of the idle index as a [`Tail`]-like range.
    fn idle_block(&self, core: &Core<E>, since: u64, id: u32) -> Tail {
        let b = core.blocks.get(id);
        Tail {
            seg: b.segment,
            start: b.addr,
            end: b.addr + b.size,
            since,
        }
    }

    /// The longest idle page's (idle since, stream slot) among pages that
    /// queued work may still touch, if any.
    fn oldest_busy_idle<D: Device<Event = E>>(
        &mut self,
        core: &Core<E>,
        dev: &D,
        tail: Tail,
    ) -> Result<Option<(u64, usize)>, AllocError> {
        let g = core.granularity.expect("expandable mode has a granularity");
        let Tail {
            seg,
            start,
            end,
            since,
        } = tail;
        let mut best: Option<(u64, usize)> = None;
        let s = core.segments.get(seg.0);
        if holds_whole_page(s, g, start, end) {
            let slot = s.pool.stream_slot();
            if !self.quiescent(dev, slot, since)? {
                best = Some((since, slot));
            }
        }
        // The index is in idle order: the first busy entry is the oldest.
        let mut cursor = None;
        while let Some((since, id)) = self.next_idle(core, cursor) {
            cursor = Some((since, id));
            if best.is_some_and(|b| b.0 <= since) {
                break;
            }
            let seg = self.idle_block(core, since, id).seg;
            let slot = core.segments.get(seg.0).pool.stream_slot();
            if !self.quiescent(dev, slot, since)? {
                best = Some((since, slot));
                break;
            }
        }
        Ok(best)
    }

    /// Takes idle pages no queued work can touch (every idle page with
    /// `all`, after the device was synchronized), longest idle first, up to
    /// `max_bytes`, into the pool (they stay reserved); returns how many bytes.
    /// Each is unmapped, or with `expandable_shadows` (and not `all`) keeps
    /// its mapping there as a shadow ([`Stale`]). With `early`, the idle
    /// pages of that stream slot are taken too while its queued work may
    /// still touch them: each keeps its old mapping until the stream is past it.
    /// With `sizes`, only pages of those sizes (all sizes if empty).
    #[allow(clippy::too_many_arguments)]
    fn take_idle_pages<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        extra: Option<Tail>,
        max_bytes: u64,
        all: bool,
        early: Option<usize>,
        sizes: &[u64],
    ) -> Result<u64, AllocError> {
        let g = core.granularity.expect("expandable mode has a granularity");
        let mut idle = Vec::new();
        if let Some(tail) = extra {
            let slot = core.segments.get(tail.seg.0).pool.stream_slot();
            if all || early == Some(slot) || self.quiescent(dev, slot, tail.since)? {
                self.collect_idle(core, tail, None, sizes, &mut idle);
            }
        }
        // Streams found busy in this call (their markers polled once).
        let mut busy: Vec<usize> = Vec::new();
        let mut found = 0;
        let mut cursor = None;
        while found < max_bytes {
            let Some((since, id)) = self.next_idle(core, cursor) else {
                break;
            };
            cursor = Some((since, id));
            let range = self.idle_block(core, since, id);
            let slot = core.segments.get(range.seg.0).pool.stream_slot();
            if !all
                && early != Some(slot)
                && (busy.contains(&slot) || !self.quiescent(dev, slot, since)?)
            {
                if !busy.contains(&slot) {
                    busy.push(slot);
                }
                continue;
            }
            found += self.collect_idle(core, range, Some(id), sizes, &mut idle);
        }
        idle.sort_unstable_by_key(|p| (p.since, std::cmp::Reverse((p.seg, p.at))));
        let mut bytes = 0;
        let mut emptied: Vec<(u64, u32)> = Vec::new();
        let mut failed = None;
        let mut batch: Vec<Unmapping> = Vec::new();
        for IdlePage {
            since,
            seg,
            at,
            block,
        } in idle
        {
            if bytes >= max_bytes {
                break;
            }
            let slot = core.segments.get(seg.0).pool.stream_slot();
            let reused = if !all && early == Some(slot) {
                match self.quiescent(dev, slot, since) {
                    Ok(quiet) => !quiet,
                    Err(e) => {
                        // The pages taken so far stay taken: index them below first.
                        failed = Some(e);
                        break;
                    }
                }
            } else {
                false
            };
            let s = core.segments.get_mut(seg.0);
            let seg_addr = s.addr;
            let pages = s.pages_mut().expect("expandable");
            let (h, n) = pages.remove(at).expect("page was mapped");
            // A page with its fill of shadows leaves none (Note [Shadows per page]).
            let shadow = !all && core.config.expandable_shadows && self.stale.has_room(h);
            let size = u64::from(n) * g;
            self.mapped_at.remove(&h);
            if reused || shadow {
                let st = Stale {
                    seg,
                    at,
                    len: n,
                    handle: h,
                    slot,
                    since,
                };
                self.stale.insert(Place { seg, at }, st);
                core.stats.num_pages_reused_early += u64::from(reused);
            } else if all {
                // Unmapped below, with the pages beside it in one call.
                batch.push(Unmapping {
                    addr: seg_addr + u64::from(at) * g,
                    size,
                    seg,
                    at,
                    len: n,
                    handle: h,
                });
            } else if let Err(e) = dev.vmm_unmap(DevicePtr(seg_addr + u64::from(at) * g), size) {
                pages.insert(at, n, h);
                if core.config.expandable_shadows {
                    self.mapped_at.insert(h, Place { seg, at });
                }
                // The pages unmapped so far stay unmapped: index them below first.
                failed = Some(e.into());
                break;
            } else {
                core.stats.num_unmap += 1;
            }
            let kind = s.pool.kind();
            self.pool_page(h, kind, size);
            bytes += size;
            if let Some(id) = block {
                if emptied.last() != Some(&(since, id)) {
                    emptied.push((since, id));
                }
            }
        }
        if let Err(e) = self.unmap_runs(core, dev, batch, &mut bytes) {
            failed = failed.or(Some(e));
        }
        // Blocks left with no whole page leave the index.
        for (since, id) in emptied {
            let t = self.idle_block(core, since, id);
            if !holds_whole_page(core.segments.get(t.seg.0), g, t.start, t.end) {
                core.idle_index.remove(&(since, id));
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(bytes),
        }
    }

    /// Unmaps the pages of `batch` (already out of their page maps and in
    /// the pool), each run of pages side by side in one segment with one
    /// call: `cuMemUnmap` takes a range of whole mappings, and one call per
    /// run instead of per page is most of what `empty_cache` costs after a
    /// large run. A run the device refuses is tried page by page; a page it
    /// still refuses goes back to its page map, out of the pool, and its
    /// bytes out of `bytes`.
    #[cold]
    fn unmap_runs<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        mut batch: Vec<Unmapping>,
        bytes: &mut u64,
    ) -> Result<(), AllocError> {
        batch.sort_unstable_by_key(|u| u.addr);
        let mut result = Ok(());
        let mut i = 0;
        while i < batch.len() {
            let mut j = i + 1;
            while j < batch.len()
                && batch[j].seg == batch[i].seg
                && batch[j].addr == batch[j - 1].addr + batch[j - 1].size
            {
                j += 1;
            }
            let run = &batch[i..j];
            let len = run.iter().map(|u| u.size).sum();
            if dev.vmm_unmap(DevicePtr(run[0].addr), len).is_ok() {
                core.stats.num_unmap += 1;
            } else {
                for u in run {
                    match dev.vmm_unmap(DevicePtr(u.addr), u.size) {
                        Ok(()) => core.stats.num_unmap += 1,
                        Err(e) => {
                            // Still mapped: back where it was, not pooled.
                            let s = core.segments.get_mut(u.seg.0);
                            s.pages_mut()
                                .expect("expandable")
                                .insert(u.at, u.len, u.handle);
                            if core.config.expandable_shadows {
                                self.mapped_at.insert(
                                    u.handle,
                                    Place {
                                        seg: u.seg,
                                        at: u.at,
                                    },
                                );
                            }
                            self.page_pool.retain(|p| p.handle != u.handle);
                            *bytes -= u.size;
                            if result.is_ok() {
                                result = Err(e.into());
                            }
                        }
                    }
                }
            }
            i = j;
        }
        result
    }

    /// `empty_cache` for expandable segments: once the device is idle, unmap
    /// every idle page and release the whole pool; free the ranges left with
    /// no block and no page.
    pub(super) fn release_expandable<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
    ) -> Result<(), AllocError> {
        self.device_full_at = None;
        let reserved_before = core.reserved();
        self.settle(core, dev)?;
        self.leave_shared(core, dev)?;
        self.take_idle_pages(core, dev, None, u64::MAX, true, None, &[])?;
        if !self.page_pool.is_empty() {
            let peak = core.stats.reserved_bytes.all().peak;
            self.regrow_to = Some(reserved_before.max(peak));
        }
        // (The old mappings went in `settle`: none is left to unmap.)
        self.release_pooled(core, dev, u64::MAX)?;
        for i in 0..self.ranges.len() {
            let mut kept = Vec::with_capacity(self.ranges[i].len());
            for seg in std::mem::take(&mut self.ranges[i]) {
                let s = core.segments.get(seg.0);
                let head = core.blocks.get(s.head.0);
                if head.state != BlockState::Free
                    || head.next.is_some()
                    || !s.pages().is_some_and(|p| p.is_empty())
                {
                    kept.push(seg);
                    continue;
                }
                let (addr, size, pool, head_id, since) =
                    (s.addr, s.size, s.pool, s.head, head.freed_at);
                if let Err(e) = dev.vmm_free_range(DevicePtr(addr), size) {
                    kept.push(seg);
                    self.ranges[i] = kept;
                    return Err(e.into());
                }
                core.unfile_released(pool, size, addr, head_id);
                core.idle_index.remove(&(since, head_id.0));
                core.blocks.discard(head_id.0);
                core.segments.remove(seg.0);
                core.segment_by_addr.remove(&addr);
                core.stats.segment.decrease(pool.kind(), 1);
            }
            self.ranges[i] = kept;
        }
        Ok(())
    }

    /// Checks every expandable segment's page map (mappings of the
    /// granularity or of the segment's page size, inside the range, runs in
    /// step) and that no physical page is mapped twice or both mapped and pooled.
    pub(super) fn check_pages(&self, core: &Core<E>) -> Result<(), String> {
        let Some(g) = core.granularity else {
            return Ok(());
        };
        let mut handles = std::collections::HashSet::new();
        for &PooledPage {
            handle: h, size, ..
        } in &self.page_pool
        {
            if size == 0 || size % g != 0 || !handles.insert(h) {
                return Err(format!(
                    "pooled page {h} of {size} bytes is bad or listed twice"
                ));
            }
        }
        for &seg in self.ranges.iter().flatten() {
            let s = core.segments.get(seg.0);
            let pages = s.pages().ok_or("a range without a page map")?;
            let max = (s.page_size() / g) as u32;
            let sizes: Vec<u32> =
                std::iter::successors(Some(max), |&n| (n > 1).then(|| smaller_page(n))).collect();
            pages
                .check((s.size / g) as u32, &sizes)
                .map_err(|e| format!("range at {:#x}: {e}", s.addr))?;
            for (at, h, _) in pages.within(0, (s.size / g) as u32) {
                // (A shared page counts once, at home: `check_shared`.)
                if !pages.is_alias(at) && !handles.insert(h) {
                    return Err(format!(
                        "page {h} mapped at granule {at} of {:#x} is also mapped or pooled elsewhere",
                        s.addr
                    ));
                }
            }
            // The idle index holds exactly the free blocks with a whole page.
            let mut cur = Some(s.head);
            while let Some(id) = cur {
                let b = core.blocks.get(id.0);
                let idle =
                    b.state == BlockState::Free && holds_whole_page(s, g, b.addr, b.addr + b.size);
                if idle != core.idle_index.contains(&(b.freed_at, id.0)) {
                    return Err(format!(
                        "block at {:#x} (free: {}) is {}in the idle index",
                        b.addr,
                        b.state == BlockState::Free,
                        if idle { "not " } else { "" }
                    ));
                }
                cur = b.next;
            }
        }
        // Old mappings: of a page still held, where nothing else is mapped.
        self.stale.check()?;
        let mut prev: Option<&Stale> = None;
        for st in self.stale.values() {
            let s = core.segments.get(st.seg.0);
            let pages = s.pages().ok_or("an old mapping outside a range")?;
            if !handles.contains(&st.handle)
                || pages.mapped_granules(st.at, st.at + st.len) != 0
                || prev.is_some_and(|p| p.seg == st.seg && p.at + p.len > st.at)
            {
                return Err(format!(
                    "old mapping of page {} at granule {} of {:#x} is of a page not held, over a mapping, or over another",
                    st.handle, st.at, s.addr
                ));
            }
            prev = Some(st);
        }
        if core.config.expandable_shadows {
            let mapped = handles.len() - self.page_pool.len();
            let agree = self.mapped_at.iter().all(|(&h, &Place { seg, at })| {
                let pages = core.segments.get(seg.0).pages();
                pages.and_then(|p| p.covering(at)).map(|(a, hh, _)| (a, hh)) == Some((at, h))
            });
            if self.mapped_at.len() != mapped || !agree {
                return Err(format!(
                    "page locations list {} pages, {mapped} are mapped (agree: {agree})",
                    self.mapped_at.len()
                ));
            }
        }
        self.check_shared(core)?;
        let blocks: usize = self
            .ranges
            .iter()
            .flatten()
            .map(|seg| {
                let mut n = 0;
                let mut cur = Some(core.segments.get(seg.0).head);
                while let Some(id) = cur {
                    let b = core.blocks.get(id.0);
                    n += usize::from(core.idle_index.contains(&(b.freed_at, id.0)));
                    cur = b.next;
                }
                n
            })
            .sum();
        if blocks != core.idle_index.len() {
            return Err(format!(
                "the idle index lists {} entries, {blocks} of them blocks",
                core.idle_index.len()
            ));
        }
        Ok(())
    }

    /// Unmaps the old mappings of pages reused early whose stream is past
    /// them (with `expandable_shadows` they stay, as shadows, but for those
    /// of pages past their fill: Note [Shadows per page]).
    fn retire_stale<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
    ) -> Result<(), AllocError> {
        if core.config.expandable_shadows {
            for k in self.stale.over_limit() {
                let st = self.stale.at(&k);
                if self.quiescent(dev, st.slot, st.since)? {
                    self.unmap_stale(core, dev, k)?;
                }
            }
            return Ok(());
        }
        for k in self.stale.places() {
            let st = self.stale.at(&k);
            if self.quiescent(dev, st.slot, st.since)? {
                self.unmap_stale(core, dev, k)?;
            }
        }
        Ok(())
    }

    /// Unmaps the old mapping at `key` (its stream is past it) and forgets it.
    fn unmap_stale<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        key: Place,
    ) -> Result<(), AllocError> {
        let g = core.granularity.expect("expandable mode has a granularity");
        let st = self.stale.at(&key);
        let addr = core.segments.get(st.seg.0).addr + u64::from(st.at) * g;
        dev.vmm_unmap(DevicePtr(addr), u64::from(st.len) * g)?;
        self.stale.remove(&key);
        core.stats.num_unmap += 1;
        Ok(())
    }

    /// Before granules `first..last` of `seg` are mapped: the old mappings
    /// there go, after their stream's marker if it is not past them yet.
    fn clear_stale_in<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        seg: SegmentId,
        first: u32,
        last: u32,
    ) -> Result<(), AllocError> {
        if self.stale.is_empty() {
            return Ok(());
        }
        let keys: Vec<Place> = self
            .stale_in(core, seg, first, last)
            .map(|st| Place {
                seg: st.seg,
                at: st.at,
            })
            .collect();
        self.unmap_stale_keys(core, dev, keys)
    }

    /// The old mappings of `seg` that overlap granules `first..last`.
    fn stale_in(
        &self,
        core: &Core<E>,
        seg: SegmentId,
        first: u32,
        last: u32,
    ) -> impl Iterator<Item = &Stale> + '_ {
        // A mapping is at most a big page long: one starting that far back may reach in.
        let g = core.granularity.expect("expandable mode has a granularity");
        let back = (core.segments.get(seg.0).page_size() / g) as u32;
        let from = Place {
            seg,
            at: first.saturating_sub(back.saturating_sub(1)),
        };
        self.stale
            .range(from..Place { seg, at: last })
            .map(|(_, st)| st)
            .filter(move |st| st.at + st.len > first)
    }

    /// Unmaps the old mappings at `keys`, each after its stream's marker.
    fn unmap_stale_keys<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        keys: Vec<Place>,
    ) -> Result<(), AllocError> {
        for k in keys {
            let st = self.stale.at(&k);
            self.wait_quiescent(core, dev, st.slot, st.since)?;
            self.unmap_stale(core, dev, k)?;
        }
        Ok(())
    }

    /// The free block to carve `rounded` bytes from: the best fit `fit`,
    /// unless its pages are not all mapped where the block would lie; then
    /// the first of the next [`AROUND`] best fits, up to [`MAPPED_FIT_FACTOR`]
    /// times `fit`'s size, whose pages are, so that no page moves (corpus
    /// replay: 17% fewer map calls and 14% fewer marker waits, reserved /
    /// allocated unchanged in geometric mean). Failing that, `fit` itself,
    /// unless mapping its pages would first need an old mapping there
    /// unmapped that queued work may still use (its page was reused early
    /// elsewhere), which is a host wait for the stream; then the first of
    /// the next [`AROUND`] best fits, up to twice `fit`'s size, that needs
    /// no such wait. Replayed with a device 500 operations behind the host
    /// (`--gpu-lag 500`) the latter halves gpt2_finetune's waited-out device work.
    /// Also says whether the block's pages are all mapped already.
    #[inline]
    pub(super) fn near_fit<D: Device<Event = E>>(
        &mut self,
        core: &Core<E>,
        dev: &D,
        bins: &Bins,
        fit: Entry,
        rounded: u64,
    ) -> Result<(Entry, bool), AllocError> {
        if carve_mapped(core, fit, rounded) {
            return Ok((fit, true));
        }
        if let Some(mapped) = Self::next_mapped_fit(core, bins, fit, rounded) {
            return Ok((mapped, true));
        }
        if self.stale.is_empty() || !self.old_mapping_busy(core, dev, fit, rounded)? {
            return Ok((fit, false));
        }
        Ok((
            self.next_fit_without_wait(core, dev, bins, fit, rounded)?,
            false,
        ))
    }

    /// [`Expandable::near_fit`]'s search for a near fit over mapped pages.
    #[cold]
    fn next_mapped_fit(core: &Core<E>, bins: &Bins, fit: Entry, rounded: u64) -> Option<Entry> {
        bins.iter_from(rounded)
            .filter(|&e| e != fit)
            .take(AROUND)
            .take_while(|e| e.size <= fit.size.saturating_mul(MAPPED_FIT_FACTOR))
            .find(|&e| carve_mapped(core, e, rounded))
    }

    /// Another stream's free block of `pool`'s kind to carve `rounded` bytes
    /// from with no page moved (`Config::expandable_borrow`): over mapped
    /// pages, among each other pool's first [`AROUND`] fits up to
    /// [`MAPPED_FIT_FACTOR`] times `rounded`. The smallest one freed before
    /// its stream's last completed marker (no queued work there can touch
    /// it); failing that, with `expandable_cross_stream`, the smallest one
    /// its stream may still use, once the requesting stream is made to wait
    /// for that stream's work on the device.
    #[cold]
    pub(super) fn borrow_fit<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        pool: PoolId,
        rounded: u64,
    ) -> Result<Option<Entry>, AllocError> {
        let mut best: Option<Entry> = None;
        let mut busy: Option<(Entry, usize)> = None;
        let waits = core.config.expandable_cross_stream;
        let bound = rounded.saturating_mul(MAPPED_FIT_FACTOR);
        let streams = core.bins.len() / POOLS_PER_STREAM as usize;
        let looks = (streams - 1).min(BORROW_POOLS);
        let first = self.borrow_from % streams;
        self.borrow_from = first + looks;
        for slot in (first..first + looks + 1).map(|s| s % streams) {
            if slot == pool.stream_slot() {
                continue;
            }
            let other = PoolId::new(slot as u32, pool.kind());
            let bins = &core.bins[other.index()];
            // (Blocks above `bound` end the look: the walk stops before them.)
            for e in bins.iter_between(rounded, bound).take(AROUND) {
                if best.is_some_and(|b| b.size <= e.size) {
                    break;
                }
                let since = core.blocks.get(e.id.0).freed_at;
                if carve_mapped(core, e, rounded) {
                    if self.quiescent(dev, slot, since)? {
                        best = Some(e);
                        break;
                    }
                    if waits
                        && busy.map_or(true, |(b, _)| e.size < b.size)
                        && !dev.stream_capturing(core.stream_list[slot])
                    {
                        busy = Some((e, slot));
                    }
                }
            }
        }
        if best.is_none() {
            if let Some((e, slot)) = busy {
                self.stream_wait(core, dev, slot, pool.stream_slot())?;
                best = Some(e);
            }
        }
        Ok(best)
    }

    /// [`Expandable::near_fit`]'s slow path: the near fits without a wait.
    #[cold]
    fn next_fit_without_wait<D: Device<Event = E>>(
        &mut self,
        core: &Core<E>,
        dev: &D,
        bins: &Bins,
        fit: Entry,
        rounded: u64,
    ) -> Result<Entry, AllocError> {
        let next: Vec<Entry> = bins
            .iter_from(rounded)
            .filter(|&e| e != fit)
            .take(AROUND)
            .take_while(|e| e.size <= fit.size.saturating_mul(2))
            .collect();
        for alt in next {
            if !self.old_mapping_busy(core, dev, alt, rounded)? {
                return Ok(alt);
            }
        }
        Ok(fit)
    }

    /// Whether carving `rounded` bytes at the start of free block `fit` would
    /// map over an old mapping that queued work may still use (a wait).
    fn old_mapping_busy<D: Device<Event = E>>(
        &mut self,
        core: &Core<E>,
        dev: &D,
        fit: Entry,
        rounded: u64,
    ) -> Result<bool, AllocError> {
        if self.stale.is_empty() {
            return Ok(false);
        }
        let g = core.granularity.expect("expandable mode has a granularity");
        let b = core.blocks.get(fit.id.0);
        let s = core.segments.get(b.segment.0);
        // Whole big pages may be mapped at the block's edges: look that far.
        let big = self.big_granules(core, s, rounded);
        let first = ((fit.addr - s.addr) / g) as u32 / big * big;
        let last = ((fit.addr + rounded - s.addr).div_ceil(g) as u32).div_ceil(big) * big;
        let hits: Vec<(usize, u64)> = self
            .stale_in(core, b.segment, first, last)
            .map(|st| (st.slot, st.since))
            .collect();
        for (slot, since) in hits {
            if !self.quiescent(dev, slot, since)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The page whose shadow covers exactly granules `at..at + n` of `seg`.
    fn shadow_at(&self, seg: SegmentId, at: u32, n: u32) -> Option<u64> {
        self.stale
            .get(&Place { seg, at })
            .filter(|st| st.len == n)
            .map(|st| st.handle)
    }

    /// Puts page `handle` in the pool if it lies idle in a free block and no
    /// queued work can touch it (or it is the requesting stream's, with
    /// early reuse), its mapping there left as a shadow: no driver call. The
    /// block being carved is out of the bins meanwhile, so its pages stay.
    fn take_back<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        handle: u64,
        tail: Tail,
    ) -> Result<(), AllocError> {
        let Some(&Place { seg, at }) = self.mapped_at.get(&handle) else {
            return Ok(()); // pooled already
        };
        let g = core.granularity.expect("expandable mode has a granularity");
        let s = core.segments.get(seg.0);
        let Some((_, _, n)) = s.pages().expect("expandable").covering(at) else {
            return Ok(());
        };
        let (lo, hi) = (s.addr + u64::from(at) * g, s.addr + u64::from(at + n) * g);
        // Idle: wholly inside a free block of the idle index (free, in the
        // bins, holding a whole page), which holds far fewer blocks than the
        // range's list.
        let found = core.idle_index.iter().find(|&&(_, raw)| {
            let b = core.blocks.get(raw);
            b.segment == seg && b.addr <= lo && hi <= b.addr + b.size
        });
        let Some(&(since, raw)) = found else {
            return Ok(()); // under a live block, shared with one, or awaiting events
        };
        let id = BlockId(raw);
        let slot = s.pool.stream_slot();
        let requester = core.segments.get(tail.seg.0).pool.stream_slot();
        let quiet = self.quiescent(dev, slot, since)?;
        let early = slot == requester;
        if !(quiet || early) {
            return Ok(());
        }
        let s = core.segments.get_mut(seg.0);
        let kind = s.pool.kind();
        s.pages_mut().expect("expandable").remove(at);
        self.mapped_at.remove(&handle);
        let st = Stale {
            seg,
            at,
            len: n,
            handle,
            slot,
            since,
        };
        self.stale.insert(Place { seg, at }, st);
        core.stats.num_pages_reused_early += u64::from(!quiet);
        self.pool_page(handle, kind, u64::from(n) * g);
        let b = core.blocks.get(id.0);
        if !holds_whole_page(core.segments.get(seg.0), g, b.addr, b.addr + b.size) {
            core.idle_index.remove(&(since, id.0));
        }
        Ok(())
    }

    /// The old mappings of pages reused early, not yet unmapped.
    pub(super) fn stale_mappings(&self, core: &Core<E>) -> Vec<OldMapping> {
        let Some(g) = core.granularity else {
            return Vec::new();
        };
        // A page reused early twice has two old mappings: it counts as pooled once.
        let stale: Vec<&Stale> = self.stale.values().collect();
        stale
            .iter()
            .enumerate()
            .map(|(i, st)| {
                let addr = core.segments.get(st.seg.0).addr + u64::from(st.at) * g;
                let pooled = self.page_pool.iter().any(|p| p.handle == st.handle)
                    && !stale[..i].iter().any(|o| o.handle == st.handle);
                OldMapping {
                    addr,
                    bytes: u64::from(st.len) * g,
                    pooled,
                }
            })
            .collect()
    }

    /// Bytes held in the pool of unmapped pages.
    pub(super) fn pooled_bytes(&self) -> u64 {
        self.page_pool.iter().map(|p| p.size).sum()
    }
}

/// Bytes of the pages in `out` created for the request under way (not yet counted as reserved).
fn out_new_bytes(out: &[Page]) -> u64 {
    out.iter()
        .filter(|p| p.counted_as.is_none())
        .map(|p| p.size)
        .sum()
}
