//! The caching allocator: size classes, pools per stream, splitting and
//! merging, stream events, `empty_cache` and the out-of-memory ladder.
//!
//! All state sits behind one `parking_lot` mutex per allocator (per device),
//! as in PyTorch, with per-thread caches in front of it (`crate::thread_cache`): a
//! thread's repeated request of one size takes back the block it freed
//! without the allocator's lock. The state is split into plain records
//! (blocks, segments, bins) so that page-backed growable segments can reuse
//! the same block lists. This file holds the public methods and the state;
//! the phases have files of their own (`malloc`, `free`, `grow` for the
//! ladder and the release rules, `inspect`, `invariants`), as do the
//! features (`expandable`, `slabs`, `thread_cache`, `layout`).

use crate::addrmap::AddrMap;
use crate::arena::Arena;
use crate::bins::Bins;
use crate::block::{
    Block, BlockId, BlockState, Listed, PoolId, PoolKind, Segment, SegmentId, SegmentKind,
};
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
    /// Things the user should know about the configuration (e.g. a fallback).
    notices: Vec<String>,
    /// Expandable segments' own state (virtual ranges, pages, markers).
    vmm: expandable::Expandable<E>,
    /// The per-thread caches' state on the allocator's side.
    caches: thread_cache::ThreadCaches,
    /// Slab segments' lists and size limit.
    slabs: slabs::SlabPools,
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
                notices,
                vmm: expandable::Expandable::<D::Event>::new(granularity, range_size),
                caches: thread_cache::ThreadCaches::new(thread_cache),
                slabs: slabs::SlabPools::new(slab_max),
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
        self.state.lock().vmm.granularity.is_some()
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
            self.thread_cache_enabled && st.caches.review.paying,
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
        self.slabs.slab_lists.resize_with(pools, || None);
        self.lookups.resize(pools, 0);
        self.vmm.ranges.resize_with(pools, Vec::new);
        self.vmm
            .marks
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
}

mod expandable;
mod free;
mod grow;
mod inspect;
mod invariants;
mod layout;
mod malloc;
mod slabs;
mod thread_cache;

#[cfg(test)]
mod tests;
