//! The allocation path: a request's pool, the best fit in the bins, and
//! handing a block out (split when worth it, counted, recorded).

use super::*;
use crate::bins::Entry;
use crate::rounding::slab_class;

impl<E> State<E> {
    // Inlined into the locked wrapper: returned through memory, its result
    // was reloaded there with a store-forwarding stall (perf, random mix).
    #[inline(always)]
    pub(super) fn malloc<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        size: u64,
        rounded: u64,
        stream: StreamId,
        own: Option<SlotId>,
    ) -> Result<DevicePtr, AllocError> {
        if let Some(slot) = own {
            self.caches.note_miss(slot, rounded, stream);
        }
        self.caches.shadow_malloc(rounded);
        if self.core.pending_blocks > 0 {
            self.process_events(dev)?;
        }
        self.core.clock += 1;
        let kind = self.core.request_kind(rounded);
        let pool = PoolId::new(self.stream_slot(stream), kind);
        let req = Request {
            pool,
            stream,
            size,
            rounded,
        };
        if self.slabs.serves(rounded) {
            // (`slab_max` is at most the small-request limit.)
            return self.slab_malloc(dev, req);
        }
        if let (Some(slot), false) = (own, kind == PoolKind::Small) {
            self.flush_own_large(slot);
        }
        let id = if self.core.granularity.is_some() {
            self.malloc_expandable(dev, req)?
        } else {
            let found = if self.core.config.caching {
                self.core.get_free_block(pool, rounded)
            } else {
                None
            };
            match found {
                Some(id) => id,
                None => self.grow(dev, req)?,
            }
        };
        Ok(self.core.alloc_found_block(id, rounded, size))
    }

    /// Serves a small request from the slabs of `pool`, making a new slab
    /// (through the same ladder as any growth) when none has room.
    pub(super) fn slab_malloc<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        req: Request,
    ) -> Result<DevicePtr, AllocError> {
        let Request {
            pool,
            size,
            rounded,
            ..
        } = req;
        let (class, chunk) = slab_class(rounded);
        let id = match self.slabs.take_chunk(&mut self.core, pool, class, chunk) {
            Some(id) => id,
            None => {
                let seg_size = self.core.config.small_segment;
                let id = self.grow_with(dev, req, seg_size, |st, _| {
                    Ok(st.slabs.take_chunk(&mut st.core, pool, class, chunk))
                })?;
                self.slabs
                    .chunk_from_grown(&mut self.core, id, class, chunk)
            }
        };
        let b = self.core.blocks.get_mut(id.0);
        b.state = BlockState::Allocated;
        b.requested = size;
        let addr = b.addr;
        self.core.live.insert(addr, id);
        self.core.count_allocated(PoolKind::Small, chunk, true);
        self.core.count_active(PoolKind::Small, chunk, size, true);
        self.core.record_alloc(addr, size, pool);
        Ok(DevicePtr(addr))
    }

    /// Takes a block of `rounded` bytes from the expandable segments of
    /// `pool` (reserving a new range when none has room), its pages mapped.
    pub(super) fn malloc_expandable<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        req: Request,
    ) -> Result<BlockId, AllocError> {
        let Request { size, rounded, .. } = req;
        for attempt in 0..3 {
            if attempt == 1 {
                // Wait for every pending event, so that blocks other streams
                // held become free and their pages idle, then retry.
                self.core.stats.num_alloc_retries += 1;
                self.wait_all_events(dev)?;
            }
            if attempt == 2 {
                // Last rungs: the free part of pages partly under live
                // blocks, then pages shared by granules whose live bytes do
                // not meet.
                if self.vmm.last_rungs(&mut self.core, dev)? == 0 {
                    break;
                }
            }
            let (fit, borrowed) = self.expandable_fit(dev, req)?;
            let id = fit.id;
            // While its pages are gathered the block is out of the bins (so not
            // idle) and marked in use (so a block freed meanwhile does not merge it).
            let pool = self.core.blocks.get(id.0).pool;
            self.core.bins_mut(pool).remove(fit.size, fit.addr, id);
            let b = self.core.blocks.get_mut(id.0);
            b.state = BlockState::Allocated;
            let since = b.freed_at;
            self.core.idle_index.remove(&(since, id.0));
            let mapped = self.vmm.map_range(&mut self.core, dev, fit, rounded);
            if mapped.is_ok() {
                if borrowed {
                    // Used on the requesting stream: its free waits for that
                    // stream's work (as after `record_stream`).
                    self.core.blocks.get_mut(id.0).stream_uses.push(req.stream);
                    self.core.stats.num_blocks_borrowed += 1;
                }
                return Ok(id);
            }
            // Back to the bins, merged with any neighbour a recycling round freed meanwhile.
            self.core.blocks.get_mut(id.0).state = BlockState::Free;
            self.core.merge_into_bins(id);
            if let Err(e) = mapped {
                if !matches!(e, AllocError::OutOfMemory(_)) {
                    return Err(e);
                }
            }
        }
        self.core.stats.num_ooms += 1;
        Err(AllocError::OutOfMemory(Box::new(
            self.oom_report(dev, size, rounded),
        )))
    }

    /// The free block an expandable request is carved from, and whether it
    /// is another stream's (`Config::expandable_borrow`): the pool's own
    /// near fit ([`Expandable::near_fit`]), unless
    /// pages would have to be mapped under it and another stream's free
    /// block over mapped pages can serve; a new range when there is neither.
    fn expandable_fit<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        req: Request,
    ) -> Result<(Entry, bool), AllocError> {
        let Request { pool, rounded, .. } = req;
        let fit = self.core.bins[pool.index()].best_fit(rounded);
        // (The block, where in it the request goes, and whether its pages
        // there are all mapped.) A placement inside the block is cut only
        // once the block is taken: a borrowed block instead leaves it whole.
        let own = match fit {
            Some(fit) => {
                let bins = &self.core.bins[pool.index()];
                let (e, mapped) = self.vmm.near_fit(&self.core, dev, bins, fit, rounded)?;
                Some((e, e.addr, mapped))
            }
            None => None,
        };
        let needs_pages = own.map_or(true, |(_, _, mapped)| !mapped);
        if needs_pages && self.core.config.expandable_borrow {
            if let Some(e) = self.vmm.borrow_fit(&mut self.core, dev, pool, rounded)? {
                return Ok((e, true));
            }
        }
        match own {
            Some((e, at, _)) if at == e.addr => Ok((e, false)),
            Some((Entry { size, addr, id }, at, _)) => {
                let back = Entry {
                    size: addr + size - at,
                    addr: at,
                    id: self.core.split_free(id, at),
                };
                Ok((back, false))
            }
            None => Ok((self.new_range(dev, req)?, false)),
        }
    }
}

impl<E> Core<E> {
    /// Splits the free block `id` of an expandable segment at `at` (a
    /// granule boundary inside it), both parts free and filed; returns the
    /// back part. Used to place a block over idle pages in the middle of a
    /// free block ([`Expandable::place`]).
    #[cold]
    pub(super) fn split_free(&mut self, id: BlockId, at: u64) -> BlockId {
        let g = self.granule();
        let b = self.blocks.get(id.0);
        let (addr, size, seg, pool, since) = (b.addr, b.size, b.segment, b.pool, b.freed_at);
        debug_assert!(b.state == BlockState::Free && addr < at && at < addr + size);
        debug_assert_eq!((at - self.segments.get(seg.0).addr) % g, 0);
        if !b.is_split() {
            self.free_candidates[pool.kind() as usize].remove(&(since, addr, seg.0));
        }
        self.bins_mut(pool).remove(size, addr, id);
        self.idle_index.remove(&(since, id.0));
        let back = self.cut(id, at);
        for (part, start, end) in [(id, addr, at), (back, at, addr + size)] {
            self.bins_mut(pool).insert(end - start, start, part);
            if expandable::holds_whole_page(self.segments.get(seg.0), g, start, end) {
                self.idle_index.insert((since, part.0));
            }
        }
        back
    }

    /// Cuts block `id` (out of the bins) at `at`; returns the back part,
    /// a block of the same state and age.
    pub(super) fn cut(&mut self, id: BlockId, at: u64) -> BlockId {
        let b = self.blocks.get(id.0);
        let (addr, size, seg, pool, since, next, state) = (
            b.addr, b.size, b.segment, b.pool, b.freed_at, b.next, b.state,
        );
        debug_assert!(addr < at && at < addr + size);
        let back = BlockId(self.blocks.insert(Block {
            prev: Some(id),
            next,
            state,
            ..Block::free(at, addr + size - at, seg, pool, since)
        }));
        if let Some(n) = next {
            self.blocks.get_mut(n.0).prev = Some(back);
        }
        let b = self.blocks.get_mut(id.0);
        b.next = Some(back);
        b.size = at - addr;
        back
    }

    /// PyTorch's `get_free_block`: the best fit of the pool, unless it is oversize.
    #[inline(always)]
    pub(super) fn get_free_block(&mut self, pool: PoolId, size: u64) -> Option<BlockId> {
        if self.config.garbage_collection_threshold.is_some() && self.cap.is_some() {
            self.lookups[pool.index()] += 1;
        }
        let max_split = self.config.max_split_size;
        let slack = self.config.max_non_split_rounding;
        let found = self.bins[pool.index()].find(size)?;
        let Entry {
            size: bsize, id, ..
        } = found.entry;
        if size < max_split && bsize >= max_split {
            return None;
        }
        if size >= max_split && bsize >= size.saturating_add(slack) {
            return None;
        }
        self.bins[pool.index()].take(found);
        Some(id)
    }

    pub(super) fn should_split(&self, kind: PoolKind, rounded: u64, remaining: u64) -> bool {
        if self.granularity.is_some() {
            return remaining >= crate::rounding::MIN_BLOCK;
        }
        match kind {
            _ if self.supply.no_split => false,
            PoolKind::Small => remaining >= crate::rounding::MIN_BLOCK,
            PoolKind::Large | PoolKind::Huge => {
                rounded < self.config.max_split_size
                    && remaining > self.config.large_split_remainder
            }
        }
    }

    /// The bytes a free block of `size` hands out for a request of
    /// `rounded`: the request, if the rest is split off, else all of it.
    #[inline]
    pub(super) fn handed_out_size(&self, kind: PoolKind, rounded: u64, size: u64) -> u64 {
        if self.should_split(kind, rounded, size - rounded) {
            rounded
        } else {
            size
        }
    }

    /// Hands out block `id` (already out of the bins), splitting off the remainder if worth it.
    #[inline(always)]
    pub(super) fn alloc_found_block(
        &mut self,
        id: BlockId,
        rounded: u64,
        requested: u64,
    ) -> DevicePtr {
        // Free space of an expandable segment is not "inactive split" memory:
        // not counted. (Every segment is expandable in expandable mode, none otherwise.)
        let expandable = self.granularity.is_some();
        let b = self.blocks.get_mut(id.0);
        // Allocated before any merge below could look at it.
        b.state = BlockState::Allocated;
        b.requested = requested;
        let (addr, size, pool, already_split, next, segment, since) = (
            b.addr,
            b.size,
            b.pool,
            b.is_split(),
            b.next,
            b.segment,
            b.freed_at,
        );
        let kind = pool.kind();
        if !already_split {
            // A whole segment handed out is no longer a free-segment candidate.
            self.free_candidates[kind as usize].remove(&(since, addr, segment.0));
        }
        let remaining = size - rounded;
        let final_size = if self.handed_out_size(kind, rounded, size) < size {
            let gc_base = self.lookups[pool.index()];
            let rest = BlockId(self.blocks.insert(Block {
                prev: Some(id),
                next,
                gc_base,
                ..Block::free(
                    addr + rounded,
                    remaining,
                    segment,
                    pool,
                    if expandable { since } else { self.clock },
                )
            }));
            if let Some(n) = next {
                self.blocks.get_mut(n.0).prev = Some(rest);
            }
            let b = self.blocks.get_mut(id.0);
            b.next = Some(rest);
            b.size = rounded;
            if expandable {
                // A recycling round may have freed the next block while this
                // one was being mapped: merge with it.
                self.merge_into_bins(rest);
            } else {
                // The next block is not free (free neighbours are always merged).
                self.bins_mut(pool).insert(remaining, addr + rounded, rest);
                let s = &mut self.stats;
                if already_split {
                    s.inactive_split_bytes.decrease(kind, rounded);
                } else {
                    s.inactive_split_bytes.increase(kind, remaining);
                    s.inactive_split.increase(kind, 1);
                }
            }
            rounded
        } else {
            if already_split && !expandable {
                self.stats.inactive_split_bytes.decrease(kind, size);
                self.stats.inactive_split.decrease(kind, 1);
            }
            size
        };
        self.live.insert(addr, id);
        self.count_allocated(kind, final_size, true);
        self.count_active(kind, final_size, requested, true);
        self.record_alloc(addr, requested, pool);
        DevicePtr(addr)
    }

    /// Writes an allocation to the trace being recorded, if any.
    #[inline]
    pub(super) fn record_alloc(&mut self, addr: u64, requested: u64, pool: PoolId) {
        if let Some(r) = self.recorder.as_mut() {
            let stream = self.stream_list[pool.stream_slot()];
            r.ids.insert(addr, r.next_id);
            (r.sink)(&TraceEvent::Alloc {
                id: r.next_id,
                bytes: requested,
                stream: stream.0,
            });
            r.next_id += 1;
        }
    }
}
