//! The free path: misuse told apart, blocks other streams used guarded by
//! events, merging with free neighbours into the bins, and event processing.

use super::*;

impl<E> State<E> {
    // Inlined into the locked wrapper, as `malloc`.
    #[inline(always)]
    pub(super) fn free<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        ptr: DevicePtr,
        own: Option<SlotId>,
    ) -> Result<u64, AllocError> {
        self.core.clock += 1;
        // One map operation on the common path; a parked block goes back in.
        let Some(id) = self.core.live.remove(ptr.0) else {
            return Err(self.bad_pointer(ptr));
        };
        // One read of the record: taking the block back from a thread cache
        // or parking it changes neither its size, its pool nor its streams.
        let (size, pool, holder, shared) = {
            let b = self.core.blocks.get(id.0);
            (b.size, b.pool, b.holder, !b.stream_uses.is_empty())
        };
        if let Some(holder) = holder {
            if let Err(e) = self.caches.take_back(&mut self.core, holder, ptr.0) {
                self.core.live.insert(ptr.0, id);
                return Err(e);
            }
        }
        // (Taking the block back synced its requested size from the thread cache.)
        let requested = self.core.blocks.get(id.0).requested;
        if let Some(slot) = own {
            if self.caches.should_park(&self.core, slot, id) {
                self.core.live.insert(ptr.0, id);
                self.park(slot, id);
                return Ok(requested);
            }
        }
        // A block used on other streams is guarded by an event on each; the
        // device calls come before any change, so that a failure leaves the
        // block allocated and the free can be retried. While one of those
        // streams is captured into a CUDA graph, the guard waits.
        let deferred = shared && self.core.uses_capturing(dev, id);
        let events = if shared && !deferred {
            match self.core.guard_events(dev, id) {
                Ok(events) => events,
                Err(e) => {
                    self.core.live.insert(ptr.0, id);
                    return Err(e);
                }
            }
        } else {
            Vec::new()
        };
        if !self.core.pins.is_empty() {
            self.core.pins.release(id); // Note [Shared blocks are pinned]
        }
        self.caches.shadow_free(size);
        let kind = pool.kind();
        self.core.count_allocated(kind, size, false);
        if self.core.granularity.is_some() {
            self.vmm.mark_free(&mut self.core, dev, pool);
        }
        if let Some(r) = self.core.recorder.as_mut() {
            if let Some(tid) = r.ids.remove(&ptr.0) {
                (r.sink)(&TraceEvent::Free { id: tid });
            }
        }
        if deferred {
            self.core.defer_guard(id);
            return Ok(requested);
        }
        // Almost no block was used on another stream: back to the pool at once.
        if events.is_empty() {
            if shared {
                self.core.blocks.get_mut(id.0).stream_uses.take();
            }
            self.recycle_block(dev, id);
            return Ok(requested);
        }
        self.core.await_events(id, events);
        self.core.pending_blocks += 1;
        Ok(requested)
    }

    /// Records the guarding events of deferred blocks whose streams are no
    /// longer captured ([`Core::deferred`]); the others stay deferred.
    #[cold]
    fn guard_deferred<D: Device<Event = E>>(&mut self, dev: &D) -> Result<(), AllocError> {
        let mut result = Ok(());
        for id in std::mem::take(&mut self.core.deferred) {
            if result.is_err() || self.core.uses_capturing(dev, id) {
                self.core.deferred.push(id);
                continue;
            }
            match self.core.guard_events(dev, id) {
                Ok(events) if events.is_empty() => {
                    // Made safe by a synchronize instead: free now.
                    self.core.blocks.get_mut(id.0).stream_uses.take();
                    self.core.pending_blocks -= 1;
                    self.recycle_block(dev, id);
                }
                Ok(events) => self.core.await_events(id, events),
                Err(e) => {
                    self.core.deferred.push(id);
                    result = Err(e);
                }
            }
        }
        result
    }

    /// Without caching, a freed block's segment goes back to the device at
    /// once; if the device refuses, the segment stays cached (whole and
    /// consistent) for a later `empty_cache`, and a notice says so.
    #[cold]
    pub(super) fn release_or_keep<D: Device<Event = E>>(&mut self, dev: &D, seg: SegmentId) {
        if let Err(e) = self.release_segment(dev, seg) {
            self.core.notice(format!(
                "a segment stays cached: the device could not free it ({e})"
            ));
        }
    }

    /// Counts one locked operation for the thread caches' review, and
    /// flushes the caches when the review turns them off. Returns the new
    /// setting when it changes.
    #[inline]
    pub(super) fn review_thread_caches(&mut self) -> Option<bool> {
        let decision = self.caches.review();
        if decision == Some(false) {
            self.flush_thread_caches();
        }
        decision
    }

    /// Parks the freed block `id` in thread cache `slot`, returning the
    /// block it evicts (if the slot was full) to the bins.
    pub(super) fn park(&mut self, slot: SlotId, id: BlockId) {
        if let Some(old) = self.caches.park(&mut self.core, slot, id) {
            self.unpark(old);
        }
    }

    /// Returns a parked block to the bins, merging it; it stays idle since
    /// its caller freed it, not since now.
    fn unpark(&mut self, id: BlockId) {
        let (kind, slab, parked_at) = self.caches.unpark(&mut self.core, id);
        self.file_free(id, kind, slab);
        let b = self.core.blocks.get_mut(id.0);
        b.freed_at = parked_at;
        let seg = b.segment;
        self.core.note_maybe_free(seg);
    }

    /// Before a large request is placed, the calling thread's parked large
    /// blocks go back to the bins, so that the placement sees every free
    /// large block.
    pub(super) fn flush_own_large(&mut self, own: SlotId) {
        for id in self.caches.take_own_large(&mut self.core, own) {
            self.unpark(id);
        }
    }

    /// Returns every parked block to the bins, and forgets the slots of
    /// threads that ended with nothing in them.
    pub(super) fn flush_thread_caches(&mut self) {
        for i in 0..self.caches.slot_count() {
            for id in self.caches.take_parked(&mut self.core, i) {
                self.unpark(id);
            }
        }
    }

    /// Returns a block to its pool, merging it with free neighbours (a
    /// slab's chunk goes back to its slab).
    pub(super) fn free_block(&mut self, id: BlockId) {
        let (kind, slab) = self.core.release_block(id);
        self.file_free(id, kind, slab);
    }

    /// Files the free block `id` where free blocks of its kind go: a slab's
    /// chunk in its slab, any other block in the bins, merged.
    #[inline]
    pub(super) fn file_free(&mut self, id: BlockId, kind: PoolKind, slab: bool) {
        if slab {
            self.slabs.slab_free(&mut self.core, id);
        } else {
            self.core.merge_counted(id, kind);
        }
    }

    /// The error for a pointer that is no live allocation's start. The
    /// thread caches are synced first: a block a thread cache holds is
    /// parked (freed) or handed out again by that thread without the
    /// allocator's lock, and only its slot knows which, so an interior
    /// pointer into a parked block is told from one into a live block.
    #[cold]
    fn bad_pointer(&mut self, ptr: DevicePtr) -> AllocError {
        self.caches.sync_thread_caches(&mut self.core);
        self.core.classify_bad_pointer(ptr)
    }

    pub(super) fn record_stream(
        &mut self,
        ptr: DevicePtr,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        let Some(id) = self.core.live.get(ptr.0) else {
            return Err(self.bad_pointer(ptr));
        };
        if let Some(holder) = self.core.blocks.get(id.0).holder {
            // A block another stream uses must not be parked: the allocator keeps it.
            self.caches.take_back(&mut self.core, holder, ptr.0)?;
        }
        let owner = self
            .core
            .segments
            .get(self.core.blocks.get(id.0).segment.0)
            .stream;
        let b = self.core.blocks.get_mut(id.0);
        if stream != owner && !b.stream_uses.contains(&stream) {
            b.stream_uses.push(stream);
        }
        Ok(())
    }

    /// Events of these blocks completed: recycle each block whose last event it was.
    pub(super) fn events_done<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        done: Vec<BlockId>,
    ) -> Result<(), AllocError> {
        // Every block is recycled even if the device refuses to free a
        // segment on the way (that segment stays cached).
        for id in done {
            if self.core.event_done(id) {
                self.recycle_block(dev, id);
            }
        }
        Ok(())
    }

    /// Block `id`, freed and safe to reuse, goes back to its pool; without
    /// caching its segment goes back to the device.
    #[inline]
    pub(super) fn recycle_block<D: Device<Event = E>>(&mut self, dev: &D, id: BlockId) {
        self.free_block(id);
        if !self.core.config.caching {
            let seg = self.core.blocks.get(id.0).segment;
            self.release_or_keep(dev, seg);
        }
    }

    pub(super) fn process_events<D: Device<Event = E>>(
        &mut self,
        dev: &D,
    ) -> Result<(), AllocError> {
        if !self.core.deferred.is_empty() {
            self.guard_deferred(dev)?;
        }
        let mut done = Vec::new();
        let mut result = Ok(());
        'streams: for (_, queue) in &mut self.core.pending {
            while let Some((ev, _)) = queue.front() {
                match dev.event_completed(ev) {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => {
                        // The events already taken are recycled below all the same.
                        result = Err(e.into());
                        break 'streams;
                    }
                }
                let (ev, id) = queue.pop_front().expect("front exists");
                dev.release_event(ev);
                done.push(id);
            }
        }
        self.core.pending.retain(|(_, q)| !q.is_empty());
        self.events_done(dev, done)?;
        result
    }

    /// Waits for every pending event (PyTorch's `synchronize_and_free_events`).
    pub(super) fn wait_all_events<D: Device<Event = E>>(
        &mut self,
        dev: &D,
    ) -> Result<(), AllocError> {
        self.core.stats.num_sync_all_streams += 1;
        if !self.core.deferred.is_empty() {
            // Blocks freed during a capture that has ended: guarded now, waited for below.
            self.guard_deferred(dev)?;
        }
        while let Some(e) = self.core.stream_waits.pop() {
            if let Err(err) = dev.wait_event(&e) {
                self.core.stream_waits.push(e);
                return Err(err.into());
            }
            dev.release_event(e);
        }
        let mut done = Vec::new();
        let mut result = Ok(());
        for (stream, mut queue) in std::mem::take(&mut self.core.pending) {
            while result.is_ok() {
                let Some((ev, id)) = queue.pop_front() else {
                    break;
                };
                match dev.wait_event(&ev) {
                    Ok(()) => {
                        dev.release_event(ev);
                        done.push(id);
                    }
                    Err(e) => {
                        // Keep it pending, so that nothing is reused unsafely.
                        queue.push_front((ev, id));
                        result = Err(e.into());
                    }
                }
            }
            if !queue.is_empty() {
                self.core.pending.push((stream, queue));
            }
        }
        self.events_done(dev, done)?;
        result
    }
}

impl<E> Core<E> {
    /// Marks block `id` free and no longer active, for the caller to file it
    /// (see [`State::file_free`]); returns its pool kind and whether it is a
    /// slab's chunk.
    pub(super) fn release_block(&mut self, id: BlockId) -> (PoolKind, bool) {
        let expandable = self.granularity.is_some();
        let b = self.blocks.get_mut(id.0);
        b.state = BlockState::Free;
        if expandable {
            // Idle from now (merging keeps the latest of the parts).
            b.freed_at = self.clock;
        }
        let (size, requested, kind, slab) = (
            b.size,
            std::mem::take(&mut b.requested),
            b.pool.kind(),
            b.slab,
        );
        self.count_active(kind, size, requested, false);
        (kind, slab)
    }

    /// Whether any stream of this allocator is being captured into a CUDA graph.
    #[cold]
    pub(super) fn any_stream_capturing<D: Device<Event = E>>(&self, dev: &D) -> bool {
        self.stream_list.iter().any(|&s| dev.stream_capturing(s))
    }

    /// Whether a stream block `id` was used on is being captured.
    #[inline]
    pub(super) fn uses_capturing<D: Device<Event = E>>(&self, dev: &D, id: BlockId) -> bool {
        self.blocks
            .get(id.0)
            .stream_uses
            .iter()
            .any(|&s| dev.stream_capturing(s))
    }

    /// Block `id`, just freed, awaits guarding events to be recorded once
    /// no stream it was used on is captured.
    #[cold]
    pub(super) fn defer_guard(&mut self, id: BlockId) {
        let b = self.blocks.get_mut(id.0);
        b.state = BlockState::AwaitingEvents;
        b.pending_events = 0;
        self.deferred.push(id);
        self.pending_blocks += 1;
    }

    /// Block `id` awaits `events` (at least one), each queued on its stream.
    pub(super) fn await_events(&mut self, id: BlockId, events: Vec<(StreamId, E)>) {
        let b = self.blocks.get_mut(id.0);
        b.stream_uses.take();
        b.state = BlockState::AwaitingEvents;
        b.pending_events = events.len() as u32;
        for (s, ev) in events {
            match self.pending.iter_mut().find(|(st, _)| *st == s) {
                Some((_, q)) => q.push_back((ev, id)),
                None => self.pending.push((s, VecDeque::from([(ev, id)]))),
            }
        }
    }

    /// One event guarding block `id` completed; returns whether it was the
    /// block's last (the block is then no longer awaiting events, and is to
    /// be freed).
    pub(super) fn event_done(&mut self, id: BlockId) -> bool {
        let b = self.blocks.get_mut(id.0);
        b.pending_events -= 1;
        if b.pending_events > 0 {
            return false;
        }
        self.pending_blocks -= 1;
        true
    }

    /// Tells apart a double free, an interior pointer and a foreign pointer.
    pub(super) fn classify_bad_pointer(&self, ptr: DevicePtr) -> AllocError {
        let Some((_, &seg)) = self.segment_by_addr.range(..=ptr.0).next_back() else {
            return AllocError::UnknownPointer(ptr);
        };
        let s = self.segments.get(seg.0);
        if ptr.0 >= s.addr + s.size {
            return AllocError::UnknownPointer(ptr);
        }
        let mut cur = Some(s.head);
        while let Some(id) = cur {
            let b = self.blocks.get(id.0);
            if ptr.0 >= b.addr && ptr.0 < b.addr + b.size {
                // (The thread caches were synced by the caller: a parked
                // block is one a thread cache holds freed.)
                return match (b.state, ptr.0 == b.addr) {
                    (BlockState::Allocated, false) => AllocError::InteriorPointer {
                        ptr,
                        block: DevicePtr(b.addr),
                    },
                    (_, true) => AllocError::DoubleFree(ptr),
                    _ => AllocError::UnknownPointer(ptr),
                };
            }
            cur = b.next;
        }
        AllocError::UnknownPointer(ptr)
    }

    /// Records an event on every stream that used block `id` besides its
    /// own. If one cannot be recorded, the device is synchronized instead
    /// (the block is then safe to reuse at once: no events). If that fails
    /// too, the events recorded are given back and the error returned:
    /// nothing has changed.
    #[cold]
    pub(super) fn guard_events<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        id: BlockId,
    ) -> Result<Vec<(StreamId, E)>, AllocError> {
        let uses = self.blocks.get(id.0).stream_uses.to_vec();
        let mut events = Vec::with_capacity(uses.len());
        for s in uses {
            match dev.record_event(s) {
                Ok(ev) => events.push((s, ev)),
                Err(_) => {
                    // Cannot guard the block with an event: make it safe the slow way.
                    let synced = dev.synchronize();
                    for (_, ev) in events.drain(..) {
                        dev.release_event(ev);
                    }
                    synced?;
                    return Ok(Vec::new());
                }
            }
        }
        Ok(events)
    }

    /// Adds a notice (kept to a bounded number; see [`CachingAllocator::notices`]).
    #[cold]
    pub(super) fn notice(&mut self, text: String) {
        if self.notices.len() < MAX_NOTICES {
            self.notices.push(text);
        }
    }

    /// Counts a block of `size` bytes handed out (`up`) or given back by its caller.
    pub(super) fn count_allocated(&mut self, kind: PoolKind, size: u64, up: bool) {
        let oversize = size >= self.config.max_split_size;
        let s = &mut self.stats;
        if up {
            s.allocation.increase(kind, 1);
            s.allocated_bytes.increase(kind, size);
            if oversize {
                s.oversize_allocations.increase(1);
            }
        } else {
            s.allocation.decrease(kind, 1);
            s.allocated_bytes.decrease(kind, size);
            if oversize {
                s.oversize_allocations.decrease(1);
            }
        }
    }

    /// Counts a block becoming active (`up`: handed out) or inactive (no
    /// event guards it any more), with the caller's requested bytes.
    pub(super) fn count_active(&mut self, kind: PoolKind, size: u64, requested: u64, up: bool) {
        let s = &mut self.stats;
        if up {
            s.active.increase(kind, 1);
            s.active_bytes.increase(kind, size);
            s.requested_bytes.increase(kind, requested);
        } else {
            s.active.decrease(kind, 1);
            s.active_bytes.decrease(kind, size);
            s.requested_bytes.decrease(kind, requested);
        }
    }

    /// [`Core::merge_into_bins`], with the change in inactive split blocks counted.
    /// `kind` is the block's pool kind (the callers have it at hand).
    pub(super) fn merge_counted(&mut self, id: BlockId, kind: PoolKind) {
        let (net_blocks, net_bytes) = self.merge_into_bins(id);
        // The sign depends on which neighbours were free: no branch on it.
        self.stats.inactive_split.add(kind, net_blocks);
        self.stats.inactive_split_bytes.add(kind, net_bytes);
    }

    /// Merges the free block `id` with its free neighbours and files the
    /// result in the bins. Returns the change in inactive split blocks and
    /// bytes (zero in expandable segments, where they are not counted).
    pub(super) fn merge_into_bins(&mut self, id: BlockId) -> (i64, i64) {
        // Disjoint borrows of the fields: one bins lookup, no repeated
        // record lookups for the block itself.
        let Core {
            blocks,
            segments,
            bins,
            lookups,
            clock,
            granularity,
            idle_index,
            free_candidates,
            ..
        } = self;
        let b = blocks.get(id.0);
        let (pool, mut addr, mut size) = (b.pool, b.addr, b.size);
        let (mut prev, mut next) = (b.prev, b.next);
        let mut since = b.freed_at;
        let bins = &mut bins[pool.index()];
        let mut net_blocks: i64 = 0;
        let mut net_bytes: i64 = 0;
        if let Some(p) = prev {
            let pb = blocks.get(p.0);
            if pb.state == BlockState::Free {
                let (psize, paddr, pprev) = (pb.size, pb.addr, pb.prev);
                bins.remove(psize, paddr, p);
                if granularity.is_some() {
                    idle_index.remove(&(pb.freed_at, p.0));
                    since = since.max(pb.freed_at);
                }
                addr = paddr;
                size += psize;
                prev = pprev;
                match pprev {
                    Some(pp) => blocks.get_mut(pp.0).next = Some(id),
                    None => segments.get_mut(blocks.get(id.0).segment.0).head = id,
                }
                blocks.discard(p.0);
                net_blocks -= 1;
                net_bytes -= psize as i64;
            }
        }
        if let Some(n) = next {
            let nb = blocks.get(n.0);
            if nb.state == BlockState::Free {
                let (nsize, naddr, nnext) = (nb.size, nb.addr, nb.next);
                bins.remove(nsize, naddr, n);
                if granularity.is_some() {
                    idle_index.remove(&(nb.freed_at, n.0));
                    since = since.max(nb.freed_at);
                }
                size += nsize;
                next = nnext;
                if let Some(nn) = nnext {
                    blocks.get_mut(nn.0).prev = Some(id);
                }
                blocks.discard(n.0);
                net_blocks -= 1;
                net_bytes -= nsize as i64;
            }
        }
        let b = blocks.get_mut(id.0);
        b.addr = addr;
        b.size = size;
        b.prev = prev;
        b.next = next;
        b.gc_base = lookups[pool.index()];
        bins.insert(size, addr, id);
        if let Some(g) = *granularity {
            // Idle since the latest of the merged parts froze (a split-off
            // rest keeps its block's age); indexed if it holds a whole page.
            b.freed_at = since;
            let seg = segments.get(b.segment.0);
            if expandable::holds_whole_page(seg, g, addr, addr + size) {
                idle_index.insert((since, id.0));
            }
            return (0, 0);
        }
        b.freed_at = *clock;
        // The merged block counts as inactive split if it shares its segment.
        let split = prev.is_some() || next.is_some();
        if !split {
            free_candidates[pool.kind() as usize].insert((*clock, addr, b.segment.0));
        }
        net_blocks += i64::from(split);
        net_bytes += if split { size as i64 } else { 0 };
        (net_blocks, net_bytes)
    }
}
