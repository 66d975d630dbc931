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

use super::State;
use crate::block::{BlockId, BlockState, PoolId, PoolKind, Segment, SegmentId};
use crate::config::EdgePages;
use crate::device::{Device, DeviceError, DevicePtr, StreamId};
use crate::error::AllocError;

/// Operations between two markers (see `maybe_record_marker`).
const MARKER_INTERVAL: u64 = 128;
/// Markers outstanding at most: enough to cover a few thousand operations
/// of queued work, so that a recycling round can wait for the work up to a
/// page's free and no further.
const MAX_MARKERS: usize = 64;

/// Largest virtual range reserved per (stream, pool): 256 GiB.
const MAX_RANGE: u64 = 1 << 38;

/// Virtual bytes reserved per expandable segment, per byte of device memory.
/// Address space is cheap and holes in it cost no memory once their pages
/// move, but a range only as large as the device would run out of address
/// space before the device runs out of memory.
const RANGE_PER_DEVICE_BYTE: u64 = 2;

/// The size of the virtual range of each expandable segment on a device of `total` bytes.
pub(super) fn range_size(total: u64, page: u64) -> u64 {
    total
        .saturating_mul(RANGE_PER_DEVICE_BYTE)
        .min(MAX_RANGE)
        .div_ceil(page)
        .max(1)
        * page
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
/// being carved that stays free after the split.
/// (segment, start, end, idle since): the part of the block being carved
/// that stays free after the split, and when that block became free.
type Tail = (SegmentId, u64, u64, u64);

impl<E> State<E> {
    /// Page size of the expandable segments of a pool kind.
    pub(super) fn page_size(&self, kind: PoolKind) -> u64 {
        let g = self.granularity.expect("expandable mode has a granularity");
        match kind {
            PoolKind::Small => g,
            PoolKind::Large | PoolKind::Huge => self.config.expandable_page.div_ceil(g).max(1) * g,
        }
    }

    /// Finds (reserving on first use) the range of `pool` and takes a block of
    /// `rounded` bytes from it, its pages mapped.
    pub(super) fn malloc_expandable<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        pool: PoolId,
        stream: StreamId,
        size: u64,
        rounded: u64,
    ) -> Result<BlockId, AllocError> {
        self.maybe_record_marker(dev);
        let seg = match self.ranges[pool.index()] {
            Some(seg) => seg,
            None => match self.reserve_range(dev, pool, stream) {
                Ok(seg) => seg,
                // Out of address space: release the ranges (and pages) the
                // cache can spare, then try once more before out-of-memory.
                Err(AllocError::Device(DeviceError::OutOfMemory)) => {
                    self.stats.num_alloc_retries += 1;
                    self.release_cached(dev)?;
                    match self.reserve_range(dev, pool, stream) {
                        Ok(seg) => seg,
                        Err(AllocError::Device(DeviceError::OutOfMemory)) => {
                            self.stats.num_ooms += 1;
                            return Err(AllocError::OutOfMemory(Box::new(
                                self.oom_report(dev, size, rounded),
                            )));
                        }
                        Err(e) => return Err(e),
                    }
                }
                Err(e) => return Err(e),
            },
        };
        for attempt in 0..2 {
            if attempt == 1 {
                // Last rung: wait for every pending event, so that blocks other
                // streams held become free and their pages idle, then retry.
                self.stats.num_alloc_retries += 1;
                self.wait_all_events(dev)?;
            }
            let pick = self.bins[pool.index()]
                .as_ref()
                .and_then(|b| b.best_fit(rounded));
            let Some((bsize, addr, id)) = pick else {
                continue;
            };
            // While its pages are gathered the block is out of the bins (so not
            // idle) and marked in use (so a block freed meanwhile does not merge it).
            self.bins_mut(pool).remove(bsize, addr, id);
            let b = self.blocks.get_mut(id.0);
            b.state = BlockState::Allocated;
            let since = b.freed_at;
            let mapped = self.map_range(dev, seg, addr, addr + rounded, (addr + bsize, since));
            if mapped.is_ok() {
                return Ok(id);
            }
            // Back to the bins, merged with any neighbour a recycling round freed meanwhile.
            self.blocks.get_mut(id.0).state = BlockState::Free;
            self.merge_into_bins(id);
            if let Err(e) = mapped {
                if !matches!(e, AllocError::OutOfMemory(_)) {
                    return Err(e);
                }
            }
        }
        self.stats.num_ooms += 1;
        Err(AllocError::OutOfMemory(Box::new(
            self.oom_report(dev, size, rounded),
        )))
    }

    fn reserve_range<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        pool: PoolId,
        stream: StreamId,
    ) -> Result<SegmentId, AllocError> {
        let page_size = self.page_size(pool.kind());
        let size = range_size(self.range_size, page_size);
        let ptr = dev.vmm_reserve(size)?;
        self.stats.num_vmm_reserve += 1;
        let seg = self.add_segment(ptr, size, stream, pool, Some(page_size));
        let head = self.segments.get(seg.0).head;
        self.bins_mut(pool).insert(size, ptr.0, head);
        self.ranges[pool.index()] = Some(seg);
        Ok(seg)
    }

    /// Reserved-memory limits of the recycling rounds: (soft, hard, cap).
    fn limits(&self) -> (u64, u64, u64) {
        let peak = self.stats.allocated_bytes.all().peak as f64;
        let (soft, hard) = if self.config.release_before_grow {
            let soft = (peak * (1.0 + self.config.idle_slack)) as u64;
            (
                soft,
                soft.max((peak * (1.0 + self.config.idle_slack_hard)) as u64),
            )
        } else {
            (u64::MAX, u64::MAX)
        };
        (soft, hard, self.cap.unwrap_or(u64::MAX))
    }

    /// Maps every unmapped granule under `[start, end)` of `seg`. The block
    /// being carved ends at `block_end` and became free at `since`: pages
    /// wholly in `[end, block_end)` stay free after the split, so they count
    /// as idle too.
    ///
    /// Page sizes (`Config::expandable_edges`, docs/POLICY.md): big pages
    /// (`Segment::page_size`) where a whole aligned big page is unmapped and
    /// under the block; at the edges, where a big page would lie only partly
    /// under the block, a whole big page (`Big`, and `Pressure` while there
    /// is room) or granularity-sized pages (`Small`). Under pressure (the
    /// mapping would bring reserved memory within `idle_slack_hard` of the
    /// cap or of the device's capacity) `Pressure` maps granularity-sized pages
    /// only, and first unmaps the big page under the block's end if it
    /// reaches into the free rest and no queued work can touch it.
    fn map_range<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        seg: SegmentId,
        start: u64,
        end: u64,
        (block_end, since): (u64, u64),
    ) -> Result<(), AllocError> {
        let g = self.granularity.expect("expandable mode has a granularity");
        let tail = (seg, end, block_end, since);
        let mut style = match self.config.expandable_edges {
            EdgePages::Small => Style::SmallEdges,
            EdgePages::Big => Style::BigEdges,
            EdgePages::Pressure => {
                let plan = self.plan(seg, start, end, Style::BigEdges);
                let bytes: u64 = plan.iter().map(|&(_, n)| u64::from(n) * g).sum();
                if self.under_pressure(bytes) {
                    Style::Granules
                } else {
                    Style::BigEdges
                }
            }
        };
        if style == Style::Granules {
            self.trim_end_page(dev, seg, start, end, (block_end, since))?;
        }
        loop {
            let plan = self.plan(seg, start, end, style);
            if plan.is_empty() {
                return Ok(());
            }
            match self.map_plan(dev, seg, &plan, tail) {
                // The device or the cap is full after all: only the granules needed.
                Err(AllocError::OutOfMemory(_))
                    if style == Style::BigEdges
                        && self.config.expandable_edges == EdgePages::Pressure =>
                {
                    style = Style::Granules;
                    self.trim_end_page(dev, seg, start, end, (block_end, since))?;
                }
                r => return r,
            }
        }
    }

    /// Whether mapping `bytes` more would bring reserved memory within
    /// `idle_slack_hard` of the cap, of the device's total memory, or of the
    /// level at which the device was last found full.
    fn under_pressure(&self, bytes: u64) -> bool {
        let (_, _, cap) = self.limits();
        let limit = cap
            .min(self.device_full_at.unwrap_or(u64::MAX))
            .min(self.range_size);
        let limit = (limit as f64 * (1.0 - self.config.idle_slack_hard).max(0.0)) as u64;
        self.reserved() + bytes > limit
    }

    /// If the big page under the block's end reaches past it into the free
    /// rest of the block being carved (which became free at `since`), and no
    /// queued work can touch it, unmaps it into the pool, so that only the
    /// granules under the block get mapped again.
    fn trim_end_page<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        seg: SegmentId,
        start: u64,
        end: u64,
        (block_end, since): (u64, u64),
    ) -> Result<(), AllocError> {
        let g = self.granularity.expect("expandable mode has a granularity");
        let s = self.segments.get(seg.0);
        let base = s.addr;
        let last = (end - base).div_ceil(g) as u32;
        let pages = s.pages.as_ref().expect("expandable");
        let Some((at, h, n)) = pages.covering(last - 1) else {
            return Ok(());
        };
        let (lo, hi) = (base + u64::from(at) * g, base + u64::from(at + n) * g);
        if n == 1 || hi <= base + u64::from(last) * g || lo < start || hi > block_end {
            return Ok(());
        }
        // Quiescent: freed before a marker whose events completed.
        if since >= self.quiescent_before && since >= self.poll_markers(dev)? {
            return Ok(());
        }
        let s = self.segments.get_mut(seg.0);
        let pages = s.pages.as_mut().expect("expandable");
        pages.remove(at);
        if let Err(e) = dev.vmm_unmap(DevicePtr(lo), hi - lo) {
            pages.insert(at, n, h);
            return Err(e.into());
        }
        self.page_pool.push((h, s.pool.kind(), hi - lo));
        self.stats.num_unmap += 1;
        Ok(())
    }

    /// The pages to map under `[start, end)` of `seg`, as (first granule,
    /// granules): big pages where a whole aligned big page is unmapped and
    /// under the block, granules elsewhere; with `Style::BigEdges`, an
    /// unmapped big page only partly under the block is mapped whole; with
    /// `Style::Granules`, granules only.
    fn plan(&self, seg: SegmentId, start: u64, end: u64, style: Style) -> Vec<(u32, u32)> {
        let g = self.granularity.expect("expandable mode has a granularity");
        let s = self.segments.get(seg.0);
        let pages = s.pages.as_ref().expect("expandable");
        let big = match style {
            Style::Granules => 1,
            Style::BigEdges | Style::SmallEdges => (s.page_size / g) as u32,
        };
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
                let n = if big > 1 && at % big == 0 && at + big <= b {
                    big
                } else {
                    1
                };
                plan.push((at, n));
                at += n;
            }
        }
        plan
    }

    /// Gathers the physical pages for `plan` and maps them.
    fn map_plan<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        seg: SegmentId,
        plan: &[(u32, u32)],
        tail: Tail,
    ) -> Result<(), AllocError> {
        let g = self.granularity.expect("expandable mode has a granularity");
        let s = self.segments.get(seg.0);
        let (base, kind) = (s.addr, s.pool.kind());
        let mut need: Vec<(u64, usize)> = Vec::with_capacity(2);
        for &(_, n) in plan {
            let size = u64::from(n) * g;
            match need.iter_mut().find(|(s, _)| *s == size) {
                Some((_, c)) => *c += 1,
                None => need.push((size, 1)),
            }
        }
        let mut gathered = Vec::with_capacity(plan.len());
        if let Err(e) = self.gather_pages(dev, &need, tail, &mut gathered) {
            self.return_pages(dev, gathered)?;
            return Err(e);
        }
        for &(at, n) in plan {
            let size = u64::from(n) * g;
            let j = gathered
                .iter()
                .rposition(|p| p.size == size)
                .expect("one page per planned page");
            let page = gathered.swap_remove(j);
            if let Err(e) = dev.vmm_map(DevicePtr(base + u64::from(at) * g), page.handle, size) {
                gathered.push(page);
                self.return_pages(dev, gathered)?;
                return Err(e.into());
            }
            self.segments
                .get_mut(seg.0)
                .pages
                .as_mut()
                .expect("expandable")
                .insert(at, n, page.handle);
            self.stats.num_map += 1;
            match page.counted_as {
                None => self.stats.reserved_bytes.increase(kind, size),
                Some(old) => self.stats.reserved_bytes.move_group(old, kind, size),
            }
        }
        self.high_water = self.high_water.max(self.reserved());
        Ok(())
    }

    /// Collects physical pages, `count` of each `size` in `need`: from the
    /// pool of unmapped pages first; then, where creating pages would pass
    /// the soft limit or the cap, or the device is full, one recycling
    /// round; then new pages, as far as the cap allows, after giving back
    /// pooled pages of sizes this request cannot use where they are in the way.
    fn gather_pages<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        need: &[(u64, usize)],
        tail: Tail,
        out: &mut Vec<Page>,
    ) -> Result<(), AllocError> {
        let (soft_limit, hard_limit, cap) = self.limits();
        // 0: nothing recycled yet; 1: quiescent idle pages taken; 2: waited
        // for the device; 3: device full after that, pooled pages given back.
        let mut stage = 0;
        loop {
            let mut grow = 0;
            let mut short = None;
            for &(size, count) in need {
                let mut have = out.iter().filter(|p| p.size == size).count();
                while have < count {
                    let Some(i) = self.page_pool.iter().rposition(|p| p.2 == size) else {
                        break;
                    };
                    let (handle, kind, _) = self.page_pool.swap_remove(i);
                    out.push(Page {
                        handle,
                        size,
                        counted_as: Some(kind),
                    });
                    have += 1;
                }
                if have < count {
                    grow += (count - have) as u64 * size;
                    short.get_or_insert(size);
                }
            }
            let Some(size) = short else {
                return Ok(());
            };
            // Past the soft limit, take idle pages no queued work can touch
            // (free): past the hard limit or the cap, wait for the device.
            if stage < 1 && self.reserved() + grow > soft_limit.min(cap) {
                self.recycle(dev, tail, grow, false)?;
                stage = 1;
                continue;
            }
            if stage < 2 && self.reserved() + grow > hard_limit.min(cap) {
                // Only the excess must come from idle pages; the rest may be created.
                let excess = (self.reserved() + grow - hard_limit.min(cap)).min(grow);
                self.recycle(dev, tail, excess, true)?;
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
            let over = (self.reserved() + grow).saturating_sub(room);
            if over > 0 {
                self.release_pooled(dev, over)?;
            }
            if self.reserved() + grow > cap {
                return Err(AllocError::OutOfMemory(Box::default()));
            }
            match dev.vmm_create_page(size) {
                Ok(handle) => {
                    out.push(Page {
                        handle,
                        size,
                        counted_as: None,
                    });
                    self.stats.num_page_create += 1;
                    // The device had room for this much after all.
                    let now = self.reserved() + out_new_bytes(out);
                    if let Some(full) = self.device_full_at.as_mut() {
                        *full = (*full).max(now);
                    }
                }
                Err(DeviceError::OutOfMemory) if stage < 3 => {
                    self.device_full_at = Some(self.reserved() + out_new_bytes(out));
                    if stage < 2 {
                        self.recycle(dev, tail, grow, true)?;
                    }
                    // Device full: pooled pages of other sizes make room.
                    self.release_pooled(dev, grow)?;
                    stage = 3;
                }
                Err(DeviceError::OutOfMemory) => {
                    self.device_full_at = Some(self.reserved() + out_new_bytes(out));
                    return Err(AllocError::OutOfMemory(Box::default()));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Releases pooled pages (most recently pooled first) until `bytes` are
    /// given back or the pool is empty. The caller has taken the pages it
    /// can use: what is left is of other sizes.
    fn release_pooled<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        bytes: u64,
    ) -> Result<(), AllocError> {
        let mut freed = 0;
        while freed < bytes {
            let Some(&(h, kind, size)) = self.page_pool.last() else {
                break;
            };
            dev.vmm_release_page(h)?;
            self.page_pool.pop(); // only once released: a failure keeps it pooled
            self.stats.num_page_release += 1;
            self.stats.reserved_bytes.decrease(kind, size);
            freed += size;
        }
        Ok(())
    }

    /// One recycling round: wait until the device is idle, recycle blocks
    /// whose events completed, and unmap the pages needed now (`need` bytes)
    /// plus `recycle_batch` of the peak, longest idle first, into the pool.
    fn recycle<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        tail: Tail,
        need: u64,
        wait: bool,
    ) -> Result<(), AllocError> {
        if self.pending_blocks == 0
            && self.idle_pages(Some(tail)).is_empty()
            && self.page_pool.is_empty()
        {
            return Ok(()); // nothing to gain
        }
        let peak = self.stats.allocated_bytes.all().peak;
        let batch = need.saturating_add((peak as f64 * self.config.recycle_batch) as u64);
        // Pages freed before a completed marker are quiescent: no wait needed.
        let quiescent = self.poll_markers(dev)?;
        let got = self.unmap_idle_pages(dev, Some(tail), batch, quiescent)?;
        if !(wait && got < need && self.waiting_helps(tail, quiescent)) {
            return Ok(());
        }
        // Wait for the markers, oldest first, before the whole device: the
        // work queued after a marker keeps the device busy while pages move,
        // where a synchronize drains the queue the host had run ahead with.
        let mut got = got;
        while got < need {
            let Some((clock, events)) = self.markers.pop_front() else {
                break;
            };
            let waited = events.iter().try_for_each(|e| dev.wait_event(e));
            events.into_iter().for_each(|e| dev.release_event(e));
            waited?;
            self.stats.num_marker_waits += 1;
            self.quiescent_before = clock;
            self.process_events(dev)?;
            got += self.unmap_idle_pages(dev, Some(tail), batch - got, clock)?;
        }
        if got < need && self.waiting_helps(tail, self.quiescent_before) {
            dev.synchronize()?;
            self.stats.num_sync_all_streams += 1;
            self.drop_markers(dev);
            self.process_events(dev)?;
            self.unmap_idle_pages(dev, Some(tail), batch - got, u64::MAX)?;
        }
        Ok(())
    }

    /// Whether waiting for the device could free pages: blocks await
    /// events, or idle pages were freed at or after `quiescent`.
    fn waiting_helps(&self, tail: Tail, quiescent: u64) -> bool {
        self.pending_blocks > 0
            || self
                .idle_pages(Some(tail))
                .iter()
                .any(|&(since, _, _)| since >= quiescent)
    }

    /// Records a marker (an event on every stream) every `MARKER_INTERVAL`
    /// operations, at most `MAX_MARKERS` outstanding: once a marker's events
    /// completed, every block freed before it is quiescent, so its idle pages
    /// can be unmapped without waiting for the device.
    pub(super) fn maybe_record_marker<D: Device<Event = E>>(&mut self, dev: &D) {
        if self.clock < self.last_marker + MARKER_INTERVAL || self.markers.len() >= MAX_MARKERS {
            return;
        }
        self.last_marker = self.clock;
        let mut events = Vec::with_capacity(self.stream_list.len());
        for &stream in &self.stream_list {
            match dev.record_event(stream) {
                Ok(e) => events.push(e),
                Err(_) => {
                    events.into_iter().for_each(|e| dev.release_event(e));
                    return;
                }
            }
        }
        self.markers.push_back((self.clock, events));
    }

    /// Retires completed markers; returns the operation count before which
    /// every freed block is quiescent.
    fn poll_markers<D: Device<Event = E>>(&mut self, dev: &D) -> Result<u64, AllocError> {
        while let Some((_, events)) = self.markers.front() {
            for e in events {
                if !dev.event_completed(e)? {
                    return Ok(self.quiescent_before);
                }
            }
            let (clock, events) = self.markers.pop_front().expect("front exists");
            events.into_iter().for_each(|e| dev.release_event(e));
            self.quiescent_before = clock;
        }
        Ok(self.quiescent_before)
    }

    /// After a device synchronize every marker has completed.
    fn drop_markers<D: Device<Event = E>>(&mut self, dev: &D) {
        for (_, events) in self.markers.drain(..) {
            events.into_iter().for_each(|e| dev.release_event(e));
        }
        self.quiescent_before = self.clock;
    }

    /// Puts gathered pages back after a failure: pooled ones to the pool, new ones to the device.
    fn return_pages<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        pages: Vec<Page>,
    ) -> Result<(), AllocError> {
        let mut result = Ok(());
        for page in pages {
            match page.counted_as {
                Some(kind) => self.page_pool.push((page.handle, kind, page.size)),
                None => {
                    if let Err(e) = dev.vmm_release_page(page.handle) {
                        // Kept (pooled and counted) rather than lost.
                        self.page_pool
                            .push((page.handle, PoolKind::Large, page.size));
                        self.stats
                            .reserved_bytes
                            .increase(PoolKind::Large, page.size);
                        if result.is_ok() {
                            result = Err(e.into());
                        }
                        continue;
                    }
                    self.stats.num_page_release += 1;
                }
            }
        }
        result
    }

    /// Idle pages as (idle since, segment, first granule): mappings wholly
    /// inside a free block of the bins, or inside `extra` (about to be
    /// free). A big page partly under a live block is not idle.
    fn idle_pages(&self, extra: Option<Tail>) -> Vec<(u64, SegmentId, u32)> {
        let g = self.granularity.expect("expandable mode has a granularity");
        let mut idle = Vec::new();
        let mut collect = |s: &Segment, seg: SegmentId, start: u64, end: u64, since: u64| {
            let lo = (start - s.addr).div_ceil(g) as u32;
            let hi = ((end - s.addr) / g) as u32;
            if hi > lo {
                let pages = s.pages.as_ref().expect("expandable");
                idle.extend(pages.within(lo, hi).map(|(at, _, _)| (since, seg, at)));
            }
        };
        if let Some((seg, start, end, since)) = extra {
            collect(self.segments.get(seg.0), seg, start, end, since);
        }
        for &seg in self.ranges.iter().flatten() {
            let s = self.segments.get(seg.0);
            if s.pages.as_ref().is_some_and(|p| p.is_empty()) {
                continue;
            }
            let Some(bins) = self.bins[s.pool.index()].as_ref() else {
                continue;
            };
            for (size, addr, id) in bins.iter() {
                collect(s, seg, addr, addr + size, self.blocks.get(id.0).freed_at);
            }
        }
        idle
    }

    /// Unmaps idle pages, longest idle first, up to `max_bytes`, into the pool
    /// (they stay reserved); returns how many bytes. The caller has made sure no
    /// queued work can still touch them.
    fn unmap_idle_pages<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        extra: Option<Tail>,
        max_bytes: u64,
        freed_before: u64,
    ) -> Result<u64, AllocError> {
        let g = self.granularity.expect("expandable mode has a granularity");
        let mut idle = self.idle_pages(extra);
        idle.retain(|&(since, _, _)| since < freed_before);
        idle.sort_unstable_by_key(|&(since, seg, p)| (since, std::cmp::Reverse((seg, p))));
        let mut bytes = 0;
        for (_, seg, at) in idle {
            if bytes >= max_bytes {
                break;
            }
            let s = self.segments.get_mut(seg.0);
            let pages = s.pages.as_mut().expect("expandable");
            let (h, n) = pages.remove(at).expect("page was mapped");
            let size = u64::from(n) * g;
            if let Err(e) = dev.vmm_unmap(DevicePtr(s.addr + u64::from(at) * g), size) {
                pages.insert(at, n, h);
                return Err(e.into());
            }
            self.page_pool.push((h, s.pool.kind(), size));
            self.stats.num_unmap += 1;
            bytes += size;
        }
        Ok(bytes)
    }

    /// `empty_cache` for expandable segments: once the device is idle, unmap
    /// every idle page and release the whole pool; free the ranges left with
    /// no block and no page.
    pub(super) fn release_expandable<D: Device<Event = E>>(
        &mut self,
        dev: &D,
    ) -> Result<(), AllocError> {
        dev.synchronize()?;
        self.drop_markers(dev);
        self.device_full_at = None;
        self.unmap_idle_pages(dev, None, u64::MAX, u64::MAX)?;
        while let Some(&(h, kind, size)) = self.page_pool.last() {
            dev.vmm_release_page(h)?;
            self.page_pool.pop(); // only once released: a failure keeps it pooled
            self.stats.num_page_release += 1;
            self.stats.reserved_bytes.decrease(kind, size);
        }
        for i in 0..self.ranges.len() {
            let Some(seg) = self.ranges[i] else { continue };
            let s = self.segments.get(seg.0);
            let head = self.blocks.get(s.head.0);
            if head.state != BlockState::Free
                || head.next.is_some()
                || !s.pages.as_ref().is_some_and(|p| p.is_empty())
            {
                continue;
            }
            let (addr, size, pool, head_id) = (s.addr, s.size, s.pool, s.head);
            dev.vmm_free_range(DevicePtr(addr), size)?;
            self.bins_mut(pool).remove(size, addr, head_id);
            self.blocks.discard(head_id.0);
            self.segments.remove(seg.0);
            self.segment_by_addr.remove(&addr);
            self.ranges[i] = None;
            self.stats.segment.decrease(pool.kind(), 1);
        }
        Ok(())
    }

    /// Bytes of mapped pages lying entirely inside `[start, end)` (idle if that is a free block).
    pub(super) fn idle_bytes_in(&self, seg: &Segment, start: u64, end: u64) -> u64 {
        let Some(pages) = seg.pages.as_ref() else {
            return 0;
        };
        let g = self.granularity.expect("expandable mode has a granularity");
        let lo = (start - seg.addr).div_ceil(g) as u32;
        let hi = ((end - seg.addr) / g) as u32;
        if hi <= lo {
            return 0;
        }
        pages
            .within(lo, hi)
            .map(|(_, _, n)| u64::from(n))
            .sum::<u64>()
            * g
    }

    /// Bytes of `[start, end)` backed by memory (all of it in a plain segment).
    pub(super) fn mapped_bytes_in(&self, seg: &Segment, start: u64, end: u64) -> u64 {
        let Some(pages) = seg.pages.as_ref() else {
            return end - start;
        };
        let g = self.granularity.expect("expandable mode has a granularity");
        let first = ((start - seg.addr) / g) as u32;
        let last = (end - seg.addr).div_ceil(g) as u32;
        pages
            .runs_overlapping(first, last)
            .map(|(s, e)| {
                let lo = (seg.addr + u64::from(s) * g).max(start);
                let hi = (seg.addr + u64::from(e) * g).min(end);
                hi - lo
            })
            .sum()
    }

    /// Checks every expandable segment's page map (mappings of the
    /// granularity or of the segment's page size, inside the range, runs in
    /// step) and that no physical page is mapped twice or both mapped and pooled.
    pub(super) fn check_pages(&self) -> Result<(), String> {
        let Some(g) = self.granularity else {
            return Ok(());
        };
        let mut handles = std::collections::HashSet::new();
        for &(h, _, size) in &self.page_pool {
            if size == 0 || size % g != 0 || !handles.insert(h) {
                return Err(format!(
                    "pooled page {h} of {size} bytes is bad or listed twice"
                ));
            }
        }
        for &seg in self.ranges.iter().flatten() {
            let s = self.segments.get(seg.0);
            let pages = s.pages.as_ref().ok_or("a range without a page map")?;
            let sizes = [1, (s.page_size / g) as u32];
            pages
                .check((s.size / g) as u32, &sizes)
                .map_err(|e| format!("range at {:#x}: {e}", s.addr))?;
            for (at, h, _) in pages.within(0, (s.size / g) as u32) {
                if !handles.insert(h) {
                    return Err(format!(
                        "page {h} mapped at granule {at} of {:#x} is also mapped or pooled elsewhere",
                        s.addr
                    ));
                }
            }
        }
        Ok(())
    }

    /// Bytes held in the pool of unmapped pages.
    pub(super) fn pooled_bytes(&self) -> u64 {
        self.page_pool.iter().map(|p| p.2).sum()
    }
}

/// Bytes of the pages in `out` created for the request under way (not yet counted as reserved).
fn out_new_bytes(out: &[Page]) -> u64 {
    out.iter()
        .filter(|p| p.counted_as.is_none())
        .map(|p| p.size)
        .sum()
}
