//! The consistency check of the whole state (`check_invariants`), which
//! tests run after every step: one walk over the segments' blocks tallies
//! what every other structure must agree with, then one function per
//! structure (segment map, blocks, bins, live map, thread caches, pending
//! events, slab lists, statistics) compares.

use super::*;

/// What the walk over the segments' blocks counts.
struct Tally {
    /// The statistics the blocks imply.
    expect: MemoryStats,
    /// Block records reachable from a segment.
    blocks: usize,
    /// Blocks a thread cache holds, and those of them parked.
    held: usize,
    parked: usize,
    /// Per pool: free blocks that belong in its bins.
    free_in_bins: Vec<usize>,
    /// Blocks awaiting events, and the events they await.
    awaiting: usize,
    pending_events: u64,
    /// Slabs listed somewhere.
    listed_slabs: usize,
}

impl<E> State<E> {
    pub(super) fn check_invariants(&self) -> Result<(), String> {
        self.vmm.check_pages(&self.core)?;
        self.core.check_segment_map()?;
        let mut t = Tally {
            expect: MemoryStats::default(),
            blocks: 0,
            held: 0,
            parked: 0,
            free_in_bins: vec![0; self.core.bins.len()],
            awaiting: 0,
            pending_events: 0,
            listed_slabs: 0,
        };
        for &seg in self.core.segment_by_addr.values() {
            self.check_segment(seg, &mut t)?;
        }
        for (kind, size) in self.vmm.pooled_pages() {
            t.expect.reserved_bytes.increase(kind, size);
        }
        self.check_slab_lists(&t)?;
        self.core.check_block_records(&t)?;
        self.core.check_bins(&t)?;
        self.core.check_live_map(&t)?;
        self.check_thread_caches(&t)?;
        self.core.check_pending(&t)?;
        self.core.check_stats(&t)
    }

    /// The blocks of `seg`: linked in address order, tiling it, each in the
    /// place its state says; tallied into `t`.
    fn check_segment(&self, seg: SegmentId, t: &mut Tally) -> Result<(), String> {
        let s = self.core.segments.get(seg.0);
        let kind = s.pool.kind();
        t.expect.segment.increase(kind, 1);
        t.expect
            .reserved_bytes
            .increase(kind, self.core.counted_bytes_in(s));
        let mut cur = Some(s.head);
        let mut prev: Option<BlockId> = None;
        let mut at = s.addr;
        let mut prev_free = false;
        let split = self.core.blocks.get(s.head.0).next.is_some() && !s.is_expandable();
        if let Some(slab) = s.slab() {
            self.slabs.check_slab(&self.core, seg)?;
            t.listed_slabs += usize::from(slab.listed != Listed::Nowhere);
        }
        while let Some(id) = cur {
            let b = self.core.blocks.get(id.0);
            t.blocks += 1;
            t.held += usize::from(b.holder.is_some());
            if b.holder.is_some() && !matches!(b.state, BlockState::Allocated | BlockState::Parked)
            {
                return Err(format!(
                    "{:?} block at {:#x} held by a thread cache",
                    b.state, b.addr
                ));
            }
            if b.prev != prev || b.segment != seg || b.pool != s.pool {
                return Err(format!("block {id:?} at {:#x} has broken links", b.addr));
            }
            if b.slab != s.is_slab() {
                return Err(format!(
                    "block at {:#x} is marked as a slab's: {}, its segment is a slab: {}",
                    b.addr,
                    b.slab,
                    s.is_slab()
                ));
            }
            if b.addr != at || b.size == 0 || b.addr % 512 != 0 || b.size % 512 != 0 {
                return Err(format!(
                    "block {id:?} at {:#x}+{} does not tile its segment (expected {at:#x})",
                    b.addr, b.size
                ));
            }
            let free = b.state == BlockState::Free;
            if free && prev_free && !b.slab {
                return Err(format!("free neighbours left unmerged at {:#x}", b.addr));
            }
            prev_free = free;
            self.core.check_block(s, id, split, t)?;
            at += b.size;
            prev = Some(id);
            cur = b.next;
        }
        if at != s.addr + s.size {
            return Err(format!(
                "blocks of segment {:#x} cover {} of {} bytes",
                s.addr,
                at - s.addr,
                s.size
            ));
        }
        Ok(())
    }

    /// Each slab is listed where its state says (`check_slab`); nothing else is.
    fn check_slab_lists(&self, t: &Tally) -> Result<(), String> {
        if self.slabs.listed_slabs() != t.listed_slabs {
            return Err(format!(
                "{} entries in the slab lists but {} slabs listed",
                self.slabs.listed_slabs(),
                t.listed_slabs
            ));
        }
        Ok(())
    }

    /// The thread caches' count of the blocks they hold.
    fn check_thread_caches(&self, t: &Tally) -> Result<(), String> {
        if t.held != self.caches.cached_blocks() {
            return Err(format!(
                "{} blocks held by thread caches but {} counted",
                t.held,
                self.caches.cached_blocks()
            ));
        }
        Ok(())
    }
}

impl<E> Core<E> {
    /// Every segment filed under its address, none overlapping the next.
    fn check_segment_map(&self) -> Result<(), String> {
        if self.segment_by_addr.len() != self.segments.len() {
            return Err(format!(
                "{} segments but {} in the address map",
                self.segments.len(),
                self.segment_by_addr.len()
            ));
        }
        let mut last_end = 0u64;
        for (&saddr, &seg) in &self.segment_by_addr {
            let s = self.segments.get(seg.0);
            if s.addr != saddr {
                return Err(format!(
                    "segment {seg:?} filed under {saddr:#x} but starts at {:#x}",
                    s.addr
                ));
            }
            if s.addr < last_end {
                return Err(format!(
                    "segment at {:#x} overlaps the previous one",
                    s.addr
                ));
            }
            last_end = s.addr + s.size;
        }
        Ok(())
    }

    /// One block against the structure its state puts it in (bins, live
    /// map, a thread cache, the event queues); tallied into `t`.
    fn check_block(
        &self,
        s: &Segment,
        id: BlockId,
        split: bool,
        t: &mut Tally,
    ) -> Result<(), String> {
        let b = self.blocks.get(id.0);
        let kind = s.pool.kind();
        match b.state {
            BlockState::Free => {
                let in_bins = self.bins[b.pool.index()].contains(b.size, b.addr, id);
                // (A slab's free blocks are checked by `check_slab`.)
                if in_bins == b.slab {
                    return Err(format!(
                        "free block at {:#x} {} its bins",
                        b.addr,
                        if b.slab {
                            "of a slab is in"
                        } else {
                            "missing from"
                        }
                    ));
                }
                t.free_in_bins[b.pool.index()] += usize::from(!b.slab);
                if split {
                    t.expect.inactive_split.increase(kind, 1);
                    t.expect.inactive_split_bytes.increase(kind, b.size);
                }
                if self.live.contains(b.addr) {
                    return Err(format!("free block at {:#x} is in the live map", b.addr));
                }
            }
            BlockState::Allocated | BlockState::AwaitingEvents | BlockState::Parked
                if self.mapped_bytes_in(s, b.addr, b.addr + b.size) != b.size =>
            {
                return Err(format!(
                    "block at {:#x} in use but not entirely mapped",
                    b.addr
                ));
            }
            BlockState::Allocated => {
                if self.live.get(b.addr) != Some(id) {
                    return Err(format!(
                        "allocated block at {:#x} is not in the live map",
                        b.addr
                    ));
                }
                let e = &mut t.expect;
                e.allocation.increase(kind, 1);
                e.allocated_bytes.increase(kind, b.size);
                e.active.increase(kind, 1);
                e.active_bytes.increase(kind, b.size);
                e.requested_bytes.increase(kind, b.requested);
            }
            BlockState::Parked => {
                if b.holder.is_none() || self.live.get(b.addr) != Some(id) {
                    return Err(format!(
                        "parked block at {:#x} has no thread cache or is not in the live map",
                        b.addr
                    ));
                }
                t.parked += 1;
                if split {
                    t.expect.inactive_split.increase(kind, 1);
                    t.expect.inactive_split_bytes.increase(kind, b.size);
                }
            }
            BlockState::AwaitingEvents => {
                if (b.pending_events == 0) != self.deferred.contains(&id) {
                    return Err(format!(
                        "block at {:#x} awaits {} events (deferred: {})",
                        b.addr,
                        b.pending_events,
                        self.deferred.contains(&id)
                    ));
                }
                t.awaiting += 1;
                t.pending_events += u64::from(b.pending_events);
                let e = &mut t.expect;
                e.active.increase(kind, 1);
                e.active_bytes.increase(kind, b.size);
                e.requested_bytes.increase(kind, b.requested);
            }
            BlockState::Aliased => {
                // (That its granule's page is shared is `check_pages`'.)
                if self.mapped_bytes_in(s, b.addr, b.addr + b.size) != b.size
                    || self.live.contains(b.addr)
                {
                    return Err(format!(
                        "aliased block at {:#x} is not mapped or is in the live map",
                        b.addr
                    ));
                }
            }
        }
        Ok(())
    }

    /// No block record outside the segments' lists.
    fn check_block_records(&self, t: &Tally) -> Result<(), String> {
        if t.blocks != self.blocks.len() {
            return Err(format!(
                "{} block records but {} reachable from segments",
                self.blocks.len(),
                t.blocks
            ));
        }
        Ok(())
    }

    /// The bins hold exactly the free blocks of their pool.
    fn check_bins(&self, t: &Tally) -> Result<(), String> {
        for (i, bins) in self.bins.iter().enumerate() {
            let n = bins.len();
            if n != t.free_in_bins[i] {
                return Err(format!(
                    "pool {i} bins hold {n} blocks but {} free blocks belong to it",
                    t.free_in_bins[i]
                ));
            }
        }
        Ok(())
    }

    /// The live map holds the allocated and the parked blocks, nothing else.
    fn check_live_map(&self, t: &Tally) -> Result<(), String> {
        let allocations = t.expect.allocation.all().current as usize;
        if self.live.len() != allocations + t.parked {
            return Err(format!(
                "live map has {} entries for {allocations} allocations and {} parked blocks",
                self.live.len(),
                t.parked
            ));
        }
        Ok(())
    }

    /// The event queues against the blocks that await events.
    fn check_pending(&self, t: &Tally) -> Result<(), String> {
        if t.awaiting != self.pending_blocks {
            return Err(format!(
                "{} blocks await events but {} are counted",
                t.awaiting, self.pending_blocks
            ));
        }
        let queued: usize = self.pending.iter().map(|(_, q)| q.len()).sum();
        if queued as u64 != t.pending_events {
            return Err(format!(
                "{queued} events queued but blocks await {}",
                t.pending_events
            ));
        }
        Ok(())
    }

    /// The statistics: what the blocks imply, and each one consistent.
    fn check_stats(&self, t: &Tally) -> Result<(), String> {
        if t.expect.currents() != self.stats.currents() {
            return Err(format!(
                "stats differ from what the blocks recompute: stats {:?}, blocks {:?}",
                self.stats.currents(),
                t.expect.currents()
            ));
        }
        for (name, arr) in self.stats.arrays() {
            for s in &arr.stats() {
                if s.peak < s.current || s.allocated - s.freed != s.current {
                    return Err(format!("stat {name} is inconsistent: {s:?}"));
                }
            }
        }
        Ok(())
    }
}
