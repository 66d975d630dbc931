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
use crate::device::{Device, DeviceError, DevicePtr, StreamId};
use crate::error::AllocError;

/// Operations between two markers (see `maybe_record_marker`).
const MARKER_INTERVAL: u64 = 128;
/// Markers outstanding at most.
const MAX_MARKERS: usize = 8;

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

/// A physical page in hand while a block's pages are gathered.
#[derive(Copy, Clone)]
pub(super) struct Page {
    handle: u64,
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

    /// Maps every unmapped page under `[start, end)` of `seg`. The block
    /// being carved ends at `block_end`: pages wholly in `[end, block_end)`
    /// stay free after the split, so they count as idle too.
    fn map_range<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        seg: SegmentId,
        start: u64,
        end: u64,
        (block_end, since): (u64, u64),
    ) -> Result<(), AllocError> {
        let s = self.segments.get(seg.0);
        let (base, ps, kind) = (s.addr, s.page_size, s.pool.kind());
        let missing: Vec<u32> = {
            let pages = s.pages.as_ref().expect("expandable");
            let first = ((start - base) / ps) as u32;
            let last = ((end - 1 - base) / ps) as u32;
            pages.missing(first, last)
        };
        if missing.is_empty() {
            return Ok(());
        }
        let mut gathered = Vec::with_capacity(missing.len());
        if let Err(e) = self.gather_pages(
            dev,
            ps,
            missing.len(),
            (seg, end, block_end, since),
            &mut gathered,
        ) {
            self.return_pages(dev, ps, gathered)?;
            return Err(e);
        }
        let mut gathered = gathered.into_iter();
        for p in missing {
            let page = gathered.next().expect("one page per missing page");
            if let Err(e) = dev.vmm_map(DevicePtr(base + u64::from(p) * ps), page.handle, ps) {
                let rest: Vec<Page> = std::iter::once(page).chain(gathered).collect();
                self.return_pages(dev, ps, rest)?;
                return Err(e.into());
            }
            self.segments
                .get_mut(seg.0)
                .pages
                .as_mut()
                .expect("expandable")
                .insert(p, page.handle);
            self.stats.num_map += 1;
            match page.counted_as {
                None => self.stats.reserved_bytes.increase(kind, ps),
                Some(old) => self.stats.reserved_bytes.move_group(old, kind, ps),
            }
        }
        self.high_water = self.high_water.max(self.reserved());
        Ok(())
    }

    /// Collects `k` physical pages of `ps` bytes: from the pool of unmapped
    /// pages first; then, where creating pages would pass the soft limit or
    /// the cap, or the device is full, one recycling round; then new pages,
    /// as far as the cap allows.
    fn gather_pages<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        ps: u64,
        k: usize,
        tail: Tail,
        out: &mut Vec<Page>,
    ) -> Result<(), AllocError> {
        let peak = self.stats.allocated_bytes.all().peak as f64;
        let (soft_limit, hard_limit) = if self.config.release_before_grow {
            let soft = (peak * (1.0 + self.config.idle_slack)) as u64;
            (
                soft,
                soft.max((peak * (1.0 + self.config.idle_slack_hard)) as u64),
            )
        } else {
            (u64::MAX, u64::MAX)
        };
        let cap = self.cap.unwrap_or(u64::MAX);
        // 0: nothing recycled yet; 1: quiescent idle pages taken; 2: waited for the device.
        let mut stage = 0;
        loop {
            while out.len() < k {
                let Some(i) = self.page_pool.iter().rposition(|p| p.2 == ps) else {
                    break;
                };
                let (handle, kind, _) = self.page_pool.swap_remove(i);
                out.push(Page {
                    handle,
                    counted_as: Some(kind),
                });
            }
            if out.len() == k {
                return Ok(());
            }
            let grow = (k - out.len()) as u64 * ps;
            // Past the soft limit, take idle pages no queued work can touch
            // (free): past the hard limit or the cap, wait for the device.
            if stage < 1 && self.reserved() + grow > soft_limit.min(cap) {
                self.recycle(dev, tail, grow, false)?;
                stage = 1;
                continue;
            }
            if stage < 2 && self.reserved() + grow > hard_limit.min(cap) {
                self.recycle(dev, tail, grow, true)?;
                stage = 2;
                continue;
            }
            if self.reserved() + grow > cap {
                return Err(AllocError::OutOfMemory(Box::default()));
            }
            match dev.vmm_create_page(ps) {
                Ok(handle) => {
                    out.push(Page {
                        handle,
                        counted_as: None,
                    });
                    self.stats.num_page_create += 1;
                }
                Err(DeviceError::OutOfMemory) if stage < 2 => {
                    self.recycle(dev, tail, grow, true)?;
                    stage = 2;
                }
                Err(DeviceError::OutOfMemory) => {
                    return Err(AllocError::OutOfMemory(Box::default()))
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// One recycling round: wait until the device is idle, recycle blocks
    /// whose events completed, and unmap the pages needed now (`need` bytes)
    /// plus `recycle_batch` of the peak, longest idle first, into the pool.
    /// Under pressure (device full or cap) pages of the other page size are
    /// released, so that their bytes can be created again in the size needed.
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
        let waiting_helps = || {
            self.pending_blocks > 0
                || self
                    .idle_pages(Some(tail))
                    .iter()
                    .any(|&(since, _, _)| since >= quiescent)
        };
        if wait && got < need && waiting_helps() {
            dev.synchronize()?;
            self.stats.num_sync_all_streams += 1;
            self.drop_markers(dev);
            self.process_events(dev)?;
            self.unmap_idle_pages(dev, Some(tail), batch - got, u64::MAX)?;
        }
        // Pooled pages of the other size cannot serve this request: give their
        // bytes back so that new pages of the needed size fit.
        let ps = tail_page_size(self, tail);
        let mut i = 0;
        while i < self.page_pool.len() {
            if self.page_pool[i].2 != ps {
                let (h, kind, size) = self.page_pool.swap_remove(i);
                dev.vmm_release_page(h)?;
                self.stats.num_page_release += 1;
                self.stats.reserved_bytes.decrease(kind, size);
            } else {
                i += 1;
            }
        }
        Ok(())
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
        ps: u64,
        pages: Vec<Page>,
    ) -> Result<(), AllocError> {
        for page in pages {
            match page.counted_as {
                Some(kind) => self.page_pool.push((page.handle, kind, ps)),
                None => {
                    dev.vmm_release_page(page.handle)?;
                    self.stats.num_page_release += 1;
                }
            }
        }
        Ok(())
    }

    /// Idle pages as (idle since, segment, page index): mapped pages wholly
    /// inside a free block of the bins, or inside `extra` (about to be free).
    fn idle_pages(&self, extra: Option<Tail>) -> Vec<(u64, SegmentId, u32)> {
        let mut idle = Vec::new();
        let mut collect = |s: &Segment, seg: SegmentId, start: u64, end: u64, since: u64| {
            let lo = (start - s.addr).div_ceil(s.page_size);
            let hi = (end - s.addr) / s.page_size;
            if hi > lo {
                let pages = s.pages.as_ref().expect("expandable");
                idle.extend(
                    pages
                        .range(lo as u32..hi as u32)
                        .map(|(&p, _)| (since, seg, p)),
                );
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
            for &(size, addr, id) in bins.iter() {
                collect(s, seg, addr, addr + size, self.blocks.get(id.0).freed_at);
            }
        }
        idle
    }

    /// Unmaps idle pages, longest idle first, up to `max_bytes`, into the pool
    /// (they stay reserved); returns how many. The caller has made sure no
    /// queued work can still touch them.
    fn unmap_idle_pages<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        extra: Option<Tail>,
        max_bytes: u64,
        freed_before: u64,
    ) -> Result<u64, AllocError> {
        let mut idle = self.idle_pages(extra);
        idle.retain(|&(since, _, _)| since < freed_before);
        idle.sort_unstable_by_key(|&(since, seg, p)| (since, std::cmp::Reverse((seg, p))));
        let mut bytes = 0;
        let mut n = 0;
        for (_, seg, p) in idle {
            if bytes >= max_bytes {
                break;
            }
            let s = self.segments.get_mut(seg.0);
            let ps = s.page_size;
            dev.vmm_unmap(DevicePtr(s.addr + u64::from(p) * ps), ps)?;
            let h = s
                .pages
                .as_mut()
                .expect("expandable")
                .remove(p)
                .expect("page was mapped");
            self.page_pool.push((h, s.pool.kind(), ps));
            self.stats.num_unmap += 1;
            bytes += ps;
            n += 1;
        }
        let _ = n;
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
        self.unmap_idle_pages(dev, None, u64::MAX, u64::MAX)?;
        while let Some((h, kind, size)) = self.page_pool.pop() {
            dev.vmm_release_page(h)?;
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
            self.blocks.remove(head_id.0);
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
        let lo = (start - seg.addr).div_ceil(seg.page_size);
        let hi = (end - seg.addr) / seg.page_size;
        if hi <= lo {
            return 0;
        }
        pages.range(lo as u32..hi as u32).count() as u64 * seg.page_size
    }

    /// Bytes of `[start, end)` backed by memory (all of it in a plain segment).
    pub(super) fn mapped_bytes_in(&self, seg: &Segment, start: u64, end: u64) -> u64 {
        let Some(pages) = seg.pages.as_ref() else {
            return end - start;
        };
        let ps = seg.page_size;
        let first = ((start - seg.addr) / ps) as u32;
        let last = ((end - 1 - seg.addr) / ps) as u32;
        pages
            .range(first..last + 1)
            .map(|(&p, _)| {
                let lo = (seg.addr + u64::from(p) * ps).max(start);
                let hi = (seg.addr + u64::from(p + 1) * ps).min(end);
                hi - lo
            })
            .sum()
    }

    /// Bytes held in the pool of unmapped pages.
    pub(super) fn pooled_bytes(&self) -> u64 {
        self.page_pool.iter().map(|p| p.2).sum()
    }
}

fn tail_page_size<E>(st: &State<E>, tail: Tail) -> u64 {
    st.segments.get(tail.0 .0).page_size
}
