//! Expandable segments on the virtual memory API.
//!
//! Each (stream, pool) gets one large virtual range; blocks tile it as in a
//! plain segment, but physical pages (the device's granularity, 2 MiB on
//! current GPUs) are mapped only under blocks that need them. Reserved bytes
//! are mapped bytes. Pages that lie entirely inside free blocks are idle:
//! before the allocator would grow past its previous peak or a cap, it
//! unmaps idle pages and maps the same physical pages where they are needed
//! (no create/release churn); under real pressure it waits for pending
//! events first; `empty_cache` unmaps and releases every idle page.
//!
//! A page may be unmapped only when no queued GPU work can still touch it,
//! so unmapping waits for the device to be idle. To pay that wait rarely,
//! a recycling round unmaps every idle page at once into a pool of unmapped
//! physical pages (still reserved), which later mappings draw from first.

use super::State;
use crate::block::{Block, BlockId, BlockState, PoolId, PoolKind, Segment, SegmentId};
use crate::device::{Device, DeviceError, DevicePtr, StreamId};
use crate::error::AllocError;
use std::collections::BTreeMap;

/// Largest virtual range reserved per (stream, pool): 1 TiB.
const MAX_RANGE: u64 = 1 << 40;

/// The size of the virtual range of each expandable segment on a device of `total` bytes.
pub(super) fn range_size(total: u64, granularity: u64) -> u64 {
    total.min(MAX_RANGE).div_ceil(granularity).max(1) * granularity
}

impl<E> State<E> {
    pub(super) fn granularity(&self) -> u64 {
        self.granularity.expect("expandable mode has a granularity")
    }

    /// Finds (reserving on first use) the range of `pool` and takes a block of `rounded` bytes from it, pages mapped.
    pub(super) fn malloc_expandable<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        pool: PoolId,
        stream: StreamId,
        size: u64,
        rounded: u64,
    ) -> Result<BlockId, AllocError> {
        let seg = match self.ranges[pool.index()] {
            Some(seg) => seg,
            None => self.reserve_range(dev, pool, stream)?,
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
            self.blocks.get_mut(id.0).state = BlockState::Allocated;
            let mapped = self.map_range(dev, seg, addr, addr + rounded, addr + bsize);
            if mapped.is_ok() {
                return Ok(id);
            }
            self.blocks.get_mut(id.0).state = BlockState::Free;
            self.bins_mut(pool).insert(bsize, addr, id);
            match mapped {
                Err(AllocError::OutOfMemory(_)) => {}
                Err(e) => return Err(e),
                Ok(()) => unreachable!(),
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
        let size = self.range_size;
        let ptr = dev.vmm_reserve(size)?;
        self.stats.num_vmm_reserve += 1;
        let seg = SegmentId(self.segments.insert(Segment {
            addr: ptr.0,
            size,
            stream,
            pool,
            head: BlockId(u32::MAX),
            pages: Some(BTreeMap::new()),
        }));
        let id = BlockId(self.blocks.insert(Block {
            addr: ptr.0,
            size,
            requested: 0,
            prev: None,
            next: None,
            segment: seg,
            pool,
            state: BlockState::Free,
            stream_uses: Vec::new(),
            pending_events: 0,
            gc_base: 0,
            freed_at: self.clock,
        }));
        self.segments.get_mut(seg.0).head = id;
        self.segment_by_addr.insert(ptr.0, seg);
        self.bins_mut(pool).insert(size, ptr.0, id);
        self.ranges[pool.index()] = Some(seg);
        self.stats.segment.increase(pool.kind(), 1);
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
        block_end: u64,
    ) -> Result<(), AllocError> {
        let g = self.granularity();
        let base = self.segments.get(seg.0).addr;
        let first = ((start - base) / g) as u32;
        let last = ((end - 1 - base) / g) as u32;
        let missing: Vec<u32> = {
            let pages = self.segments.get(seg.0).pages.as_ref().expect("expandable");
            (first..=last).filter(|p| !pages.contains_key(p)).collect()
        };
        if missing.is_empty() {
            return Ok(());
        }
        let mut handles = Vec::with_capacity(missing.len());
        if let Err(e) = self.gather_pages(dev, missing.len(), (seg, end, block_end), &mut handles) {
            self.return_pages(dev, handles)?;
            return Err(e);
        }
        let kind = self.segments.get(seg.0).pool.kind();
        let mut handles = handles.into_iter();
        for p in missing {
            let (h, from) = handles.next().expect("one page per missing page");
            if let Err(e) = dev.vmm_map(DevicePtr(base + u64::from(p) * g), h) {
                let mut rest = vec![(h, from)];
                rest.extend(handles);
                self.return_pages(dev, rest)?;
                return Err(e.into());
            }
            self.segments
                .get_mut(seg.0)
                .pages
                .as_mut()
                .expect("expandable")
                .insert(p, h);
            self.stats.num_map += 1;
            match from {
                None => self.stats.reserved_bytes.increase(kind, g),
                Some(old) => self.stats.reserved_bytes.move_group(old, kind, g),
            }
        }
        self.high_water = self.high_water.max(self.reserved());
        Ok(())
    }

    /// Collects `k` physical pages: from the pool of unmapped pages first;
    /// then, where creating pages would pass the soft limit (`idle_slack`
    /// over the peak allocated bytes) or the cap, or the device is full, one
    /// recycling round (synchronize, unmap every idle page into the pool);
    /// then new pages, as far as the cap allows. Each handle comes with the
    /// pool kind it is accounted under (`None`: newly created, not yet counted).
    fn gather_pages<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        k: usize,
        tail: (SegmentId, u64, u64),
        handles: &mut Vec<(u64, Option<PoolKind>)>,
    ) -> Result<(), AllocError> {
        let g = self.granularity();
        let peak = self.stats.allocated_bytes.all().peak;
        let soft_limit = if self.config.release_before_grow {
            peak.saturating_add((peak as f64 * self.config.idle_slack) as u64)
        } else {
            u64::MAX
        };
        let cap = self.cap.unwrap_or(u64::MAX);
        let mut recycled = false;
        loop {
            while handles.len() < k {
                let Some((h, kind)) = self.page_pool.pop() else {
                    break;
                };
                handles.push((h, Some(kind)));
            }
            if handles.len() == k {
                return Ok(());
            }
            let grow = (k - handles.len()) as u64 * g;
            if self.reserved() + grow > soft_limit.min(cap) && !recycled {
                self.recycle(dev, tail)?;
                recycled = true;
                continue;
            }
            if self.reserved() + grow > cap {
                return Err(AllocError::OutOfMemory(Box::default()));
            }
            match dev.vmm_create_page() {
                Ok(h) => {
                    handles.push((h, None));
                    self.stats.num_page_create += 1;
                }
                Err(DeviceError::OutOfMemory) if !recycled => {
                    self.recycle(dev, tail)?;
                    recycled = true;
                }
                Err(DeviceError::OutOfMemory) => {
                    return Err(AllocError::OutOfMemory(Box::default()))
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// One recycling round: wait until the device is idle (a page may only be
    /// unmapped once no queued work can touch it), recycle blocks whose events
    /// completed, and unmap every idle page into the pool.
    fn recycle<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        tail: (SegmentId, u64, u64),
    ) -> Result<(), AllocError> {
        dev.synchronize()?;
        self.stats.num_sync_all_streams += 1;
        self.process_events(dev)?;
        self.unmap_idle_pages(dev, Some(tail))?;
        Ok(())
    }

    /// Puts gathered pages back after a failure: pooled ones to the pool, new ones to the device.
    fn return_pages<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        handles: Vec<(u64, Option<PoolKind>)>,
    ) -> Result<(), AllocError> {
        for (h, from) in handles {
            match from {
                Some(kind) => self.page_pool.push((h, kind)),
                None => {
                    dev.vmm_release_page(h)?;
                    self.stats.num_page_release += 1;
                }
            }
        }
        Ok(())
    }

    /// Unmaps every idle page into the pool (they stay reserved); returns how
    /// many. Idle: wholly inside a free block of the bins, or inside `extra`
    /// (a segment and an address range about to become free). The caller has
    /// made sure no queued work can still touch them.
    fn unmap_idle_pages<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        extra: Option<(SegmentId, u64, u64)>,
    ) -> Result<u64, AllocError> {
        let g = self.granularity();
        let mut idle: Vec<(SegmentId, u32)> = Vec::new();
        let mut collect = |s: &Segment, seg: SegmentId, start: u64, end: u64| {
            let lo = (start - s.addr).div_ceil(g);
            let hi = (end - s.addr) / g;
            if hi > lo {
                let pages = s.pages.as_ref().expect("expandable");
                idle.extend(pages.range(lo as u32..hi as u32).map(|(&p, _)| (seg, p)));
            }
        };
        if let Some((seg, start, end)) = extra {
            collect(self.segments.get(seg.0), seg, start, end);
        }
        for &seg in self.ranges.iter().flatten() {
            let s = self.segments.get(seg.0);
            if s.pages.as_ref().is_some_and(|p| p.is_empty()) {
                continue;
            }
            let Some(bins) = self.bins[s.pool.index()].as_ref() else {
                continue;
            };
            for &(size, addr, _) in bins.iter() {
                collect(s, seg, addr, addr + size);
            }
        }
        let n = idle.len() as u64;
        for (seg, p) in idle {
            let s = self.segments.get_mut(seg.0);
            dev.vmm_unmap(DevicePtr(s.addr + u64::from(p) * g))?;
            let h = s
                .pages
                .as_mut()
                .expect("expandable")
                .remove(&p)
                .expect("page was mapped");
            self.page_pool.push((h, s.pool.kind()));
            self.stats.num_unmap += 1;
        }
        Ok(n)
    }

    /// `empty_cache` for expandable segments: once the device is idle, unmap
    /// every idle page and release the whole pool; free the ranges left with
    /// no block and no page. Returns (bytes, ranges) released.
    pub(super) fn release_expandable<D: Device<Event = E>>(
        &mut self,
        dev: &D,
    ) -> Result<(u64, u64), AllocError> {
        dev.synchronize()?;
        self.unmap_idle_pages(dev, None)?;
        let g = self.granularity();
        let bytes = self.page_pool.len() as u64 * g;
        while let Some((h, kind)) = self.page_pool.pop() {
            dev.vmm_release_page(h)?;
            self.stats.num_page_release += 1;
            self.stats.reserved_bytes.decrease(kind, g);
        }
        let mut ranges = 0;
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
            ranges += 1;
        }
        Ok((bytes, ranges))
    }

    /// Bytes of mapped pages lying entirely inside `[start, end)` (idle if that is a free block).
    pub(super) fn idle_bytes_in(&self, seg: &Segment, start: u64, end: u64) -> u64 {
        let g = self.granularity();
        let Some(pages) = seg.pages.as_ref() else {
            return 0;
        };
        let lo = (start - seg.addr).div_ceil(g);
        let hi = (end - seg.addr) / g;
        if hi <= lo {
            return 0;
        }
        pages.range(lo as u32..hi as u32).count() as u64 * g
    }

    /// Bytes of `[start, end)` backed by memory (all of it in a plain segment).
    pub(super) fn mapped_bytes_in(&self, seg: &Segment, start: u64, end: u64) -> u64 {
        let Some(pages) = seg.pages.as_ref() else {
            return end - start;
        };
        let g = self.granularity();
        let first = ((start - seg.addr) / g) as u32;
        let last = ((end - 1 - seg.addr) / g) as u32;
        pages
            .range(first..=last)
            .map(|(&p, _)| {
                let lo = (seg.addr + u64::from(p) * g).max(start);
                let hi = (seg.addr + u64::from(p + 1) * g).min(end);
                hi - lo
            })
            .sum()
    }
}
