//! The caching allocator: size classes, pools per stream, splitting and
//! merging, stream events, `empty_cache` and the out-of-memory ladder.
//!
//! All state sits behind one `parking_lot` mutex per allocator (per device),
//! as in PyTorch, with per-thread caches in front of it (`crate::thread_slot`): a
//! thread's repeated request of one size takes back the block it freed
//! without the allocator's lock. The state is `Core` (plain records: blocks,
//! segments, bins, the indexes over them, statistics) and the features, each
//! a type that owns its data and works on a `&mut Core` it is handed
//! (`expandable`, `slabs`, `thread_cache`). This file holds the types and
//! the state; the phases have files of their own (`api` for the public
//! methods, `malloc`, `free`, `grow` for the ladder and the release rules,
//! `inspect`, `invariants`, `layout`), and they are what calls the features.

use crate::addrmap::AddrMap;
use crate::arena::Arena;
use crate::bins::Bins;
use crate::block::{
    Block, BlockId, BlockState, Listed, PoolId, PoolKind, Segment, SegmentId, SegmentKind,
};
use crate::config::{Config, MemoryCap, MEDIUM_SEGMENT, SMALL_SIZE};
use crate::device::{Device, DeviceError, DevicePtr, StreamId};
use crate::error::{AllocError, OomReport};
use crate::fasthash::FastMap;
use crate::ids::SlotId;
use crate::pages::PageMap;
use crate::report::{BlockSnapshot, FragmentationReport, SegmentSnapshot, SegmentUse, Snapshot};
use crate::rounding::{round_size, Power2Divisions};
use crate::stats::MemoryStats;
use crate::thread_slot::{with_slot, FastFree, Slot};
use crate::trace::TraceEvent;
use parking_lot::Mutex;
use std::collections::{BTreeMap, VecDeque};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Notices kept at most (each says what the allocator did in place of failing).
const MAX_NOTICES: usize = 64;

/// Source of allocator ids (keys of the thread-local caches).
static NEXT_ALLOCATOR_ID: AtomicU64 = AtomicU64::new(1);

/// What `empty_cache` (or a flush) gave back to the device.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Bytes released.
    pub bytes: u64,
    /// Segments released.
    pub segments: u64,
}

/// Cheap counters for replay loops: current bytes without cloning the stats.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Bytes allocated to callers (rounded).
    pub allocated: u64,
    /// Bytes held from the device.
    pub reserved: u64,
    /// Bytes callers asked for.
    pub requested: u64,
    /// Times the full flush-and-retry ran so far.
    pub num_alloc_retries: u64,
}

/// A sink for recorded trace events (see [`CachingAllocator::start_recording`]).
pub type TraceSink = Box<dyn FnMut(&TraceEvent) + Send>;

/// One allocation request on its way through the growth ladder (PyTorch's
/// `AllocParams`): the pool it goes to, its stream, the size asked for and
/// the size rounded for the bins.
#[derive(Copy, Clone, Debug)]
struct Request {
    pool: PoolId,
    stream: StreamId,
    size: u64,
    rounded: u64,
}

/// A caching device allocator over a [`Device`]. `Send + Sync`: share it by reference or `Arc`.
pub struct CachingAllocator<D: Device> {
    device: D,
    state: Mutex<State<D::Event>>,
    /// Key of this allocator's thread caches.
    id: u64,
    /// Whether the thread caches serve requests now (off while recording).
    thread_cache_on: AtomicBool,
    /// Whether the configuration has thread caches at all.
    thread_cache_enabled: bool,
    /// The rounding rule, for the thread caches' keys; `None` for plain
    /// 512-byte rounding (the common case, rounded without a table lookup).
    divisions: Option<Power2Divisions>,
}

pub(super) struct Recorder {
    sink: TraceSink,
    ids: FastMap<u64, u64>,
    next_id: u64,
}

/// The records every part of the allocator shares: configuration, blocks,
/// segments, bins and the indexes over them, pending events, statistics and
/// clocks. The features (`Expandable`, `ThreadCaches`, `SlabPools`) own
/// their data and reach these records through a `&mut Core`, never through
/// [`State`].
pub(super) struct Core<E> {
    pub(super) config: Config,
    pub(super) cap: Option<u64>,
    pub(super) blocks: Arena<Block>,
    pub(super) segments: Arena<Segment>,
    pub(super) segment_by_addr: BTreeMap<u64, SegmentId>,
    /// Per pool kind, segments that may be entirely free, as (free since,
    /// address, segment), oldest first: every entirely free segment is here
    /// (added when it may have become free; stale entries are dropped when
    /// met), so releasing the oldest costs what is released, not the number
    /// of segments.
    pub(super) free_candidates: [std::collections::BTreeSet<(u64, u64, u32)>; 3],
    /// Bins per pool, indexed by [`PoolId::index`]: inline, so that a look
    /// at another stream's pool is one record (empty bins hold no memory
    /// beyond it; Note [Bins sized by use] in `bins.rs`).
    pub(super) bins: Vec<Bins>,
    /// Per pool: lookups so far (the clock of garbage-collection ages).
    pub(super) lookups: Vec<u64>,
    pub(super) streams: FastMap<StreamId, u32>,
    pub(super) stream_list: Vec<StreamId>,
    /// Allocated blocks by address: the O(1) address → block map.
    pub(super) live: AddrMap,
    /// Events guarding freed blocks, one FIFO per stream that used them.
    pub(super) pending: Vec<(StreamId, VecDeque<(E, BlockId)>)>,
    /// Blocks awaiting events (counted in `pending_blocks`).
    pub(super) pending_blocks: usize,
    /// Freed blocks used on a stream that was being captured into a CUDA
    /// graph: their guarding events wait until no stream they were used on
    /// is captured (an event recorded during a capture would join the graph;
    /// PyTorch defers these events too). Awaiting events, none recorded yet.
    pub(super) deferred: Vec<BlockId>,
    /// Events a stream was made to wait for (`borrow_holes`), kept until
    /// they complete so that none is left behind unaccounted.
    pub(super) stream_waits: Vec<E>,
    /// `borrow_holes`: the stream slot its next search starts from (it
    /// looks at `BORROW_STREAMS` other streams, in turn).
    pub(super) borrow_from: usize,
    pub(super) stats: MemoryStats,
    /// Mallocs and frees so far: the clock of idle ages.
    pub(super) clock: u64,
    pub(super) recorder: Option<Recorder>,
    /// Things the user should know about the configuration (e.g. a fallback).
    pub(super) notices: Vec<String>,
    /// Page granularity of expandable segments; `Some` turns them on.
    pub(super) granularity: Option<u64>,
    /// Expandable segments: free blocks in the bins that hold a whole mapped
    /// page, as (idle since, block), longest idle first.
    pub(super) idle_index: std::collections::BTreeSet<(u64, u32)>,
    /// Where segments come from, the cap shared with other allocators, and
    /// a private pool's terms (`supply.rs`).
    pub(super) supply: supply::Supply,
    /// Blocks shared with other processes, whose pages stay where they are
    /// (Note [Shared blocks are pinned] in `ipc.rs`).
    pub(super) pins: ipc::Pins,
}

/// An allocator's state under its lock: the shared records and the
/// features, each holding its own data. The phases (malloc, free, the
/// growth ladder) are `State` methods that call into the features.
struct State<E> {
    core: Core<E>,
    /// Expandable segments' own state (virtual ranges, pages, markers).
    vmm: expandable::Expandable<E>,
    /// The per-thread caches' state on the allocator's side.
    caches: thread_cache::ThreadCaches,
    /// Slab segments' lists and size limit.
    slabs: slabs::SlabPools,
}

impl<E> State<E> {
    #[inline(always)]
    fn stream_slot(&mut self, stream: StreamId) -> u32 {
        // Most requests come on the first stream used (the default stream).
        if self.core.stream_list.first() == Some(&stream) {
            return 0;
        }
        self.other_stream_slot(stream)
    }

    /// [`State::stream_slot`] past the first stream.
    fn other_stream_slot(&mut self, stream: StreamId) -> u32 {
        // Most programs use a few streams: a short scan beats hashing.
        if self.core.stream_list.len() <= 4 {
            if let Some(i) = self.core.stream_list.iter().position(|s| *s == stream) {
                return i as u32;
            }
        } else if let Some(&s) = self.core.streams.get(&stream) {
            return s;
        }
        let slot = self.core.stream_list.len() as u32;
        self.core.stream_list.push(stream);
        self.core.streams.insert(stream, slot);
        let pools = crate::block::POOLS_PER_STREAM as usize * self.core.stream_list.len();
        self.core.bins.resize_with(pools, Bins::default);
        self.core.lookups.resize(pools, 0);
        self.slabs.add_pools(pools);
        slot
    }
}

impl<E> Core<E> {
    fn reserved(&self) -> u64 {
        self.stats.reserved_bytes.all().current
    }

    /// The page granularity of expandable segments (they are in use).
    #[inline]
    fn granule(&self) -> u64 {
        self.granularity.expect("expandable mode has a granularity")
    }

    /// The record of segment `seg`.
    #[inline]
    fn segment(&self, seg: SegmentId) -> &Segment {
        self.segments.get(seg.0)
    }

    /// The address of granule `at` of expandable segment `seg`.
    #[inline]
    fn granule_addr(&self, seg: SegmentId, at: u32) -> u64 {
        self.segment(seg).addr + u64::from(at) * self.granule()
    }

    /// The page map of expandable segment `seg`.
    #[inline]
    fn page_map_mut(&mut self, seg: SegmentId) -> &mut PageMap {
        self.segments
            .get_mut(seg.0)
            .pages_mut()
            .expect("expandable")
    }

    /// The stream slot of segment `seg`'s pool.
    #[inline]
    fn slot_of(&self, seg: SegmentId) -> usize {
        self.segment(seg).pool.stream_slot()
    }

    #[inline]
    fn bins_mut(&mut self, pool: PoolId) -> &mut Bins {
        &mut self.bins[pool.index()]
    }

    /// Takes the free block of a segment being released out of `pool`'s
    /// bins, and empties their records if that leaves no block: a pool that
    /// holds nothing costs its inline record only (Note [Bins sized by use]
    /// in `bins.rs`).
    #[cold]
    fn unfile_released(&mut self, pool: PoolId, size: u64, addr: u64, head: BlockId) {
        let bins = &mut self.bins[pool.index()];
        bins.remove(size, addr, head);
        if bins.len() == 0 {
            *bins = Bins::default();
        }
    }

    /// The segment size for a request of `rounded` bytes.
    fn segment_size(&self, rounded: u64) -> u64 {
        let c = &self.config;
        if !c.caching {
            rounded
        } else if rounded <= SMALL_SIZE {
            c.small_segment
        } else if rounded < c.large_threshold {
            MEDIUM_SEGMENT
        } else {
            rounded.div_ceil(c.segment_round) * c.segment_round
        }
    }
}

mod api;
mod capture_reuse;
mod expandable;
mod free;
mod grow;
mod inspect;
mod invariants;
mod ipc;
mod layout;
mod malloc;
mod slabs;
mod supply;
mod thread_cache;

pub use ipc::BlockBacking;

#[cfg(test)]
mod stream_cost;
#[cfg(test)]
mod tests;
