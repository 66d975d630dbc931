//! Block and segment records, kept in arenas on the host (never in device memory).
//!
//! A segment is one device allocation; it is cut into blocks that form an
//! address-ordered doubly linked list, so a freed block finds its neighbours
//! without any lookup. Ids ([`crate::ids`]) are arena indices, distinct types from addresses.

use crate::device::StreamId;
pub use crate::ids::PoolKind;
pub(crate) use crate::ids::{BlockId, PoolId, SegmentId, SlotId, POOLS_PER_STREAM};
use crate::pages::PageMap;

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
    /// Expandable segments: bytes of a granule whose page is shared with
    /// granules of other ranges, at offsets another granule's live blocks
    /// use (inactive: not allocated, not in the bins, never handed out).
    Aliased,
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
    pub holder: Option<SlotId>,
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
            holder: None,
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
    /// Plain, expandable (page-backed) or a slab.
    pub kind: SegmentKind,
}

/// What a segment is, with the data only that kind has.
#[derive(Clone, Debug)]
pub(crate) enum SegmentKind {
    /// One device allocation, cut into blocks.
    Plain,
    /// A virtual range backed page by page.
    Expandable {
        /// Its mapped pages, page index → physical page handle.
        pages: PageMap,
        /// The bytes of each page.
        page_size: u64,
    },
    /// A small-pool segment cut into chunks of one size class.
    Slab(SlabSeg),
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
        matches!(self.kind, SegmentKind::Expandable { .. })
    }

    /// An expandable segment's mapped pages.
    pub fn pages(&self) -> Option<&PageMap> {
        match &self.kind {
            SegmentKind::Expandable { pages, .. } => Some(pages),
            _ => None,
        }
    }

    /// An expandable segment's mapped pages, to change.
    pub fn pages_mut(&mut self) -> Option<&mut PageMap> {
        match &mut self.kind {
            SegmentKind::Expandable { pages, .. } => Some(pages),
            _ => None,
        }
    }

    /// An expandable segment's page size (0 for other segments).
    pub fn page_size(&self) -> u64 {
        match self.kind {
            SegmentKind::Expandable { page_size, .. } => page_size,
            _ => 0,
        }
    }

    /// A slab's chunk bookkeeping.
    pub fn slab(&self) -> Option<&SlabSeg> {
        match &self.kind {
            SegmentKind::Slab(slab) => Some(slab),
            _ => None,
        }
    }

    /// A slab's chunk bookkeeping, to change.
    pub fn slab_mut(&mut self) -> Option<&mut SlabSeg> {
        match &mut self.kind {
            SegmentKind::Slab(slab) => Some(slab),
            _ => None,
        }
    }

    /// Whether the segment is a slab.
    pub fn is_slab(&self) -> bool {
        matches!(self.kind, SegmentKind::Slab(_))
    }
}
