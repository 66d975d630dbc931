//! Growing after a cache miss: the ladder from a new segment through
//! releasing free segments to the full flush and the out-of-memory report,
//! and the rules that decide which free segments go back to the device.

use super::*;
use crate::bins::Entry;

/// `borrow_holes`: the fits looked at per other stream (the first one in a
/// partly used segment is taken).
const BORROW_LOOKS: usize = 8;

/// `borrow_holes`: the other streams one search looks at, taken in turn, so
/// that a growth costs the same with thousands of streams as with a few.
const BORROW_STREAMS: usize = 32;

/// Where [`State::other_kind_fit`] looks for each request kind (indexed by
/// `PoolKind`), in order: small requests in large then huge segments, large
/// ones in huge segments. Nowhere for huge requests, and never in small
/// segments: no segment of those kinds has a free block that large.
const OTHER_KINDS: [&[PoolKind]; 3] = [&[PoolKind::Large, PoolKind::Huge], &[PoolKind::Huge], &[]];

impl<E> State<E> {
    /// The ladder after a cache miss: new segment → release what suffices →
    /// full flush → out of memory.
    pub(super) fn grow<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        req: Request,
    ) -> Result<BlockId, AllocError> {
        let Request { pool, rounded, .. } = req;
        if pool.kind() == PoolKind::Small && self.slabs.unslab_empty(&mut self.core, pool) {
            if let Some(id) = self.core.get_free_block(pool, rounded) {
                return Ok(id);
            }
        }
        let seg_size = self.core.segment_size(rounded);
        let caching = self.core.config.caching;
        let retry = |st: &mut Self, _: &D| {
            if caching {
                if let Some(id) = st.core.get_free_block(pool, rounded) {
                    return Ok(Some(id));
                }
            }
            Ok(None)
        };
        self.grow_with(dev, req, seg_size, retry)
    }

    /// [`State::grow`] for a segment of `seg_size`, where `retry` looks in
    /// the cache again after the thread caches and after the full flush
    /// gave blocks back. Returns what `retry` found, or the one free block
    /// of a new segment (not in the bins).
    pub(super) fn grow_with<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        req: Request,
        seg_size: u64,
        retry: impl Fn(&mut Self, &D) -> Result<Option<BlockId>, AllocError>,
    ) -> Result<BlockId, AllocError> {
        let Request {
            pool,
            stream,
            size,
            rounded,
        } = req;
        if self.caches.cached_blocks() > 0 {
            // Blocks parked in thread caches go back before the device is asked.
            self.flush_thread_caches();
            if let Some(id) = retry(self, dev)? {
                return Ok(id);
            }
        }
        if self.core.config.garbage_collection_threshold.is_some() && self.core.cap.is_some() {
            self.garbage_collect(dev)?;
        }
        // (A slab is made of a segment of its own, never of a borrowed hole.)
        let slab = self.slabs.serves(rounded);
        if self.core.config.borrow_holes && self.core.config.caching && !slab {
            if let Some(id) = self.borrow_hole(dev, req)? {
                return Ok(id);
            }
        }
        if let Some(id) = self.core.alloc_segment(dev, pool, stream, seg_size)? {
            return Ok(id);
        }
        if self.release_available(dev, pool, rounded)? {
            if let Some(id) = self.core.alloc_segment(dev, pool, stream, seg_size)? {
                return Ok(id);
            }
        }
        // Full flush: wait for every pending event, release every free segment, retry.
        if self.core.config.oom_flush {
            self.release_cached(dev)?;
            self.core.stats.num_alloc_retries += 1;
            if let Some(id) = retry(self, dev)? {
                return Ok(id);
            }
            if let Some(id) = self.core.alloc_segment(dev, pool, stream, seg_size)? {
                return Ok(id);
            }
        }
        if self.core.config.oom_other_kinds && self.core.config.caching && !slab {
            if let Some(id) = self.other_kind_fit(req) {
                return Ok(id);
            }
        }
        self.core.stats.num_ooms += 1;
        Err(AllocError::OutOfMemory(Box::new(
            self.oom_report(dev, size, seg_size),
        )))
    }

    /// The ladder's last rung before out of memory: the best fit among the
    /// free blocks of the requesting stream's pools of another segment kind
    /// ([`OTHER_KINDS`]), so that free space stranded in segments of one
    /// kind (a huge segment's free tail) serves a smaller request that the
    /// device has no room for. Only then: in every run that fits, the kinds
    /// stay apart.
    #[cold]
    fn other_kind_fit(&mut self, req: Request) -> Option<BlockId> {
        let slot = req.pool.stream_slot() as u32;
        let id = OTHER_KINDS[req.pool.kind() as usize]
            .iter()
            .find_map(|&kind| {
                let pool = PoolId::new(slot, kind);
                self.core.take_mapped_fit(pool, req.rounded, BORROW_LOOKS)
            })?;
        self.core.stats.num_other_kind_fits += 1;
        Some(id)
    }

    /// `borrow_holes`: the smallest free block that fits `rounded` inside a
    /// partly used segment of another stream's pool of the same kind (an
    /// entirely free one is for the release rules to give back), out of its
    /// bins once the requesting stream waits on the device for that
    /// stream's queued work. Used on the requesting stream, its free is
    /// guarded by an event there (`stream_uses`), as after `record_stream`.
    #[cold]
    fn borrow_hole<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        req: Request,
    ) -> Result<Option<BlockId>, AllocError> {
        let Request {
            pool,
            stream,
            rounded,
            ..
        } = req;
        // (Behind a CUDA graph capture the wait would join the graph.)
        if dev.stream_capturing(stream) {
            return Ok(None);
        }
        self.retire_stream_waits(dev)?;
        let max_split = self.core.config.max_split_size;
        let streams = self.core.bins.len() / crate::block::POOLS_PER_STREAM as usize;
        let mut best: Option<(Entry, usize)> = None;
        let first = self.core.borrow_from % streams;
        let looked = streams.min(BORROW_STREAMS + 1);
        self.core.borrow_from = first + looked;
        let slots = (first..first + looked).map(|s| s % streams);
        for slot in slots.filter(|&s| s != pool.stream_slot()) {
            let other = PoolId::new(slot as u32, pool.kind());
            let bins = &self.core.bins[other.index()];
            for e in bins.iter_from(rounded).take(BORROW_LOOKS) {
                if best.is_some_and(|(b, _)| b.size <= e.size)
                    || (rounded < max_split && e.size >= max_split)
                {
                    break;
                }
                if self.core.blocks.get(e.id.0).is_split()
                    && !dev.stream_capturing(self.core.stream_list[slot])
                {
                    best = Some((e, slot));
                    break;
                }
            }
        }
        let Some((Entry { size, addr, id }, slot)) = best else {
            return Ok(None);
        };
        // That stream's work queued so far: done already, or waited for on the device.
        let other = self.core.stream_list[slot];
        if let Some(e) = self.core.wait_for_stream(dev, other, stream, true)? {
            self.core.stream_waits.push(e);
        }
        let owner = self.core.blocks.get(id.0).pool;
        self.core.bins_mut(owner).remove(size, addr, id);
        self.core.blocks.get_mut(id.0).stream_uses.push(stream);
        self.core.stats.num_blocks_borrowed += 1;
        Ok(Some(id))
    }

    /// Releases the completed events of [`Core::stream_waits`].
    fn retire_stream_waits<D: Device<Event = E>>(&mut self, dev: &D) -> Result<(), AllocError> {
        let mut i = 0;
        while i < self.core.stream_waits.len() {
            if dev.event_completed(&self.core.stream_waits[i])? {
                dev.release_event(self.core.stream_waits.swap_remove(i));
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    pub(super) fn oom_report<D: Device<Event = E>>(
        &self,
        dev: &D,
        size: u64,
        seg_size: u64,
    ) -> OomReport {
        let info = dev.mem_info().unwrap_or_default();
        let frag = self.fragmentation_totals();
        OomReport {
            requested: size,
            segment_size: seg_size,
            device_free: info.free,
            device_total: info.total,
            cap: self.core.cap_now(),
            allocated: self.core.stats.allocated_bytes.all().current,
            reserved: self.core.reserved(),
            largest_free_block: frag.1,
            external_fragmentation: if frag.0 == 0 {
                0.0
            } else {
                (frag.0 - frag.1) as f64 / frag.0 as f64
            },
            expandable: self.core.config.expandable_segments,
            // (With `expandable_reback` such pages went back before the failure.)
            big_pages: !self.core.config.expandable_reback
                && self.core.granularity.is_some_and(|g| {
                    let page = self.vmm.page_size(&self.core, PoolKind::Large) / g;
                    expandable::scaled_granules(&self.core, page as u32, size) > 1
                }),
        }
    }

    /// Frees an entirely free segment to the device.
    pub(super) fn release_segment<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        seg: SegmentId,
    ) -> Result<u64, AllocError> {
        debug_assert!(self.core.segment_is_free(seg));
        let s = self.core.segments.get(seg.0);
        let (addr, size, pool, head, slab) = (s.addr, s.size, s.pool, s.head, s.is_slab());
        let stream = s.stream;
        self.core.segment_free(dev, DevicePtr(addr), size, stream)?;
        if slab {
            self.slabs.drop_slab(&mut self.core, seg);
        } else {
            self.core.unfile_released(pool, size, addr, head);
            self.core.blocks.discard(head.0);
        }
        self.core.segment_by_addr.remove(&addr);
        self.core.forget_segment(seg, size);
        self.core.stats.num_device_free += 1;
        Ok(size)
    }

    /// Waits for events and releases every entirely free segment.
    pub(super) fn release_cached<D: Device<Event = E>>(
        &mut self,
        dev: &D,
    ) -> Result<Released, AllocError> {
        // Counted from the stats, so that segments released on the way (a
        // no-caching block whose event the wait completed) are included.
        let before = (
            self.core.stats.reserved_bytes.all().freed,
            self.core.stats.segment.all().freed,
        );
        self.wait_all_events(dev)?;
        for (_, seg) in self.core.free_segments() {
            self.release_segment(dev, seg)?;
        }
        if self.core.granularity.is_some() {
            self.vmm.release_expandable(&mut self.core, dev)?;
        }
        Ok(Released {
            bytes: self.core.stats.reserved_bytes.all().freed - before.0,
            segments: self.core.stats.segment.all().freed - before.1,
        })
    }

    /// The ladder's middle step: release cached segments that make room.
    pub(super) fn release_available<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        pool: PoolId,
        rounded: u64,
    ) -> Result<bool, AllocError> {
        if !self.core.config.oom_flush {
            return Ok(false);
        }
        if self.core.config.max_split_size == u64::MAX {
            return Ok(false);
        }
        self.release_oversize(dev, pool, rounded)
    }

    /// PyTorch's `release_available_cached_blocks` (only with `max_split_size`):
    /// free one oversize block of the pool that fits, else the largest ones.
    pub(super) fn release_oversize<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        pool: PoolId,
        rounded: u64,
    ) -> Result<bool, AllocError> {
        let max_split = self.core.config.max_split_size;
        let key = rounded.max(max_split);
        let bins = &self.core.bins[pool.index()];
        let candidates: Vec<BlockId> = match bins.best_fit(key) {
            Some(Entry { id, .. }) => vec![id],
            None => {
                let mut total = 0;
                let mut v = Vec::new();
                for Entry { size, id, .. } in bins.iter().rev() {
                    if total >= key || size < max_split {
                        break;
                    }
                    total += size;
                    v.push(id);
                }
                if total < key {
                    return Ok(false);
                }
                v
            }
        };
        let mut any = false;
        for id in candidates {
            let b = self.core.blocks.get(id.0);
            if !b.is_split() {
                let seg = b.segment;
                self.release_segment(dev, seg)?;
                any = true;
            }
        }
        Ok(any)
    }

    /// PyTorch's `garbage_collect_cached_blocks`: with a cap and a threshold,
    /// release unsplit large cached blocks that have gone unused longest.
    pub(super) fn garbage_collect<D: Device<Event = E>>(
        &mut self,
        dev: &D,
    ) -> Result<(), AllocError> {
        let (Some(t), Some(cap)) = (self.core.config.garbage_collection_threshold, self.core.cap)
        else {
            return Ok(());
        };
        let threshold = (t * cap as f64) as u64;
        if self.core.reserved() <= threshold {
            return Ok(());
        }
        let target = self.core.reserved() - threshold;
        let age = |st: &Self, id: BlockId| {
            let b = st.core.blocks.get(id.0);
            st.core.lookups[b.pool.index()] - b.gc_base
        };
        let mut candidates: Vec<BlockId> = Vec::new();
        for (i, bins) in self.core.bins.iter().enumerate() {
            if let PoolKind::Large | PoolKind::Huge = PoolId(i as u32).kind() {
                candidates.extend(bins.iter().map(|e| e.id).filter(|id| {
                    let b = self.core.blocks.get(id.0);
                    !b.is_split() && !self.core.segments.get(b.segment.0).is_expandable()
                }));
            }
        }
        let mut total_age: u64 = candidates.iter().map(|&id| age(self, id)).sum();
        let mut reclaimed = 0;
        while reclaimed < target && !candidates.is_empty() {
            let threshold_age = total_age as f64 / candidates.len() as f64;
            let (old, keep): (Vec<BlockId>, Vec<BlockId>) = candidates
                .iter()
                .partition(|&&id| age(self, id) as f64 >= threshold_age);
            if old.is_empty() {
                break;
            }
            for id in old {
                total_age -= age(self, id);
                let seg = self.core.blocks.get(id.0).segment;
                reclaimed += self.release_segment(dev, seg)?;
            }
            candidates = keep;
        }
        Ok(())
    }

    /// Reserves a new range for `pool` that fits `rounded` bytes; returns
    /// its free block as a bins entry (size, address, block). Out of
    /// address space, releases what the cache can spare and tries once more.
    #[cold]
    pub(super) fn new_range<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        req: Request,
    ) -> Result<Entry, AllocError> {
        let Request {
            pool,
            stream,
            size,
            rounded,
        } = req;
        let seg = match self
            .vmm
            .reserve_range(&mut self.core, dev, pool, stream, rounded)
        {
            Ok(seg) => seg,
            Err(AllocError::Device(DeviceError::OutOfMemory)) => {
                self.core.stats.num_alloc_retries += 1;
                self.release_cached(dev)?;
                match self
                    .vmm
                    .reserve_range(&mut self.core, dev, pool, stream, rounded)
                {
                    Ok(seg) => seg,
                    Err(AllocError::Device(DeviceError::OutOfMemory)) => {
                        self.core.stats.num_ooms += 1;
                        return Err(AllocError::OutOfMemory(Box::new(
                            self.oom_report(dev, size, rounded),
                        )));
                    }
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        };
        let s = self.core.segments.get(seg.0);
        Ok(Entry {
            size: s.size,
            addr: s.addr,
            id: s.head,
        })
    }
}

impl<E> Core<E> {
    /// Takes out of `pool`'s bins the best fit for `rounded` among its first
    /// `looks` fits, as `max_split_size` allows.
    #[cold]
    fn take_mapped_fit(&mut self, pool: PoolId, rounded: u64, looks: usize) -> Option<BlockId> {
        let max_split = self.config.max_split_size;
        let Entry { size, addr, id } = self.bins[pool.index()]
            .iter_from(rounded)
            .take(looks)
            .find(|e| rounded >= max_split || e.size < max_split)?;
        self.bins_mut(pool).remove(size, addr, id);
        Some(id)
    }

    /// Makes `waiter` wait on the device for the work `from` queued so far,
    /// through an event recorded on `from` now. With `unless_done`, an event
    /// already complete is released and `None` returned; otherwise the event
    /// is returned, for the caller to keep until it completes.
    #[cold]
    pub(super) fn wait_for_stream<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        from: StreamId,
        waiter: StreamId,
        unless_done: bool,
    ) -> Result<Option<E>, AllocError> {
        let e = dev.record_event(from)?;
        self.stats.num_events_recorded += 1;
        let wait = || -> Result<bool, DeviceError> {
            if unless_done && dev.event_completed(&e)? {
                return Ok(false);
            }
            dev.stream_wait_event(waiter, &e)?;
            Ok(true)
        };
        match wait() {
            Ok(true) => {
                self.stats.num_stream_waits += 1;
                Ok(Some(e))
            }
            Ok(false) => {
                dev.release_event(e);
                Ok(None)
            }
            Err(err) => {
                dev.release_event(e);
                Err(err.into())
            }
        }
    }

    /// Asks the device for a segment; `Ok(None)` when the cap or the device says no.
    pub(super) fn alloc_segment<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        pool: PoolId,
        stream: StreamId,
        size: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        if self
            .cap_now()
            .is_some_and(|cap| self.reserved().saturating_add(size) > cap)
        {
            return Ok(None);
        }
        let kind = pool.kind();
        let ptr = match self.segment_alloc(dev, size, stream) {
            Ok(p) => p,
            Err(DeviceError::OutOfMemory) => {
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        };
        let seg = self.add_segment(ptr, size, stream, pool, None);
        let id = self.segments.get(seg.0).head;
        self.stats.reserved_bytes.increase(kind, size);
        self.stats.num_device_alloc += 1;
        if size >= self.config.max_split_size {
            self.stats.oversize_segments.increase(1);
        }
        Ok(Some(id))
    }

    /// Drops the record of segment `seg` (its blocks and its address entry
    /// already gone), which held `reserved` bytes counted reserved.
    pub(super) fn forget_segment(&mut self, seg: SegmentId, reserved: u64) {
        let s = self.segments.remove(seg.0);
        let kind = s.pool.kind();
        self.stats.segment.decrease(kind, 1);
        self.stats.reserved_bytes.decrease(kind, reserved);
        if s.size >= self.config.max_split_size {
            self.stats.oversize_segments.decrease(1);
        }
    }

    /// Records a new segment (plain, or expandable with `page_size`) as one
    /// free block; the block is in the bins only if the caller puts it there.
    pub(super) fn add_segment(
        &mut self,
        ptr: DevicePtr,
        size: u64,
        stream: StreamId,
        pool: PoolId,
        page_size: Option<u64>,
    ) -> SegmentId {
        let seg = SegmentId(self.segments.insert(Segment {
            addr: ptr.0,
            size,
            stream,
            pool,
            head: BlockId(u32::MAX),
            kind: match page_size {
                Some(page_size) => SegmentKind::Expandable {
                    pages: PageMap::default(),
                    page_size,
                },
                None => SegmentKind::Plain,
            },
        }));
        let head = BlockId(
            self.blocks
                .insert(Block::free(ptr.0, size, seg, pool, self.clock)),
        );
        self.segments.get_mut(seg.0).head = head;
        self.segment_by_addr.insert(ptr.0, seg);
        self.free_candidates[pool.kind() as usize].insert((self.clock, ptr.0, seg.0));
        self.stats.segment.increase(pool.kind(), 1);
        seg
    }

    /// Whether a segment is a single free block, or a slab with no chunk in
    /// use (releasable).
    pub(super) fn segment_is_free(&self, seg: SegmentId) -> bool {
        let s = self.segments.get(seg.0);
        if let Some(slab) = s.slab() {
            return slab.live == 0;
        }
        let b = self.blocks.get(s.head.0);
        b.state == BlockState::Free && b.next.is_none() && !s.is_expandable()
    }

    /// The operation count since which an entirely free segment has been free.
    pub(super) fn free_since(&self, seg: SegmentId) -> u64 {
        let s = self.segments.get(seg.0);
        match s.slab() {
            Some(slab) => slab.idle_since,
            None => self.blocks.get(s.head.0).freed_at,
        }
    }

    /// Lists `seg` among the free candidates if it is entirely free (under
    /// its current idle age).
    pub(super) fn note_maybe_free(&mut self, seg: SegmentId) {
        if self.segment_is_free(seg) {
            let s = self.segments.get(seg.0);
            let (addr, kind) = (s.addr, s.pool.kind());
            self.free_candidates[kind as usize].insert((self.free_since(seg), addr, seg.0));
        }
    }

    /// Whether an entry of `free_candidates` is an entirely free segment
    /// (free since then).
    pub(super) fn free_candidate_holds(&self, (since, addr, id): (u64, u64, u32)) -> bool {
        let seg = SegmentId(id);
        self.segment_by_addr.get(&addr) == Some(&seg)
            && self.segment_is_free(seg)
            && self.free_since(seg) == since
    }

    /// Entirely free segments (any pool, any stream), lowest address first.
    /// Drops the candidates that are not (or no longer exist).
    pub(super) fn free_segments(&mut self) -> Vec<(u64, SegmentId)> {
        let mut out = Vec::new();
        let mut stale = Vec::new();
        for (k, set) in self.free_candidates.iter().enumerate() {
            for &e in set {
                if self.free_candidate_holds(e) {
                    out.push((e.1, self.segments.get(e.2).size, SegmentId(e.2)));
                } else {
                    stale.push((k, e));
                }
            }
        }
        for (k, e) in stale {
            self.free_candidates[k].remove(&e);
        }
        out.sort_unstable_by_key(|e| e.0);
        out.into_iter().map(|(_, size, seg)| (size, seg)).collect()
    }
}
