//! The caching allocator: size classes, pools per stream, splitting and
//! merging, stream events, `empty_cache` and the out-of-memory ladder.
//!
//! All state sits behind one `parking_lot` mutex per allocator (per device),
//! as in PyTorch, with per-thread caches in front of it (`crate::thread_cache`): a
//! thread's repeated request of one size takes back the block it freed
//! without the allocator's lock. The state is split into plain records
//! (blocks, segments, bins) so that page-backed growable segments can reuse
//! the same block lists.

use crate::addrmap::AddrMap;
use crate::arena::Arena;
use crate::bins::Bins;
use crate::block::{Block, BlockId, BlockState, Listed, PoolId, PoolKind, Segment, SegmentId};
use crate::config::{Config, MemoryCap, ReleaseOrder, MEDIUM_SEGMENT, OVERSIZE_SLACK, SMALL_SIZE};
use crate::device::{Device, DeviceError, DevicePtr, StreamId};
use crate::error::{AllocError, OomReport};
use crate::fasthash::FastMap;
use crate::ids::SlotId;
use crate::pages::PageMap;
use crate::report::{BlockSnapshot, FragmentationReport, SegmentSnapshot, SegmentUse, Snapshot};
use crate::rounding::{round_size, Power2Divisions};
use crate::stats::MemoryStats;
use crate::thread_cache::{key_hash, with_slot, FastFree, Slot};
use crate::trace::TraceEvent;
use parking_lot::Mutex;
use std::collections::{BTreeMap, VecDeque};

/// Operations between two marks of the byte clock (`release_idle_frac`).
const BYTE_MARK_EVERY: u64 = 64;
/// Marks of the byte clock kept (the last 4 M operations).
const BYTE_MARKS: usize = 65536;
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

/// A thread cache's recently missed request sizes: a block freed with one of
/// these sizes is parked for the thread instead of going back to the bins,
/// as long as parking pays (see `State::should_park`).
#[derive(Clone, Copy)]
struct Wanted {
    keys: [u64; 8],
    next: usize,
    /// Parks still allowed before the slot must show hits (each hit earns
    /// `thread_cache::CREDIT_PER_HIT`).
    credit: u32,
    /// The slot's hit count when last looked at.
    hits_seen: u64,
    /// Parks refused for lack of credit (every `thread_cache::PROBE_EVERY`th goes ahead).
    refused: u32,
}

impl Default for Wanted {
    fn default() -> Self {
        Wanted {
            keys: [0; 8],
            next: 0,
            credit: thread_cache::INITIAL_CREDIT,
            hits_seen: 0,
            refused: 0,
        }
    }
}

struct Recorder {
    sink: TraceSink,
    ids: FastMap<u64, u64>,
    next_id: u64,
}

struct State<E> {
    config: Config,
    cap: Option<u64>,
    blocks: Arena<Block>,
    segments: Arena<Segment>,
    segment_by_addr: BTreeMap<u64, SegmentId>,
    /// Per pool kind, segments that may be entirely free, as (free since,
    /// address, segment), oldest first: every entirely free segment is here
    /// (added when it may have become free; stale entries are dropped when
    /// met), so releasing the oldest costs what is released, not the number
    /// of segments.
    free_candidates: [std::collections::BTreeSet<(u64, u64, u32)>; 3],
    /// Bins per pool, indexed by [`PoolId::index`]; created on first use.
    bins: Vec<Option<Box<Bins>>>,
    /// Per pool: lookups so far (the clock of garbage-collection ages).
    lookups: Vec<u64>,
    streams: FastMap<StreamId, u32>,
    stream_list: Vec<StreamId>,
    /// Allocated blocks by address: the O(1) address → block map.
    live: AddrMap,
    /// Events guarding freed blocks, one FIFO per stream that used them.
    pending: Vec<(StreamId, VecDeque<(E, BlockId)>)>,
    pending_blocks: usize,
    stats: MemoryStats,
    /// Highest reserved bytes ever (not reset by `reset_peak_stats`).
    high_water: u64,
    /// Mallocs and frees so far: the clock of idle ages.
    clock: u64,
    /// Bytes (rounded) allocated so far through the locked path.
    bytes_clock: u64,
    /// `(clock, bytes_clock)` every [`BYTE_MARK_EVERY`] operations, the last
    /// [`BYTE_MARKS`] of them: converts an idle age in operations into bytes
    /// allocated since (`release_idle_frac`).
    byte_marks: VecDeque<(u64, u64)>,
    recorder: Option<Recorder>,
    /// Page granularity when expandable segments are in use.
    granularity: Option<u64>,
    /// Per pool: its expandable segments (virtual ranges), oldest first.
    ranges: Vec<Vec<SegmentId>>,
    /// Device memory in bytes (sizes the expandable ranges and the pressure limit).
    range_size: u64,
    /// Expandable, per stream slot: events recorded as blocks were freed there.
    marks: Vec<expandable::Marks<E>>,
    /// Expandable: free blocks in the bins that hold a whole mapped page, as
    /// (idle since, block), longest idle first.
    idle_index: std::collections::BTreeSet<(u64, u32)>,
    /// Physical pages unmapped but kept (reserved), with the pool kind their bytes are counted under.
    page_pool: Vec<(u64, PoolKind, u64)>,
    /// Expandable: reserved bytes when the device last had no room for a new page.
    device_full_at: Option<u64>,
    /// Things the user should know about the configuration (e.g. a fallback).
    notices: Vec<String>,
    /// Thread caches by [`SlotId`] (`None`: index free for reuse).
    slots: Vec<Option<Arc<Slot>>>,
    /// Per thread cache: its recent misses.
    wanted: Vec<Wanted>,
    /// Blocks held by thread caches (parked or handed out from one).
    cached_blocks: usize,
    /// Whether the thread caches pay for themselves (see `State::review_thread_caches`).
    review: ThreadCacheReview,
    /// Blocks parked per thread cache (0: thread caches off).
    thread_cache: usize,
    /// Small requests up to this size go to slabs (0: off; see `slabs`).
    slab_max: u64,
    /// Per pool: its slabs, indexed by [`PoolId::index`]; created on first use.
    slab_lists: Vec<Option<Box<SlabLists>>>,
}

impl<D: Device> CachingAllocator<D> {
    /// An allocator over `device` with `config`. A memory cap in the config is
    /// resolved against the device's total memory now.
    pub fn new(device: D, config: Config) -> Self {
        let total = device.mem_info().map(|m| m.total).unwrap_or(u64::MAX);
        let cap = config.memory_cap.map(|c| c.bytes(total));
        let mut notices = Vec::new();
        let mut granularity = None;
        if config.expandable_segments {
            match device.vmm_granularity() {
                Some(g) if config.caching && g.is_power_of_two() && g >= 512 => {
                    granularity = Some(g)
                }
                Some(_) if !config.caching => {
                    notices.push("expandable_segments ignored: caching is off".to_string());
                }
                _ => notices.push(
                    "expandable_segments:True requested, but the device has no virtual memory API \
                     (cuMemCreate/cuMemMap); falling back to plain segments"
                        .to_string(),
                ),
            }
        }
        let range_size = total;
        let stats = MemoryStats {
            max_split_size: config.max_split_size,
            ..Default::default()
        };
        let thread_cache = if config.caching && granularity.is_none() {
            config.thread_cache as usize
        } else {
            0
        };
        let slab_max = if config.caching && granularity.is_none() {
            config.slab_max
        } else {
            0
        };
        let divisions =
            Some(config.roundup_power2_divisions).filter(|d| !crate::rounding::is_plain(d));
        CachingAllocator {
            device,
            id: NEXT_ALLOCATOR_ID.fetch_add(1, Ordering::Relaxed),
            thread_cache_on: AtomicBool::new(thread_cache > 0),
            thread_cache_enabled: thread_cache > 0,
            divisions,
            state: Mutex::new(State {
                config,
                cap,
                blocks: Arena::default(),
                segments: Arena::default(),
                segment_by_addr: BTreeMap::new(),
                free_candidates: Default::default(),
                bins: Vec::new(),
                lookups: Vec::new(),
                streams: FastMap::default(),
                stream_list: Vec::new(),
                live: AddrMap::default(),
                pending: Vec::new(),
                pending_blocks: 0,
                stats,
                high_water: 0,
                clock: 0,
                bytes_clock: 0,
                byte_marks: VecDeque::new(),
                recorder: None,
                granularity,
                ranges: Vec::new(),
                range_size,
                marks: Vec::new(),
                idle_index: std::collections::BTreeSet::new(),
                page_pool: Vec::new(),
                device_full_at: None,
                notices,
                slots: Vec::new(),
                wanted: Vec::new(),
                cached_blocks: 0,
                review: ThreadCacheReview::default(),
                thread_cache,
                slab_max,
                slab_lists: Vec::new(),
            }),
        }
    }

    /// The device this allocator draws from.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// Notes about the configuration in force, e.g. that expandable segments
    /// fell back to plain ones because the device lacks the virtual memory API.
    pub fn notices(&self) -> Vec<String> {
        self.state.lock().notices.clone()
    }

    /// Whether expandable (page-backed) segments are in use.
    pub fn is_expandable(&self) -> bool {
        self.state.lock().granularity.is_some()
    }

    /// The configuration in force.
    pub fn config(&self) -> Config {
        self.state.lock().config.clone()
    }

    /// Allocates `size` bytes for use on `stream`.
    ///
    /// Size 0 is [`AllocError::ZeroSize`]; sizes above 1 PiB are
    /// [`AllocError::SizeTooLarge`]. When nothing cached fits and the device
    /// cannot give a new segment, the cache is flushed and the request
    /// retried; only then is [`AllocError::OutOfMemory`] returned, with a
    /// report of the memory state.
    pub fn malloc(&self, size: u64, stream: StreamId) -> Result<DevicePtr, AllocError> {
        if size == 0 {
            return Err(AllocError::ZeroSize);
        }
        // Misuse is answered before anything changes.
        let rounded = match &self.divisions {
            None => crate::rounding::round_size_plain(size),
            Some(d) => round_size(size, d),
        }
        .ok_or(AllocError::SizeTooLarge(size))?;
        if !self.thread_cache_on.load(Ordering::Relaxed) {
            return self.locked_op(|st| st.malloc(&self.device, size, rounded, stream, None));
        }
        with_slot(
            self.id,
            || self.register_slot(),
            |slot| {
                if let Some(slot) = slot {
                    if let Some(addr) = slot.try_alloc(rounded, stream, size) {
                        return Ok(DevicePtr(addr));
                    }
                }
                let own = slot.map(|s| s.id);
                self.locked_op(|st| st.malloc(&self.device, size, rounded, stream, own))
            },
        )
    }

    /// Runs a malloc or free under the allocator's lock, then lets the
    /// review of the thread caches switch them off or on.
    #[inline]
    fn locked<R>(&self, op: impl FnOnce(&mut State<D::Event>) -> R) -> R {
        let mut st = self.state.lock();
        let r = op(&mut st);
        if let Some(on) = st.review_thread_caches() {
            if st.recorder.is_none() {
                self.thread_cache_on.store(on, Ordering::Relaxed);
            }
        }
        r
    }

    /// [`CachingAllocator::locked`] for a malloc or free, with the error
    /// boxed inside the lock: the result then comes back in registers. A
    /// 40-byte `Result` went through a stack temporary, and perf put a third
    /// of `free`'s samples on copying it out (a store-forwarding stall; the
    /// gain in time was within the noise of a shared 2-vCPU host).
    #[inline(always)]
    fn locked_op<T>(
        &self,
        op: impl FnOnce(&mut State<D::Event>) -> Result<T, AllocError>,
    ) -> Result<T, AllocError> {
        self.locked(|st| op(st).map_err(Box::new)).map_err(|e| *e)
    }

    /// A thread cache for the calling thread, if the configuration has them.
    fn register_slot(&self) -> Option<Arc<Slot>> {
        self.state.lock().register_slot()
    }

    /// Counts `ops` mallocs and frees that were served outside this
    /// allocator on its idle clock (the clock of `release_min_idle`), as if
    /// they had been its own: for policy studies that route some requests
    /// elsewhere (the lab's `slab_eval`). Only with the `testing` feature.
    #[cfg(feature = "testing")]
    pub fn count_foreign_ops(&self, ops: u64) {
        self.state.lock().clock += ops;
    }

    /// Returns an allocation to the cache. If other streams used it
    /// ([`CachingAllocator::record_stream`]), it is reused only after events
    /// recorded on them now have completed.
    #[inline]
    pub fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        self.free_sized(ptr).map(|_| ())
    }

    /// [`CachingAllocator::free`], returning the size that was requested
    /// for the allocation, for callers that check a size they are given back
    /// (the C ABI's `free`). Costs nothing more than `free`.
    pub fn free_sized(&self, ptr: DevicePtr) -> Result<u64, AllocError> {
        if !self.thread_cache_on.load(Ordering::Relaxed) {
            return self.locked_op(|st| st.free(&self.device, ptr, None));
        }
        with_slot(
            self.id,
            || self.register_slot(),
            |slot| {
                if let Some(slot) = slot {
                    if let FastFree::Done(requested) = slot.try_free(ptr.0) {
                        return Ok(requested);
                    }
                }
                let own = slot.map(|s| s.id);
                self.locked_op(|st| st.free(&self.device, ptr, own))
            },
        )
    }

    /// Marks the allocation at `ptr` as used by `stream` as well as its own.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError> {
        self.state.lock().record_stream(ptr, stream)
    }

    /// Polls pending events and recycles the blocks whose events completed.
    /// (Every `malloc` does this first.)
    pub fn process_events(&self) -> Result<(), AllocError> {
        self.state.lock().process_events(&self.device)
    }

    /// Waits for pending events, then releases every entirely free segment to
    /// the device. Partly used segments stay; [`CachingAllocator::fragmentation`]
    /// reports their free bytes.
    pub fn empty_cache(&self) -> Result<Released, AllocError> {
        let mut st = self.state.lock();
        if let Some(r) = st.recorder.as_mut() {
            (r.sink)(&TraceEvent::EmptyCache);
        }
        st.flush_thread_caches();
        st.release_cached(&self.device)
    }

    /// Sets (or lifts, with `None`) the cap on reserved memory. If reserved
    /// memory is above the new cap, entirely free segments are released now.
    pub fn set_memory_cap(&self, cap: Option<MemoryCap>) -> Result<(), AllocError> {
        let total = self.device.mem_info()?.total;
        let mut st = self.state.lock();
        st.config.memory_cap = cap;
        st.cap = cap.map(|c| c.bytes(total));
        if st.cap.is_some_and(|c| st.reserved() > c) {
            st.flush_thread_caches();
            st.release_cached(&self.device)?;
        }
        Ok(())
    }

    /// The cap on reserved memory in bytes, if any.
    pub fn memory_cap(&self) -> Option<u64> {
        self.state.lock().cap
    }

    /// A copy of the statistics (PyTorch's `memory_stats()`).
    ///
    /// With thread caches, what threads did without the allocator's lock is
    /// folded in now: `current` values and totals are exact; a peak may count
    /// blocks a thread took back from its cache and freed again since the
    /// last read as if both were live at once (see `docs/POLICY.md`).
    pub fn stats(&self) -> MemoryStats {
        let mut st = self.state.lock();
        st.sync_thread_caches();
        st.stats.clone()
    }

    /// Current allocated / reserved / requested bytes, cheaply.
    pub fn usage(&self) -> Usage {
        let mut st = self.state.lock();
        st.sync_thread_caches();
        Usage {
            allocated: st.stats.allocated_bytes.all().current,
            reserved: st.reserved(),
            requested: st.stats.requested_bytes.all().current,
            num_alloc_retries: st.stats.num_alloc_retries,
        }
    }

    /// Resets every peak statistic to its current value.
    pub fn reset_peak_stats(&self) {
        let mut st = self.state.lock();
        st.sync_thread_caches();
        st.stats.reset_peak();
    }

    /// How fragmented the cache is now.
    /// Blocks parked in thread caches go back to the bins first.
    pub fn fragmentation(&self) -> FragmentationReport {
        let mut st = self.state.lock();
        st.flush_thread_caches();
        st.fragmentation()
    }

    /// Every segment and block.
    pub fn snapshot(&self) -> Snapshot {
        let mut st = self.state.lock();
        st.sync_thread_caches();
        st.snapshot()
    }

    /// Starts sending every malloc / free / empty_cache to `sink` as trace
    /// events (ids are assigned in allocation order). Replaces any earlier sink.
    /// Thread caches are off while recording, so that every call is seen.
    pub fn start_recording(&self, sink: TraceSink) {
        let mut st = self.state.lock();
        self.thread_cache_on.store(false, Ordering::Relaxed);
        st.flush_thread_caches();
        let mut ids = FastMap::default();
        let mut next_id = 0;
        // Allocations already live get ids too, so that their frees are valid
        // in the trace; their allocation lines are emitted first.
        let mut sink = sink;
        let mut live: Vec<(u64, BlockId)> = st.live.iter().collect();
        live.sort_unstable();
        for (addr, id) in live {
            let b = st.blocks.get(id.0);
            let stream = st.segments.get(b.segment.0).stream;
            sink(&TraceEvent::Alloc {
                id: next_id,
                bytes: b.requested,
                stream: stream.0,
            });
            ids.insert(addr, next_id);
            next_id += 1;
        }
        st.recorder = Some(Recorder { sink, ids, next_id });
    }

    /// Stops recording; returns whether a recording was running.
    pub fn stop_recording(&self) -> bool {
        let mut st = self.state.lock();
        self.thread_cache_on.store(
            self.thread_cache_enabled && st.review.paying,
            Ordering::Relaxed,
        );
        st.recorder.take().is_some()
    }

    /// Checks every internal invariant; the first violation is returned as text.
    ///
    /// Segments tile exactly into address-ordered blocks, no two free
    /// neighbours are left unmerged, every free block is in its bins and only
    /// there, the address map holds exactly the allocated blocks, pending
    /// events match the blocks awaiting them, and every statistic equals what
    /// the blocks recompute. Used by the property tests and the fuzzers.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut st = self.state.lock();
        st.sync_thread_caches();
        st.check_invariants()?;
        for (&addr, &seg) in &st.segment_by_addr {
            let kind = st.segments.get(seg.0).pool.kind() as usize;
            if st.segment_is_free(seg)
                && !st.free_candidates[kind].contains(&(st.free_since(seg), addr, seg.0))
            {
                return Err(format!(
                    "free segment at {addr:#x} is not among the free candidates"
                ));
            }
        }
        st.check_slots()
    }
}

impl<E> State<E> {
    fn reserved(&self) -> u64 {
        self.stats.reserved_bytes.all().current
    }

    #[inline(always)]
    fn stream_slot(&mut self, stream: StreamId) -> u32 {
        // Most requests come on the first stream used (the default stream).
        if self.stream_list.first() == Some(&stream) {
            return 0;
        }
        self.other_stream_slot(stream)
    }

    /// [`State::stream_slot`] past the first stream.
    fn other_stream_slot(&mut self, stream: StreamId) -> u32 {
        // Most programs use a few streams: a short scan beats hashing.
        if self.stream_list.len() <= 4 {
            if let Some(i) = self.stream_list.iter().position(|s| *s == stream) {
                return i as u32;
            }
        } else if let Some(&s) = self.streams.get(&stream) {
            return s;
        }
        let slot = self.stream_list.len() as u32;
        self.stream_list.push(stream);
        self.streams.insert(stream, slot);
        let pools = crate::block::POOLS_PER_STREAM as usize * self.stream_list.len();
        self.bins.resize_with(pools, || None);
        self.slab_lists.resize_with(pools, || None);
        self.lookups.resize(pools, 0);
        self.ranges.resize_with(pools, Vec::new);
        self.marks
            .resize_with(self.stream_list.len(), expandable::Marks::default);
        slot
    }

    #[inline]
    fn bins_mut(&mut self, pool: PoolId) -> &mut Bins {
        self.bins[pool.index()].get_or_insert_with(Box::default)
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
            let mut size = rounded;
            if rounded >= c.huge_size && c.huge_segment_divisions > 1 {
                size = crate::rounding::round_power2_division(
                    rounded,
                    u64::from(c.huge_segment_divisions),
                );
            }
            size.div_ceil(c.segment_round) * c.segment_round
        }
    }

    // Inlined into the locked wrapper: returned through memory, its result
    // was reloaded there with a store-forwarding stall (perf, random mix).
    #[inline(always)]
    fn malloc<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        size: u64,
        rounded: u64,
        stream: StreamId,
        own: Option<SlotId>,
    ) -> Result<DevicePtr, AllocError> {
        if let Some(slot) = own {
            let w = &mut self.wanted[slot.0 as usize];
            w.keys[w.next] = key_hash(rounded, stream);
            w.next = (w.next + 1) % w.keys.len();
        }
        self.shadow_malloc(rounded);
        if self.pending_blocks > 0 {
            self.process_events(dev)?;
        }
        self.clock += 1;
        self.tick_bytes(rounded);
        let kind = if rounded <= SMALL_SIZE {
            PoolKind::Small
        } else if rounded >= self.config.huge_size {
            PoolKind::Huge
        } else {
            PoolKind::Large
        };
        let pool = PoolId::new(self.stream_slot(stream), kind);
        let req = Request {
            pool,
            stream,
            size,
            rounded,
        };
        if rounded <= self.slab_max {
            // (`slab_max` is at most the small-request limit.)
            return self.slab_malloc(dev, req);
        }
        if let (Some(slot), false) = (own, kind == PoolKind::Small) {
            self.flush_own_large(slot);
        }
        let id = if self.granularity.is_some() {
            self.malloc_expandable(dev, req)?
        } else {
            let found = if self.config.caching {
                self.get_free_block(pool, rounded)
            } else {
                None
            };
            match found {
                Some(id) => id,
                None => self.grow(dev, req)?,
            }
        };
        Ok(self.alloc_found_block(id, rounded, size))
    }

    /// PyTorch's `get_free_block`: the best fit of the pool, unless it is oversize.
    #[inline(always)]
    fn get_free_block(&mut self, pool: PoolId, size: u64) -> Option<BlockId> {
        if self.config.garbage_collection_threshold.is_some() && self.cap.is_some() {
            self.lookups[pool.index()] += 1;
        }
        let max_split = self.config.max_split_size;
        let slack = OVERSIZE_SLACK;
        let found = self.bins[pool.index()].as_ref()?.find(size)?;
        let (bsize, _, id) = found.entry;
        if size < max_split && bsize >= max_split {
            return None;
        }
        if size >= max_split && bsize >= size.saturating_add(slack) {
            return None;
        }
        let ratio = self.config.oversize_ratio;
        if pool.kind() == PoolKind::Huge
            && ratio > 0
            && bsize / ratio > size
            && !self.blocks.get(id.0).is_split()
        {
            return None;
        }
        self.bins[pool.index()].as_mut()?.take(found);
        Some(id)
    }

    /// The ladder after a cache miss: new segment → release what suffices →
    /// full flush → out of memory.
    fn grow<D: Device<Event = E>>(&mut self, dev: &D, req: Request) -> Result<BlockId, AllocError> {
        let Request { pool, rounded, .. } = req;
        if pool.kind() == PoolKind::Small && self.unslab_empty(pool) {
            if let Some(id) = self.get_free_block(pool, rounded) {
                return Ok(id);
            }
        }
        let seg_size = self.segment_size(rounded);
        let caching = self.config.caching;
        let retry = |st: &mut Self| {
            if caching {
                st.get_free_block(pool, rounded)
            } else {
                None
            }
        };
        self.grow_with(dev, req, seg_size, retry)
    }

    /// [`State::grow`] for a segment of `seg_size`, where `retry` looks in
    /// the cache again after the thread caches and after the full flush
    /// gave blocks back. Returns what `retry` found, or the one free block
    /// of a new segment (not in the bins).
    fn grow_with<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        req: Request,
        seg_size: u64,
        retry: impl Fn(&mut Self) -> Option<BlockId>,
    ) -> Result<BlockId, AllocError> {
        let Request {
            pool,
            stream,
            size,
            rounded,
        } = req;
        if self.cached_blocks > 0 {
            // Blocks parked in thread caches go back before the device is asked.
            self.flush_thread_caches();
            if let Some(id) = retry(self) {
                return Ok(id);
            }
        }
        if self.config.garbage_collection_threshold.is_some() && self.cap.is_some() {
            self.garbage_collect(dev)?;
        }
        if self.config.release_before_grow && self.reserved() + seg_size > self.high_water {
            let need = self.reserved() + seg_size - self.high_water;
            let kind = self.config.release_same_kind.then_some(pool.kind());
            // The idle age may keep young free segments only within the slack.
            let bound = (1.0 + self.config.release_idle_slack)
                * self
                    .stats
                    .allocated_bytes
                    .all()
                    .peak
                    .max(self.stats.allocated_bytes.all().current + rounded)
                    as f64;
            let idle_rule = ((self.reserved() + seg_size) as f64) <= bound;
            self.release_free_segments(dev, need, self.config.release_min_idle, idle_rule, kind)?;
        }
        if let Some(id) = self.alloc_segment(dev, pool, stream, seg_size)? {
            return Ok(id);
        }
        if self.release_available(dev, pool, rounded, seg_size)? {
            if let Some(id) = self.alloc_segment(dev, pool, stream, seg_size)? {
                return Ok(id);
            }
        }
        // Full flush: wait for every pending event, release every free segment, retry.
        if self.config.oom_flush {
            self.release_cached(dev)?;
            self.stats.num_alloc_retries += 1;
            if let Some(id) = retry(self) {
                return Ok(id);
            }
            if let Some(id) = self.alloc_segment(dev, pool, stream, seg_size)? {
                return Ok(id);
            }
        }
        self.stats.num_ooms += 1;
        Err(AllocError::OutOfMemory(Box::new(
            self.oom_report(dev, size, seg_size),
        )))
    }

    fn oom_report<D: Device<Event = E>>(&self, dev: &D, size: u64, seg_size: u64) -> OomReport {
        let info = dev.mem_info().unwrap_or_default();
        let frag = self.fragmentation_totals();
        OomReport {
            requested: size,
            segment_size: seg_size,
            device_free: info.free,
            device_total: info.total,
            cap: self.cap,
            allocated: self.stats.allocated_bytes.all().current,
            reserved: self.reserved(),
            largest_free_block: frag.1,
            external_fragmentation: if frag.0 == 0 {
                0.0
            } else {
                (frag.0 - frag.1) as f64 / frag.0 as f64
            },
        }
    }

    /// Asks the device for a segment; `Ok(None)` when the cap or the device says no.
    fn alloc_segment<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        pool: PoolId,
        stream: StreamId,
        size: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        if self
            .cap
            .is_some_and(|cap| self.reserved().saturating_add(size) > cap)
        {
            return Ok(None);
        }
        let ptr = match dev.allocate(size) {
            Ok(p) => p,
            Err(DeviceError::OutOfMemory) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let seg = self.add_segment(ptr, size, stream, pool, None);
        let id = self.segments.get(seg.0).head;
        let kind = pool.kind();
        self.stats.reserved_bytes.increase(kind, size);
        self.stats.num_device_alloc += 1;
        if size >= self.config.max_split_size {
            self.stats.oversize_segments.increase(1);
        }
        self.high_water = self.high_water.max(self.reserved());
        Ok(Some(id))
    }

    /// Records a new segment (plain, or expandable with `page_size`) as one
    /// free block; the block is in the bins only if the caller puts it there.
    fn add_segment(
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
            pages: page_size.map(|_| PageMap::default()),
            page_size: page_size.unwrap_or(0),
            slab: None,
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

    fn should_split(&self, kind: PoolKind, rounded: u64, remaining: u64) -> bool {
        if self.granularity.is_some() {
            return remaining >= crate::rounding::MIN_BLOCK;
        }
        match kind {
            PoolKind::Small => remaining >= crate::rounding::MIN_BLOCK,
            PoolKind::Large | PoolKind::Huge => {
                rounded < self.config.max_split_size
                    && remaining > self.config.large_split_remainder
            }
        }
    }

    /// Hands out block `id` (already out of the bins), splitting off the remainder if worth it.
    #[inline(always)]
    fn alloc_found_block(&mut self, id: BlockId, rounded: u64, requested: u64) -> DevicePtr {
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
        let final_size = if self.should_split(kind, rounded, remaining) {
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
    fn record_alloc(&mut self, addr: u64, requested: u64, pool: PoolId) {
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

    /// Tells apart a double free, an interior pointer and a foreign pointer.
    fn classify_bad_pointer(&self, ptr: DevicePtr) -> AllocError {
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

    // Inlined into the locked wrapper, as `malloc`.
    #[inline(always)]
    fn free<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        ptr: DevicePtr,
        own: Option<SlotId>,
    ) -> Result<u64, AllocError> {
        self.clock += 1;
        // One map operation on the common path; a parked block goes back in.
        let Some(id) = self.live.remove(ptr.0) else {
            return Err(self.classify_bad_pointer(ptr));
        };
        // One read of the record: taking the block back from a thread cache
        // or parking it changes neither its size, its pool nor its streams.
        let (size, pool, holder, shared) = {
            let b = self.blocks.get(id.0);
            (b.size, b.pool, b.holder, !b.stream_uses.is_empty())
        };
        if let Some(holder) = holder {
            if let Err(e) = self.take_back(holder, ptr.0) {
                self.live.insert(ptr.0, id);
                return Err(e);
            }
        }
        // (Taking the block back synced its requested size from the thread cache.)
        let requested = self.blocks.get(id.0).requested;
        if let Some(slot) = own {
            if self.should_park(slot, id) {
                self.live.insert(ptr.0, id);
                self.park(slot, id);
                return Ok(requested);
            }
        }
        // A block used on other streams is guarded by an event on each; the
        // device calls come before any change, so that a failure leaves the
        // block allocated and the free can be retried.
        let events = if shared {
            match self.guard_events(dev, id) {
                Ok(events) => events,
                Err(e) => {
                    self.live.insert(ptr.0, id);
                    return Err(e);
                }
            }
        } else {
            Vec::new()
        };
        self.shadow_free(size);
        let kind = pool.kind();
        self.count_allocated(kind, size, false);
        if self.granularity.is_some() {
            self.mark_free(dev, pool);
        }
        if let Some(r) = self.recorder.as_mut() {
            if let Some(tid) = r.ids.remove(&ptr.0) {
                (r.sink)(&TraceEvent::Free { id: tid });
            }
        }
        // Almost no block was used on another stream: back to the pool at once.
        if events.is_empty() {
            if shared {
                self.blocks.get_mut(id.0).stream_uses.take();
            }
            self.free_block(id);
            if !self.config.caching {
                let seg = self.blocks.get(id.0).segment;
                self.release_or_keep(dev, seg);
            }
            return Ok(requested);
        }
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
        self.pending_blocks += 1;
        Ok(requested)
    }

    /// Records an event on every stream that used block `id` besides its
    /// own. If one cannot be recorded, the device is synchronized instead
    /// (the block is then safe to reuse at once: no events). If that fails
    /// too, the events recorded are given back and the error returned:
    /// nothing has changed.
    #[cold]
    fn guard_events<D: Device<Event = E>>(
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

    /// Without caching, a freed block's segment goes back to the device at
    /// once; if the device refuses, the segment stays cached (whole and
    /// consistent) for a later `empty_cache`, and a notice says so.
    #[cold]
    fn release_or_keep<D: Device<Event = E>>(&mut self, dev: &D, seg: SegmentId) {
        if let Err(e) = self.release_segment(dev, seg) {
            self.notice(format!(
                "a segment stays cached: the device could not free it ({e})"
            ));
        }
    }

    /// Adds a notice (kept to a bounded number; see [`CachingAllocator::notices`]).
    #[cold]
    fn notice(&mut self, text: String) {
        if self.notices.len() < MAX_NOTICES {
            self.notices.push(text);
        }
    }

    /// Returns a block to its pool, merging it with free neighbours (a
    /// slab's chunk goes back to its slab).
    fn free_block(&mut self, id: BlockId) {
        let expandable = self.granularity.is_some();
        let (orig_size, requested, pool, slab) = {
            let b = self.blocks.get_mut(id.0);
            b.state = BlockState::Free;
            if expandable {
                // Idle from now (merging keeps the latest of the parts).
                b.freed_at = self.clock;
            }
            (b.size, std::mem::take(&mut b.requested), b.pool, b.slab)
        };
        let kind = pool.kind();
        self.file_free(id, kind, slab);
        self.count_active(kind, orig_size, requested, false);
    }

    /// Files the free block `id` where free blocks of its kind go: a slab's
    /// chunk in its slab, any other block in the bins, merged.
    #[inline]
    fn file_free(&mut self, id: BlockId, kind: PoolKind, slab: bool) {
        if slab {
            self.slab_free(id);
        } else {
            self.merge_counted(id, kind);
        }
    }

    /// Counts a block of `size` bytes handed out (`up`) or given back by its caller.
    fn count_allocated(&mut self, kind: PoolKind, size: u64, up: bool) {
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
    fn count_active(&mut self, kind: PoolKind, size: u64, requested: u64, up: bool) {
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

    /// [`State::merge_into_bins`], with the change in inactive split blocks counted.
    /// `kind` is the block's pool kind (the callers have it at hand).
    fn merge_counted(&mut self, id: BlockId, kind: PoolKind) {
        let (net_blocks, net_bytes) = self.merge_into_bins(id);
        // The sign depends on which neighbours were free: no branch on it.
        self.stats.inactive_split.add(kind, net_blocks);
        self.stats.inactive_split_bytes.add(kind, net_bytes);
    }

    /// Merges the free block `id` with its free neighbours and files the
    /// result in the bins. Returns the change in inactive split blocks and
    /// bytes (zero in expandable segments, where they are not counted).
    fn merge_into_bins(&mut self, id: BlockId) -> (i64, i64) {
        // Disjoint borrows of the fields: one bins lookup, no repeated
        // record lookups for the block itself.
        let State {
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
        let bins = bins[pool.index()].get_or_insert_with(Box::default);
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

    fn record_stream(&mut self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError> {
        let Some(id) = self.live.get(ptr.0) else {
            return Err(self.classify_bad_pointer(ptr));
        };
        if let Some(holder) = self.blocks.get(id.0).holder {
            // A block another stream uses must not be parked: the allocator keeps it.
            self.take_back(holder, ptr.0)?;
        }
        let owner = self.segments.get(self.blocks.get(id.0).segment.0).stream;
        let b = self.blocks.get_mut(id.0);
        if stream != owner && !b.stream_uses.contains(&stream) {
            b.stream_uses.push(stream);
        }
        Ok(())
    }

    /// Events of these blocks completed: recycle each block whose last event it was.
    fn events_done<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        done: Vec<BlockId>,
    ) -> Result<(), AllocError> {
        // Every block is recycled even if the device refuses to free a
        // segment on the way (that segment stays cached).
        for id in done {
            let b = self.blocks.get_mut(id.0);
            b.pending_events -= 1;
            if b.pending_events == 0 {
                self.pending_blocks -= 1;
                self.free_block(id);
                if !self.config.caching {
                    let seg = self.blocks.get(id.0).segment;
                    self.release_or_keep(dev, seg);
                }
            }
        }
        Ok(())
    }

    fn process_events<D: Device<Event = E>>(&mut self, dev: &D) -> Result<(), AllocError> {
        let mut done = Vec::new();
        let mut result = Ok(());
        'streams: for (_, queue) in &mut self.pending {
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
        self.pending.retain(|(_, q)| !q.is_empty());
        self.events_done(dev, done)?;
        result
    }

    /// Waits for every pending event (PyTorch's `synchronize_and_free_events`).
    fn wait_all_events<D: Device<Event = E>>(&mut self, dev: &D) -> Result<(), AllocError> {
        self.stats.num_sync_all_streams += 1;
        let mut done = Vec::new();
        let mut result = Ok(());
        for (stream, mut queue) in std::mem::take(&mut self.pending) {
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
                self.pending.push((stream, queue));
            }
        }
        self.events_done(dev, done)?;
        result
    }

    /// Whether a segment is a single free block, or a slab with no chunk in
    /// use (releasable).
    fn segment_is_free(&self, seg: SegmentId) -> bool {
        let s = self.segments.get(seg.0);
        if let Some(slab) = &s.slab {
            return slab.live == 0;
        }
        let b = self.blocks.get(s.head.0);
        b.state == BlockState::Free && b.next.is_none() && !s.is_expandable()
    }

    /// The operation count since which an entirely free segment has been free.
    fn free_since(&self, seg: SegmentId) -> u64 {
        let s = self.segments.get(seg.0);
        match &s.slab {
            Some(slab) => slab.idle_since,
            None => self.blocks.get(s.head.0).freed_at,
        }
    }

    /// Frees an entirely free segment to the device.
    fn release_segment<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        seg: SegmentId,
    ) -> Result<u64, AllocError> {
        debug_assert!(self.segment_is_free(seg));
        let s = self.segments.get(seg.0);
        let (addr, size, pool, head, slab) = (s.addr, s.size, s.pool, s.head, s.slab.is_some());
        dev.free(DevicePtr(addr), size)?;
        if slab {
            self.drop_slab(seg);
        } else {
            self.bins_mut(pool).remove(size, addr, head);
            self.blocks.discard(head.0);
        }
        self.segments.remove(seg.0);
        self.segment_by_addr.remove(&addr);
        let kind = pool.kind();
        self.stats.segment.decrease(kind, 1);
        self.stats.reserved_bytes.decrease(kind, size);
        self.stats.num_device_free += 1;
        if size >= self.config.max_split_size {
            self.stats.oversize_segments.decrease(1);
        }
        Ok(size)
    }

    /// Lists `seg` among the free candidates if it is entirely free (under
    /// its current idle age).
    fn note_maybe_free(&mut self, seg: SegmentId) {
        if self.segment_is_free(seg) {
            let s = self.segments.get(seg.0);
            let (addr, kind) = (s.addr, s.pool.kind());
            self.free_candidates[kind as usize].insert((self.free_since(seg), addr, seg.0));
        }
    }

    /// Whether an entry of `free_candidates` is an entirely free segment
    /// (free since then).
    fn free_candidate_holds(&self, (since, addr, id): (u64, u64, u32)) -> bool {
        let seg = SegmentId(id);
        self.segment_by_addr.get(&addr) == Some(&seg)
            && self.segment_is_free(seg)
            && self.free_since(seg) == since
    }

    /// Entirely free segments (any pool, any stream), lowest address first.
    /// Drops the candidates that are not (or no longer exist).
    fn free_segments(&mut self) -> Vec<(u64, SegmentId)> {
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

    /// [`State::release_free_segments`] in `ReleaseOrder::Oldest`: walks the
    /// candidates oldest first and stops once `need` bytes are released (or
    /// at the first one idle for less than `min_idle`).
    fn release_oldest_segments<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        need: u64,
        min_idle: u64,
        kind: Option<PoolKind>,
    ) -> Result<u64, AllocError> {
        use std::ops::Bound::{Excluded, Unbounded};
        let mut total = 0;
        // Per kind: the last entry looked at; the walk merges the kinds asked for.
        let mut cursor: [Option<(u64, u64, u32)>; 3] = [None; 3];
        let mut stale = Vec::new();
        let mut result = Ok(());
        while total < need {
            let mut next: Option<(usize, (u64, u64, u32))> = None;
            for (k, set) in self.free_candidates.iter().enumerate() {
                if kind.is_some_and(|want| want as usize != k) {
                    continue;
                }
                let from = cursor[k].map_or(Unbounded, Excluded);
                if let Some(&e) = set.range((from, Unbounded)).next() {
                    if next.map_or(true, |(_, n)| e < n) {
                        next = Some((k, e));
                    }
                }
            }
            let Some((k, e)) = next else {
                break;
            };
            cursor[k] = Some(e);
            if !self.free_candidate_holds(e) {
                stale.push((k, e));
                continue;
            }
            if self.clock - e.0 < min_idle {
                break; // the rest are younger
            }
            match self.release_segment(dev, SegmentId(e.2)) {
                Ok(size) => total += size,
                Err(err) => {
                    result = Err(err);
                    break;
                }
            }
            stale.push((k, e));
        }
        for (k, e) in stale {
            self.free_candidates[k].remove(&e);
        }
        result.map(|()| total)
    }

    /// Waits for events and releases every entirely free segment.
    fn release_cached<D: Device<Event = E>>(&mut self, dev: &D) -> Result<Released, AllocError> {
        // Counted from the stats, so that segments released on the way (a
        // no-caching block whose event the wait completed) are included.
        let before = (
            self.stats.reserved_bytes.all().freed,
            self.stats.segment.all().freed,
        );
        self.wait_all_events(dev)?;
        for (_, seg) in self.free_segments() {
            self.release_segment(dev, seg)?;
        }
        if self.granularity.is_some() {
            self.release_expandable(dev)?;
        }
        Ok(Released {
            bytes: self.stats.reserved_bytes.all().freed - before.0,
            segments: self.stats.segment.all().freed - before.1,
        })
    }

    /// Advances the byte clock; marks it against the operation clock now and then.
    #[inline]
    fn tick_bytes(&mut self, rounded: u64) {
        self.bytes_clock += rounded;
        if self
            .byte_marks
            .back()
            .map_or(true, |&(op, _)| self.clock >= op + BYTE_MARK_EVERY)
        {
            if self.byte_marks.len() >= BYTE_MARKS {
                self.byte_marks.pop_front();
            }
            self.byte_marks.push_back((self.clock, self.bytes_clock));
        }
    }

    /// Bytes allocated since operation `op` (to within [`BYTE_MARK_EVERY`]
    /// operations; before the oldest mark: everything since the start).
    fn bytes_since(&self, op: u64) -> u64 {
        let i = self.byte_marks.partition_point(|&(o, _)| o <= op);
        let then = if i == 0 { 0 } else { self.byte_marks[i - 1].1 };
        self.bytes_clock - then
    }

    /// Releases entirely free segments totalling at least `need` bytes, in
    /// `release_order`; only segments idle for `min_idle` operations and
    /// (`release_idle_frac`, when `idle_rule` is set) for that fraction of
    /// the peak allocated bytes allocated since, and only of pool kind
    /// `kind` when given.
    /// Returns the bytes released (possibly less than `need`).
    fn release_free_segments<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        need: u64,
        min_idle: u64,
        idle_rule: bool,
        kind: Option<PoolKind>,
    ) -> Result<u64, AllocError> {
        let frac = self.config.release_idle_frac;
        if self.config.release_order == ReleaseOrder::Oldest && !(idle_rule && frac > 0.0) {
            // The walk in idle order; with an idle age in bytes, the filter below.
            return self.release_oldest_segments(dev, need, min_idle, kind);
        }
        let mut free = self.free_segments();
        if idle_rule && frac > 0.0 {
            let min_bytes = (frac * self.stats.allocated_bytes.all().peak as f64) as u64;
            free.retain(|&(_, seg)| self.bytes_since(self.free_since(seg)) >= min_bytes);
        }
        if let Some(k) = kind {
            free.retain(|&(_, seg)| self.segments.get(seg.0).pool.kind() == k);
        }
        if min_idle > 0 {
            let now = self.clock;
            free.retain(|&(_, seg)| now - self.free_since(seg) >= min_idle);
        }
        if free.is_empty() {
            return Ok(0);
        }
        match self.config.release_order {
            ReleaseOrder::SmallestFit => {
                free.sort_unstable();
                if let Some(&(_, seg)) = free.iter().find(|(size, _)| *size >= need) {
                    return self.release_segment(dev, seg);
                }
                free.reverse();
            }
            ReleaseOrder::Largest => {
                free.sort_unstable();
                free.reverse();
            }
            ReleaseOrder::Oldest => {
                free.sort_by_key(|&(_, seg)| self.free_since(seg));
            }
        }
        let mut total = 0;
        for &(_, seg) in &free {
            if total >= need {
                break;
            }
            total += self.release_segment(dev, seg)?;
        }
        Ok(total)
    }

    /// The ladder's middle step: release cached segments that make room.
    fn release_available<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        pool: PoolId,
        rounded: u64,
        seg_size: u64,
    ) -> Result<bool, AllocError> {
        if !self.config.oom_flush {
            return Ok(false);
        }
        let max_split = self.config.max_split_size;
        if max_split != u64::MAX {
            return self.release_oversize(dev, pool, rounded);
        }
        if !self.config.release_before_grow {
            return Ok(false);
        }
        let headroom = match self.cap {
            Some(cap) => cap.saturating_sub(self.reserved()),
            None => dev.mem_info()?.free,
        };
        let need = seg_size.saturating_sub(headroom).max(1);
        Ok(self.release_free_segments(dev, need, 0, false, None)? > 0)
    }

    /// PyTorch's `release_available_cached_blocks` (only with `max_split_size`):
    /// free one oversize block of the pool that fits, else the largest ones.
    fn release_oversize<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        pool: PoolId,
        rounded: u64,
    ) -> Result<bool, AllocError> {
        let max_split = self.config.max_split_size;
        let key = rounded.max(max_split);
        let Some(bins) = self.bins[pool.index()].as_ref() else {
            return Ok(false);
        };
        let candidates: Vec<BlockId> = match bins.best_fit(key) {
            Some((_, _, id)) => vec![id],
            None => {
                let mut total = 0;
                let mut v = Vec::new();
                for (size, _, id) in bins.iter().rev() {
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
            let b = self.blocks.get(id.0);
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
    fn garbage_collect<D: Device<Event = E>>(&mut self, dev: &D) -> Result<(), AllocError> {
        let (Some(t), Some(cap)) = (self.config.garbage_collection_threshold, self.cap) else {
            return Ok(());
        };
        let threshold = (t * cap as f64) as u64;
        if self.reserved() <= threshold {
            return Ok(());
        }
        let target = self.reserved() - threshold;
        let age = |st: &Self, id: BlockId| {
            let b = st.blocks.get(id.0);
            st.lookups[b.pool.index()] - b.gc_base
        };
        let mut candidates: Vec<BlockId> = Vec::new();
        for (i, bins) in self.bins.iter().enumerate() {
            if let (Some(bins), PoolKind::Large | PoolKind::Huge) = (bins, PoolId(i as u32).kind())
            {
                candidates.extend(bins.iter().map(|e| e.2).filter(|id| {
                    let b = self.blocks.get(id.0);
                    !b.is_split() && !self.segments.get(b.segment.0).is_expandable()
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
                let seg = self.blocks.get(id.0).segment;
                reclaimed += self.release_segment(dev, seg)?;
            }
            candidates = keep;
        }
        Ok(())
    }

    /// Free bytes in free blocks and the largest free block, over all pools.
    /// Free bytes and the largest free block. In expandable segments only
    /// mapped bytes count: unmapped address space is not memory.
    fn fragmentation_totals(&self) -> (u64, u64) {
        let mut free = 0;
        let mut largest = 0;
        for (i, bins) in self.bins.iter().enumerate() {
            let Some(bins) = bins else { continue };
            match self.ranges.get(i).is_some_and(|r| !r.is_empty()) {
                true => {
                    for (size, addr, id) in bins.iter() {
                        let s = self.segments.get(self.blocks.get(id.0).segment.0);
                        let mapped = self.mapped_bytes_in(s, addr, addr + size);
                        free += mapped;
                        largest = largest.max(mapped);
                    }
                }
                false => {
                    free += bins.bytes();
                    largest = largest.max(bins.largest().map_or(0, |e| e.0));
                }
            }
        }
        // Free chunks and uncarved tails of slabs are outside the bins.
        for s in self.slab_segments() {
            let mut cur = Some(s.head);
            while let Some(id) = cur {
                let b = self.blocks.get(id.0);
                if b.state == BlockState::Free {
                    free += b.size;
                    largest = largest.max(b.size);
                }
                cur = b.next;
            }
        }
        (free, largest)
    }

    /// The slab segments, full ones included.
    fn slab_segments(&self) -> impl Iterator<Item = &Segment> + '_ {
        self.segment_by_addr
            .values()
            .map(|&seg| self.segments.get(seg.0))
            .filter(|s| s.slab.is_some())
    }

    fn fragmentation(&self) -> FragmentationReport {
        let (free, largest) = self.fragmentation_totals();
        let mut segments = Vec::with_capacity(self.segments.len());
        let mut releasable = 0;
        for &seg in self.segment_by_addr.values() {
            let s = self.segments.get(seg.0);
            let (mut used, mut largest_free, mut blocks) = (0, 0, 0);
            let mut cur = Some(s.head);
            while let Some(id) = cur {
                let b = self.blocks.get(id.0);
                if b.state == BlockState::Free {
                    largest_free =
                        largest_free.max(self.mapped_bytes_in(s, b.addr, b.addr + b.size));
                    if s.is_expandable() {
                        releasable += self.idle_bytes_in(s, b.addr, b.addr + b.size);
                    }
                } else {
                    used += b.size;
                }
                blocks += 1;
                cur = b.next;
            }
            if used == 0 && (blocks == 1 || s.slab.is_some()) && !s.is_expandable() {
                releasable += s.size;
            }
            segments.push(SegmentUse {
                addr: DevicePtr(s.addr),
                size: self.mapped_bytes_in(s, s.addr, s.addr + s.size),
                used,
                largest_free,
                blocks,
                pool: s.pool.kind(),
            });
        }
        releasable += self.pooled_bytes();
        FragmentationReport {
            allocated: self.stats.allocated_bytes.all().current,
            reserved: self.reserved(),
            free,
            inactive_split: self.stats.inactive_split_bytes.all().current,
            releasable,
            largest_free_block: largest,
            segments,
        }
    }

    fn snapshot(&self) -> Snapshot {
        let mut segments = Vec::with_capacity(self.segments.len());
        for &seg in self.segment_by_addr.values() {
            let s = self.segments.get(seg.0);
            let mut blocks = Vec::new();
            let (mut allocated, mut requested) = (0, 0);
            let mut cur = Some(s.head);
            while let Some(id) = cur {
                let b = self.blocks.get(id.0);
                if b.state == BlockState::Allocated {
                    allocated += b.size;
                    requested += b.requested;
                }
                blocks.push(BlockSnapshot {
                    address: DevicePtr(b.addr),
                    size: b.size,
                    requested_size: b.requested,
                    state: b.state,
                    stream_uses: b.stream_uses.to_vec(),
                });
                cur = b.next;
            }
            segments.push(SegmentSnapshot {
                address: DevicePtr(s.addr),
                total_size: s.size,
                mapped_size: self.mapped_bytes_in(s, s.addr, s.addr + s.size),
                allocated_size: allocated,
                requested_size: requested,
                stream: s.stream,
                pool: s.pool.kind(),
                blocks,
            });
        }
        Snapshot { segments }
    }

    fn check_invariants(&self) -> Result<(), String> {
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
            if let Some(slab) = &s.slab {
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
                if b.slab != s.slab.is_some() {
                    return Err(format!(
                        "block at {:#x} is marked as a slab's: {}, its segment is a slab: {}",
                        b.addr,
                        b.slab,
                        s.slab.is_some()
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
        for &(_, kind, size) in &self.page_pool {
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
        if held != self.cached_blocks {
            return Err(format!(
                "{held} blocks held by thread caches but {} counted",
                self.cached_blocks
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

mod expandable;
mod layout;
mod slabs;
mod thread_cache;
use slabs::SlabLists;
use thread_cache::ThreadCacheReview;

#[cfg(test)]
mod tests;
