//! The consistency check of the whole state (`check_invariants`), which
//! tests run after every step.

use super::*;

impl<E> State<E> {
    pub(super) fn check_invariants(&self) -> Result<(), String> {
        let mut expect = MemoryStats::default();
        let mut seen_blocks = 0;
        let (mut held, mut parked) = (0usize, 0usize);
        let mut free_blocks = vec![0usize; self.bins.len()];
        let mut awaiting = 0usize;
        let mut pending_events = 0u64;
        let mut last_end = 0u64;
        let mut listed = 0usize;
        self.check_pages()?;
        if self.segment_by_addr.len() != self.segments.len() {
            return Err(format!(
                "{} segments but {} in the address map",
                self.segments.len(),
                self.segment_by_addr.len()
            ));
        }
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
            let kind = s.pool.kind();
            expect.segment.increase(kind, 1);
            expect
                .reserved_bytes
                .increase(kind, self.mapped_bytes_in(s, s.addr, s.addr + s.size));
            let mut cur = Some(s.head);
            let mut prev: Option<BlockId> = None;
            let mut at = s.addr;
            let mut prev_free = false;
            let split = self.blocks.get(s.head.0).next.is_some() && !s.is_expandable();
            if let Some(slab) = s.slab() {
                self.check_slab(seg)?;
                listed += usize::from(slab.listed != Listed::Nowhere);
            }
            while let Some(id) = cur {
                let b = self.blocks.get(id.0);
                seen_blocks += 1;
                held += usize::from(b.holder.is_some());
                if b.holder.is_some()
                    && !matches!(b.state, BlockState::Allocated | BlockState::Parked)
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
                match b.state {
                    BlockState::Free => {
                        let in_bins = self.bins[b.pool.index()]
                            .as_ref()
                            .is_some_and(|bins| bins.iter().any(|e| e == (b.size, b.addr, id)));
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
                        free_blocks[b.pool.index()] += usize::from(!b.slab);
                        if split {
                            expect.inactive_split.increase(kind, 1);
                            expect.inactive_split_bytes.increase(kind, b.size);
                        }
                        if self.live.contains(b.addr) {
                            return Err(format!("free block at {:#x} is in the live map", b.addr));
                        }
                    }
                    BlockState::Allocated | BlockState::AwaitingEvents
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
                        expect.allocation.increase(kind, 1);
                        expect.allocated_bytes.increase(kind, b.size);
                        expect.active.increase(kind, 1);
                        expect.active_bytes.increase(kind, b.size);
                        expect.requested_bytes.increase(kind, b.requested);
                    }
                    BlockState::Parked => {
                        if b.holder.is_none() || self.live.get(b.addr) != Some(id) {
                            return Err(format!(
                                "parked block at {:#x} has no thread cache or is not in the live map",
                                b.addr
                            ));
                        }
                        parked += 1;
                        if split {
                            expect.inactive_split.increase(kind, 1);
                            expect.inactive_split_bytes.increase(kind, b.size);
                        }
                    }
                    BlockState::AwaitingEvents => {
                        if b.pending_events == 0 {
                            return Err(format!("block at {:#x} awaits no events", b.addr));
                        }
                        awaiting += 1;
                        pending_events += u64::from(b.pending_events);
                        expect.active.increase(kind, 1);
                        expect.active_bytes.increase(kind, b.size);
                        expect.requested_bytes.increase(kind, b.requested);
                    }
                }
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
        }
        for &(_, kind, size) in &self.vmm.page_pool {
            expect.reserved_bytes.increase(kind, size);
        }
        // Each slab is listed where its state says (`check_slab`); nothing else is.
        if self.listed_slabs() != listed {
            return Err(format!(
                "{} entries in the slab lists but {listed} slabs listed",
                self.listed_slabs()
            ));
        }
        if seen_blocks != self.blocks.len() {
            return Err(format!(
                "{} block records but {} reachable from segments",
                self.blocks.len(),
                seen_blocks
            ));
        }
        for (i, bins) in self.bins.iter().enumerate() {
            let n = bins.as_ref().map_or(0, |b| b.len());
            if n != free_blocks[i] {
                return Err(format!(
                    "pool {i} bins hold {n} blocks but {} free blocks belong to it",
                    free_blocks[i]
                ));
            }
        }
        if self.live.len() != expect.allocation.all().current as usize + parked {
            return Err(format!(
                "live map has {} entries for {} allocations and {parked} parked blocks",
                self.live.len(),
                expect.allocation.all().current
            ));
        }
        if held != self.caches.cached_blocks {
            return Err(format!(
                "{held} blocks held by thread caches but {} counted",
                self.caches.cached_blocks
            ));
        }
        if awaiting != self.pending_blocks {
            return Err(format!(
                "{awaiting} blocks await events but {} are counted",
                self.pending_blocks
            ));
        }
        let queued: usize = self.pending.iter().map(|(_, q)| q.len()).sum();
        if queued as u64 != pending_events {
            return Err(format!(
                "{queued} events queued but blocks await {pending_events}"
            ));
        }
        if expect.currents() != self.stats.currents() {
            return Err(format!(
                "stats differ from what the blocks recompute: stats {:?}, blocks {:?}",
                self.stats.currents(),
                expect.currents()
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
