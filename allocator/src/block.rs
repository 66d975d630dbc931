//! Block and segment records, kept in slabs on the host (never in device memory).
//!
//! A segment is one device allocation; it is cut into blocks that form an
//! address-ordered doubly linked list, so a freed block finds its neighbours
//! without any lookup. Ids are slab indices, distinct types from addresses.

use crate::device::StreamId;
use crate::front::SlotId;
use crate::pages::PageMap;

/// Index of a block record in the allocator's block slab.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct BlockId(pub(crate) u32);

/// Index of a segment record in the allocator's segment slab.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct SegmentId(pub(crate) u32);

/// Index of a pool: one small and one large pool per stream.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub struct PoolId(pub(crate) u32);

impl PoolId {
    pub(crate) fn new(stream_slot: u32, kind: PoolKind) -> Self {
        PoolId(stream_slot * POOLS_PER_STREAM + kind as u32)
    }
    pub(crate) fn kind(self) -> PoolKind {
        match self.0 % POOLS_PER_STREAM {
            0 => PoolKind::Small,
            1 => PoolKind::Large,
            _ => PoolKind::Huge,
        }
    }
    pub(crate) fn stream_slot(self) -> usize {
        (self.0 / POOLS_PER_STREAM) as usize
    }
    pub(crate) fn index(self) -> usize {
        self.0 as usize
    }
}

/// Pools per stream: small, large and huge.
pub(crate) const POOLS_PER_STREAM: u32 = 3;

/// Which pool a block belongs to.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub enum PoolKind {
    /// Requests up to the small-size limit (1 MiB), carved from small segments.
    Small = 0,
    /// Everything else (below the huge threshold, if one is set).
    Large = 1,
    /// Requests at or above `Config::huge_size`: their segments serve only
    /// huge requests, so no small long-lived block strands their space.
    /// Counted with the large pool in the statistics.
    Huge = 2,
}

impl PoolKind {
    /// Index of the statistics group (`small_pool` = 1, `large_pool` = 2).
    pub(crate) fn stat_group(self) -> usize {
        match self {
            PoolKind::Small => 1,
            PoolKind::Large | PoolKind::Huge => 2,
        }
    }
}

/// The life of a block.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum BlockState {
    /// In the bins, ready to be handed out.
    Free,
    /// Handed out to a caller.
    Allocated,
    /// Freed by the caller, but another stream may still use it: waiting for events.
    AwaitingEvents,
    /// Freed by the caller and kept by that thread's cache for its next
    /// request of the same size (inactive: not allocated, not in the bins).
    Parked,
}

/// One contiguous piece of a segment.
#[derive(Clone, Debug)]
pub(crate) struct Block {
    pub addr: u64,
    pub size: u64,
    /// The caller's requested size while allocated (or awaiting events).
    pub requested: u64,
    pub prev: Option<BlockId>,
    pub next: Option<BlockId>,
    pub segment: SegmentId,
    pub pool: PoolId,
    pub state: BlockState,
    /// A chunk (or the uncarved tail) of a slab segment: never split,
    /// merged or filed in the bins (see `allocator::slabs`).
    pub slab: bool,
    /// Streams other than the owner's that used the block (`record_stream`).
    pub stream_uses: StreamUses,
    /// Events still guarding the block after it was freed.
    pub pending_events: u32,
    /// Value of the pool's lookup counter when the block became free (GC age).
    pub gc_base: u64,
    /// The allocator's operation count when the block last became free.
    pub freed_at: u64,
    /// The thread cache that holds the block (parked, or handed out from it).
    pub front: Option<SlotId>,
}

impl Block {
    /// A free block of `size` bytes at `addr`, with no neighbours yet.
    pub fn free(addr: u64, size: u64, segment: SegmentId, pool: PoolId, now: u64) -> Self {
        Block {
            addr,
            size,
            requested: 0,
            prev: None,
            next: None,
            segment,
            pool,
            state: BlockState::Free,
            slab: false,
            stream_uses: StreamUses::default(),
            pending_events: 0,
            gc_base: 0,
            freed_at: now,
            front: None,
        }
    }

    /// A split block is one that shares its segment with another block.
    pub fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

/// The streams other than its owner's that used a block. Boxed: almost no
/// block has any, and a pointer keeps the block record 16 bytes smaller
/// than an inline `Vec` (records are read and written on every call).
#[derive(Clone, Debug, Default)]
// A thin pointer on purpose: `Vec` inline is 24 bytes, `Box<[_]>` 16.
#[allow(clippy::box_collection)]
pub(crate) struct StreamUses(Option<Box<Vec<StreamId>>>);

impl StreamUses {
    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    pub fn contains(&self, s: &StreamId) -> bool {
        self.0.as_ref().is_some_and(|v| v.contains(s))
    }

    pub fn push(&mut self, s: StreamId) {
        self.0.get_or_insert_with(Box::default).push(s);
    }

    pub fn iter(&self) -> impl Iterator<Item = &StreamId> {
        self.0.iter().flat_map(|v| v.iter())
    }

    /// The streams, leaving none.
    pub fn take(&mut self) -> Vec<StreamId> {
        self.0.take().map(|v| *v).unwrap_or_default()
    }

    pub fn to_vec(&self) -> Vec<StreamId> {
        self.iter().copied().collect()
    }
}

/// One device allocation.
#[derive(Clone, Debug)]
pub(crate) struct Segment {
    pub addr: u64,
    /// Bytes of address space (for an expandable segment: the virtual range).
    pub size: u64,
    pub stream: StreamId,
    pub pool: PoolId,
    /// The lowest block of the segment.
    pub head: BlockId,
    /// For an expandable segment: its mapped pages, page index → physical page handle.
    pub pages: Option<PageMap>,
    /// For an expandable segment: the bytes of each page (0 for a plain segment).
    pub page_size: u64,
    /// For a slab (a small-pool segment cut into chunks of one size class):
    /// its chunks' bookkeeping.
    pub slab: Option<SlabSeg>,
}

/// Where a slab is listed in its pool (see `allocator::slabs`).
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub(crate) enum Listed {
    /// Full: no free chunk and no room in the tail for one.
    Nowhere,
    /// In its class's list of slabs with room.
    Partial,
    /// In its pool's list of slabs with no chunk in use (any class may take it).
    Empty,
}

/// A slab's chunks: they are blocks of the segment, all of one size,
/// carved from the front of the uncarved tail as needed.
#[derive(Clone, Debug)]
pub(crate) struct SlabSeg {
    /// Size class (`rounding::slab_class`) and its chunk size.
    pub class: usize,
    pub chunk: u64,
    /// Chunks in use (allocated, awaiting events or parked in a thread cache).
    pub live: u32,
    /// Free chunks, the most recently freed last.
    pub free: Vec<BlockId>,
    /// The uncarved rest of the segment, the last block (None once carved up).
    pub tail: Option<BlockId>,
    pub listed: Listed,
    /// The allocator's operation count when the last chunk in use came back.
    pub idle_since: u64,
}

impl Segment {
    /// Whether the segment is a virtual range backed page by page.
    pub fn is_expandable(&self) -> bool {
        self.pages.is_some()
    }
}

/// A vector with reusable slots, indexed by `u32`.
#[derive(Debug)]
pub(crate) struct Slab<T> {
    items: Vec<Option<T>>,
    vacant: Vec<u32>,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab {
            items: Vec::new(),
            vacant: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Slab<T> {
    pub fn insert(&mut self, item: T) -> u32 {
        self.len += 1;
        if let Some(i) = self.vacant.pop() {
            self.items[i as usize] = Some(item);
            i
        } else {
            self.items.push(Some(item));
            u32::try_from(self.items.len() - 1).expect("more than 4 billion records")
        }
    }

    /// Removes the item at `i` in place, without moving it out: for callers
    /// that do not need it (a merged block record).
    pub fn discard(&mut self, i: u32) {
        let slot = &mut self.items[i as usize];
        assert!(slot.is_some(), "slab slot vacant");
        *slot = None;
        self.vacant.push(i);
        self.len -= 1;
    }

    pub fn remove(&mut self, i: u32) -> T {
        let item = self.items[i as usize].take().expect("slab slot vacant");
        self.vacant.push(i);
        self.len -= 1;
        item
    }

    #[inline]
    pub fn get(&self, i: u32) -> &T {
        self.items[i as usize].as_ref().expect("slab slot vacant")
    }

    #[inline]
    pub fn get_mut(&mut self, i: u32) -> &mut T {
        self.items[i as usize].as_mut().expect("slab slot vacant")
    }

    pub fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slab_reuses_slots() {
        let mut s = Slab::default();
        let a = s.insert("a");
        let b = s.insert("b");
        assert_eq!(s.remove(a), "a");
        let c = s.insert("c");
        assert_eq!(c, a);
        assert_eq!(*s.get(b), "b");
        assert_eq!(s.len(), 2);
        s.discard(b);
        assert_eq!(s.len(), 1);
        assert_eq!(s.insert("d"), b);
    }

    #[test]
    fn pool_ids() {
        assert_eq!(PoolId::new(3, PoolKind::Large).kind(), PoolKind::Large);
        assert_eq!(PoolId::new(3, PoolKind::Small).kind(), PoolKind::Small);
        assert_eq!(PoolId::new(3, PoolKind::Huge).kind(), PoolKind::Huge);
        assert_eq!(PoolId::new(3, PoolKind::Large).index(), 10);
        assert_eq!(PoolId::new(3, PoolKind::Huge).stream_slot(), 3);
    }
}
