//! Setting an allocator's blocks back to an earlier layout: what CUDA graph
//! trees ask of a graph's private pool when they record a second path from
//! an earlier point (PyTorch's checkpointed pool state). The layout is a
//! [`Snapshot`] taken earlier; restoring it re-creates its allocated blocks
//! at their addresses, so that a graph replayed afterwards finds its memory
//! where it was captured.

use super::{CachingAllocator, Core, State};
use crate::block::{Block, BlockId, BlockState, SegmentId};
use crate::device::{Device, DevicePtr};
use crate::error::AllocError;
use crate::report::{BlockSnapshot, SegmentSnapshot, Snapshot};

impl<D: Device> CachingAllocator<D> {
    /// Sets the blocks of every segment in `layout` (a [`Snapshot`] of this
    /// allocator taken earlier) back to what `layout` shows: its allocated
    /// blocks (allocated or awaiting events then) are allocated again at
    /// their addresses with their requested sizes, its free blocks are free.
    /// Segments not in `layout` stay as they are.
    ///
    /// Nothing may be allocated or awaiting events, every segment of `layout`
    /// must still exist, entirely free, and its blocks must tile it; plain
    /// segments only (no expandable segments, no slabs). Otherwise nothing
    /// changes and [`AllocError::BadLayout`] says why. Returns the addresses
    /// now allocated, which the caller frees like any allocation.
    pub fn restore_layout(&self, layout: &Snapshot) -> Result<Vec<DevicePtr>, AllocError> {
        let st = &mut *self.state.lock();
        st.flush_thread_caches();
        st.check_restorable(layout).map_err(AllocError::BadLayout)?;
        let mut out = Vec::new();
        for seg in &layout.segments {
            st.core.restore_segment(seg, &mut out);
        }
        Ok(out)
    }
}

impl<E> State<E> {
    /// Why `layout` cannot be restored now, if it cannot.
    fn check_restorable(&self, layout: &Snapshot) -> Result<(), String> {
        if self.core.granularity.is_some() {
            return Err("expandable segments cannot be restored to a layout".into());
        }
        let allocated = self.core.stats.allocated_bytes.all().current;
        if allocated != 0 || self.core.pending_blocks != 0 || self.caches.cached_blocks() != 0 {
            return Err(format!(
                "{allocated} bytes are allocated and {} blocks await events: free them first",
                self.core.pending_blocks
            ));
        }
        for seg in &layout.segments {
            let at = seg.address;
            let Some(&id) = self.core.segment_by_addr.get(&at.0) else {
                return Err(format!("no segment at {at} any more"));
            };
            let s = self.core.segments.get(id.0);
            if s.size != seg.total_size || s.is_slab() {
                return Err(format!("the segment at {at} is not the one in the layout"));
            }
            let head = self.core.blocks.get(s.head.0);
            if head.next.is_some() || head.state != BlockState::Free {
                return Err(format!("the segment at {at} is not entirely free"));
            }
            tiles(seg).map_err(|why| format!("the layout's segment at {at}: {why}"))?;
        }
        Ok(())
    }
}

/// Whether a layout's block was in use when the layout was taken.
fn is_allocated(b: &BlockSnapshot) -> bool {
    matches!(b.state, BlockState::Allocated | BlockState::AwaitingEvents)
}

/// Checks that `seg`'s blocks cover it exactly, in order.
fn tiles(seg: &SegmentSnapshot) -> Result<(), String> {
    let mut at = seg.address.0;
    for b in &seg.blocks {
        if b.address.0 != at || b.size == 0 {
            return Err(format!(
                "a block at {} does not follow at {at:#x}",
                b.address
            ));
        }
        at = at.saturating_add(b.size);
    }
    if seg.blocks.is_empty() || at != seg.address.0 + seg.total_size {
        return Err("its blocks do not cover it".into());
    }
    Ok(())
}

impl<E> Core<E> {
    /// Carves the (entirely free, checked) segment `seg.address` into the
    /// blocks of `seg`, pushing the addresses allocated.
    fn restore_segment(&mut self, seg: &SegmentSnapshot, out: &mut Vec<DevicePtr>) {
        // Free neighbours become one block (a layout taken with blocks parked
        // in thread caches shows them apart).
        let mut parts: Vec<(u64, u64, u64, bool)> = Vec::with_capacity(seg.blocks.len());
        for b in &seg.blocks {
            let used = is_allocated(b);
            match parts.last_mut() {
                Some(last) if !used && !last.3 => last.1 += b.size,
                _ => parts.push((b.address.0, b.size, b.requested_size, used)),
            }
        }
        if parts.len() == 1 && !parts[0].3 {
            return; // entirely free then and now
        }
        let sid: SegmentId = self.segment_by_addr[&seg.address.0];
        let (pool, head) = {
            let s = self.segments.get(sid.0);
            (s.pool, s.head)
        };
        let kind = pool.kind();
        // The whole-segment free block leaves the bins and the free-segment candidates.
        let (size, addr, since) = {
            let b = self.blocks.get(head.0);
            (b.size, b.addr, b.freed_at)
        };
        self.bins_mut(pool).remove(size, addr, head);
        self.free_candidates[kind as usize].remove(&(since, addr, sid.0));
        let gc_base = self.lookups[pool.index()];
        let mut prev: Option<BlockId> = None;
        for (i, &(addr, size, requested, used)) in parts.iter().enumerate() {
            let block = Block {
                prev,
                gc_base,
                ..Block::free(addr, size, sid, pool, self.clock)
            };
            let id = if i == 0 {
                *self.blocks.get_mut(head.0) = block;
                head
            } else {
                BlockId(self.blocks.insert(block))
            };
            if let Some(p) = prev {
                self.blocks.get_mut(p.0).next = Some(id);
            }
            if used {
                let requested = if requested == 0 { size } else { requested };
                let blk = self.blocks.get_mut(id.0);
                blk.state = BlockState::Allocated;
                blk.requested = requested;
                self.live.insert(addr, id);
                self.count_allocated(kind, size, true);
                self.count_active(kind, size, requested, true);
                self.record_alloc(addr, requested, pool);
                out.push(DevicePtr(addr));
            } else {
                // A free block beside others: inactive split memory.
                self.bins_mut(pool).insert(size, addr, id);
                self.stats.inactive_split.increase(kind, 1);
                self.stats.inactive_split_bytes.increase(kind, size);
            }
            prev = Some(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::device::StreamId;
    use crate::simulated::SimulatedDevice;

    const MIB: u64 = 1 << 20;
    const S0: StreamId = StreamId(0);

    fn pool() -> (SimulatedDevice, CachingAllocator<SimulatedDevice>) {
        let dev = SimulatedDevice::new(1 << 34);
        let config = Config {
            oom_flush: false,
            ..Config::pytorch()
        };
        (dev.clone(), CachingAllocator::new(dev, config))
    }

    /// The blocks of a snapshot as (address, size, requested, in use).
    fn blocks(s: &Snapshot) -> Vec<(u64, u64, u64, bool)> {
        s.segments
            .iter()
            .flat_map(|seg| seg.blocks.iter())
            .map(|b| (b.address.0, b.size, b.requested_size, is_allocated(b)))
            .collect()
    }

    #[test]
    fn restored_layout_reallocates_the_same_blocks_at_the_same_addresses() {
        let (dev, a) = pool();
        let x = a.malloc(3 * MIB, S0).unwrap();
        let y = a.malloc(700, S0).unwrap();
        let z = a.malloc(5 * MIB + 7, S0).unwrap();
        let w = a.malloc(1200, S0).unwrap();
        a.free(y).unwrap(); // a free block between allocated ones
        let checkpoint = a.snapshot();
        let usage = a.usage();
        // Another path: other blocks, then everything freed.
        a.free(x).unwrap();
        let v = a.malloc(4 * MIB, S0).unwrap();
        for p in [v, z, w] {
            a.free(p).unwrap();
        }
        assert_eq!(a.usage().allocated, 0);
        let mut got = a.restore_layout(&checkpoint).unwrap();
        got.sort();
        let mut want = vec![x, z, w];
        want.sort();
        assert_eq!(got, want);
        assert_eq!(blocks(&a.snapshot()), blocks(&checkpoint));
        assert_eq!(a.usage().allocated, usage.allocated);
        assert_eq!(a.usage().requested, usage.requested);
        a.check_invariants().unwrap();
        // The restored blocks are ordinary allocations.
        for p in got {
            a.free(p).unwrap();
        }
        a.check_invariants().unwrap();
        a.empty_cache().unwrap();
        assert_eq!(dev.outstanding(), 0);
    }

    #[test]
    fn a_layout_that_does_not_fit_changes_nothing() {
        let (_, a) = pool();
        let x = a.malloc(3 * MIB, S0).unwrap();
        let checkpoint = a.snapshot();
        // Something still allocated: refused.
        let before = a.snapshot();
        let e = a.restore_layout(&checkpoint).unwrap_err();
        assert!(matches!(e, AllocError::BadLayout(_)), "{e}");
        assert_eq!(a.snapshot(), before);
        // A segment given back since: refused.
        a.free(x).unwrap();
        a.empty_cache().unwrap();
        let e = a.restore_layout(&checkpoint).unwrap_err();
        assert!(e.to_string().contains("no segment"), "{e}");
        // Blocks that do not tile their segment: refused.
        let y = a.malloc(3 * MIB, S0).unwrap();
        let mut bad = a.snapshot();
        a.free(y).unwrap();
        bad.segments[0].blocks[0].size -= 512;
        let before = a.snapshot();
        assert!(matches!(
            a.restore_layout(&bad),
            Err(AllocError::BadLayout(_))
        ));
        assert_eq!(a.snapshot(), before);
        a.check_invariants().unwrap();
    }
}
