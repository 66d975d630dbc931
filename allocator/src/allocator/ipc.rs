//! Blocks shared with other processes (CUDA IPC): what backs a block, and
//! the pins that keep the pages under a shared block where they are.
//!
//! Note [Shared blocks are pinned]: a process that opened a block of an
//! expandable segment maps the *physical pages* under it (imported from
//! their shareable handles), not this process's addresses. A page swapped
//! under a live block (`expandable_reback` and `expandable_share` copy live
//! bytes to other pages at the same addresses) would leave that process
//! reading and writing the old page while this one uses the new. So a block
//! handed out by [`CachingAllocator::export_block`] is pinned: reback and
//! share leave every page under it where it is, until the block is freed.
//! Freeing ends the sharing: PyTorch frees a shared block only once every
//! process that opened it released it (its CudaIPCSentData reference
//! counts), and after the device work queued before the share. Pages under
//! a live block are never recycled, moved or unmapped otherwise (only idle
//! pages are), so nothing else needs to look at the pins. Plain segments
//! never move: their blocks are not pinned.

use super::*;

/// What backs an allocated block: what another process needs to open it
/// (CUDA IPC), from [`CachingAllocator::export_block`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlockBacking {
    /// A block of a plain segment (one device allocation, shared whole).
    Segment {
        /// The segment's address.
        base: DevicePtr,
        /// The segment's size in bytes.
        size: u64,
        /// The block's offset from `base`.
        offset: u64,
    },
    /// A block of an expandable segment (Note [Shared blocks are pinned]).
    Pages {
        /// The address of the first page under the block.
        base: DevicePtr,
        /// The physical pages under the block, side by side from `base` in
        /// address order, as (page handle, bytes). A page may be larger than
        /// the block and hold other blocks too.
        pages: Vec<(u64, u64)>,
        /// The block's offset from `base`.
        offset: u64,
    },
}

/// The pinned blocks: blocks of expandable segments handed out by
/// [`CachingAllocator::export_block`] and not freed since, by block id,
/// with their addresses (Note [Shared blocks are pinned]).
#[derive(Default)]
pub(crate) struct Pins {
    blocks: FastMap<u32, u64>,
}

impl Pins {
    /// Whether no block is pinned (the free path's only question, almost always).
    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Unpins block `id` (it is being freed); nothing if it was not pinned.
    #[cold]
    pub(super) fn release(&mut self, id: BlockId) {
        self.blocks.remove(&id.0);
    }
}

impl<E> Core<E> {
    /// Whether a pinned block lies (partly) in granules `first..last` of
    /// `seg`: the pages there stay where they are (Note [Shared blocks are
    /// pinned]).
    pub(super) fn pinned_in(&self, seg: SegmentId, first: u32, last: u32) -> bool {
        if self.pins.is_empty() {
            return false;
        }
        let g = self.granularity.expect("expandable mode has a granularity");
        let s = self.segments.get(seg.0);
        let (lo, hi) = (s.addr + u64::from(first) * g, s.addr + u64::from(last) * g);
        self.pins.blocks.iter().any(|(&id, &addr)| {
            let b = self.blocks.get(id);
            b.segment == seg && addr < hi && addr + b.size > lo
        })
    }

    /// What backs allocated block `id` (of `ptr`), pinning it if its
    /// segment is expandable.
    fn backing(&mut self, id: BlockId, ptr: DevicePtr) -> BlockBacking {
        let b = self.blocks.get(id.0);
        let (size, seg) = (b.size, b.segment);
        let s = self.segments.get(seg.0);
        let Some(pages) = s.pages() else {
            return BlockBacking::Segment {
                base: DevicePtr(s.addr),
                size: s.size,
                offset: ptr.0 - s.addr,
            };
        };
        let g = self.granularity.expect("expandable mode has a granularity");
        let first = ((ptr.0 - s.addr) / g) as u32;
        let last = (ptr.0 + size - s.addr).div_ceil(g) as u32;
        // Every granule under an allocated block is mapped (`map_range`), so
        // the pages covering its first and last granules bound a run of
        // pages side by side.
        let mut out = Vec::new();
        let mut x = first;
        let mut start = None;
        while x < last {
            let (at, handle, len) = pages
                .covering(x)
                .expect("every granule under an allocated block is mapped");
            start.get_or_insert(at);
            out.push((handle, u64::from(len) * g));
            x = at + len;
        }
        let base = s.addr + u64::from(start.unwrap_or(first)) * g;
        self.pins.blocks.insert(id.0, ptr.0);
        BlockBacking::Pages {
            base: DevicePtr(base),
            pages: out,
            offset: ptr.0 - base,
        }
    }

    /// Every pinned block is allocated, at its address.
    pub(super) fn check_pins(&self) -> Result<(), String> {
        for (&id, &addr) in &self.pins.blocks {
            let b = self.blocks.get(id);
            if b.state != BlockState::Allocated || b.addr != addr || self.live.get(addr).is_none() {
                return Err(format!(
                    "pinned block at {addr:#x} is not allocated ({:?} at {:#x})",
                    b.state, b.addr
                ));
            }
            if !self.segments.get(b.segment.0).is_expandable() {
                return Err(format!("pinned block at {addr:#x} lies in a plain segment"));
            }
        }
        Ok(())
    }
}

impl<E> State<E> {
    /// [`CachingAllocator::export_block`] under the lock.
    fn export_block(&mut self, ptr: DevicePtr) -> Result<BlockBacking, AllocError> {
        let Some(id) = self.core.live.get(ptr.0) else {
            return Err(self.core.classify_bad_pointer(ptr));
        };
        if let Some(holder) = self.core.blocks.get(id.0).holder {
            // Handed out by a thread cache (or parked there: then freed, and
            // `take_back` says so): the allocator keeps it from now on.
            self.caches.take_back(&mut self.core, holder, ptr.0)?;
        }
        if self.core.blocks.get(id.0).state != BlockState::Allocated {
            return Err(AllocError::DoubleFree(ptr));
        }
        Ok(self.core.backing(id, ptr))
    }
}

impl<D: Device> CachingAllocator<D> {
    /// What backs the allocation at `ptr` (its start), for another process
    /// to open it (CUDA IPC): its plain segment, or the physical pages of
    /// an expandable segment under it. A block of an expandable segment is
    /// pinned until it is freed: no page under it moves (Note [Shared
    /// blocks are pinned]). A pointer this allocator did not hand out, one
    /// inside a block, or a freed block is an error, and nothing changes.
    pub fn export_block(&self, ptr: DevicePtr) -> Result<BlockBacking, AllocError> {
        self.state.lock().export_block(ptr)
    }

    /// The blocks pinned now (shared with other processes and not freed
    /// since) and their bytes.
    pub fn pinned_blocks(&self) -> (u64, u64) {
        let st = self.state.lock();
        let bytes = st
            .core
            .pins
            .blocks
            .keys()
            .map(|&id| st.core.blocks.get(id).size)
            .sum();
        (st.core.pins.blocks.len() as u64, bytes)
    }
}
