//! The public methods of [`CachingAllocator`]: construction, `malloc` and
//! `free` (with the thread caches' lock-free path in front of the state's
//! lock), events, `empty_cache`, the memory cap, statistics, reports and
//! trace recording.

use super::*;
use crate::config::{find_key, ConfigError};

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
                _ => notices.push(format!(
                    "{}: expandable segments need the CUDA virtual memory API (cuMemCreate/cuMemMap), \
                     which this device or driver does not offer; using plain segments (the \
                     `segments` policy) instead",
                    config.name
                )),
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
                core: Core {
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
                    deferred: Vec::new(),
                    stream_waits: Vec::new(),
                    borrow_from: 0,
                    stats,
                    clock: 0,
                    recorder: None,
                    notices,
                    granularity,
                    idle_index: Default::default(),
                    supply: Default::default(),
                    pins: Default::default(),
                    config,
                },
                vmm: expandable::Expandable::<D::Event>::new(range_size),
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
        self.state.lock().core.notices.clone()
    }

    /// Expandable segments: the old mappings of pages reused early by a
    /// block of their own stream that are not unmapped yet (they go once the stream
    /// is past them, or in `empty_cache`), as (address, bytes, whether the
    /// page is pooled rather than mapped under a block, told once per page).
    /// They hold no memory
    /// of their own: the page is counted once, where it is mapped or pooled.
    pub fn stale_mappings(&self) -> Vec<(DevicePtr, u64, bool)> {
        let st = self.state.lock();
        st.vmm
            .stale_mappings(&st.core)
            .into_iter()
            .map(|m| (DevicePtr(m.addr), m.bytes, m.pooled))
            .collect()
    }

    /// The mappings of pages shared by granules of several ranges
    /// (`expandable_share`) at each member but the one that counts the
    /// page, as (address, bytes): they hold no memory of their own.
    pub fn shared_mappings(&self) -> Vec<(DevicePtr, u64)> {
        let st = self.state.lock();
        st.vmm
            .alias_mappings(&st.core)
            .into_iter()
            .map(|m| (DevicePtr(m.addr), m.bytes))
            .collect()
    }

    /// Whether expandable (page-backed) segments are in use.
    pub fn is_expandable(&self) -> bool {
        self.state.lock().core.granularity.is_some()
    }

    /// The configuration in force.
    pub fn config(&self) -> Config {
        self.state.lock().core.config.clone()
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
        st.core.publish_reserved();
        if let Some(on) = st.review_thread_caches() {
            if st.core.recorder.is_none() {
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
        self.state.lock().caches.register_slot()
    }

    /// Counts `ops` mallocs and frees that were served outside this
    /// allocator on its operation clock, as if
    /// they had been its own: for policy studies that route some requests
    /// elsewhere (the lab's `slab_eval`). Only with the `testing` feature.
    #[cfg(feature = "testing")]
    pub fn count_foreign_ops(&self, ops: u64) {
        self.state.lock().core.clock += ops;
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
        let st = &mut *self.state.lock();
        let r = st.process_events(&self.device);
        st.core.publish_reserved();
        r
    }

    /// Waits for pending events, then releases every entirely free segment to
    /// the device. Partly used segments stay; [`CachingAllocator::fragmentation`]
    /// reports their free bytes.
    pub fn empty_cache(&self) -> Result<Released, AllocError> {
        let st = &mut *self.state.lock();
        if let Some(r) = st.core.recorder.as_mut() {
            (r.sink)(&TraceEvent::EmptyCache);
        }
        st.flush_thread_caches();
        let r = st.release_cached(&self.device);
        st.core.publish_reserved();
        r
    }

    /// Sets (or lifts, with `None`) the cap on reserved memory. If reserved
    /// memory is above the new cap, entirely free segments are released now.
    pub fn set_memory_cap(&self, cap: Option<MemoryCap>) -> Result<(), AllocError> {
        let total = self.device.mem_info()?.total;
        let st = &mut *self.state.lock();
        st.core.config.memory_cap = cap;
        st.core.cap = cap.map(|c| c.bytes(total));
        st.core.publish_cap();
        if st.core.cap_now().is_some_and(|c| st.core.reserved() > c) {
            st.flush_thread_caches();
            let r = st.release_cached(&self.device);
            st.core.publish_reserved();
            r?;
        }
        Ok(())
    }

    /// Sets (or turns off, with `None`) `garbage_collection_threshold` while
    /// the allocator runs: Note [Run-time settings] in `pytorch_conf.rs`. A
    /// threshold outside (0, 1) is refused and nothing changes.
    pub fn set_garbage_collection_threshold(&self, t: Option<f64>) -> Result<(), ConfigError> {
        if let Some(t) = t {
            find_key("garbage_collection_threshold")
                .expect("a key of the table")
                .kind
                .parse(&t.to_string())
                .map_err(|why| ConfigError::BadValue {
                    key: "garbage_collection_threshold".into(),
                    value: t.to_string(),
                    why,
                })?;
        }
        self.state.lock().core.config.garbage_collection_threshold = t;
        Ok(())
    }

    /// Sets `max_non_split_rounding` (bytes) while the allocator runs: Note
    /// [Run-time settings] in `pytorch_conf.rs`. A value outside the key's
    /// bounds (20 MiB to 1 PiB) is refused and nothing changes.
    pub fn set_max_non_split_rounding(&self, bytes: u64) -> Result<(), ConfigError> {
        let key = find_key("max_non_split_rounding_mb").expect("a key of the table");
        let mb = bytes / (1 << 20);
        if bytes % (1 << 20) != 0 || key.kind.parse(&mb.to_string()).is_err() {
            return Err(ConfigError::BadValue {
                key: key.name.into(),
                value: bytes.to_string(),
                why: format!("must be a whole number of MiB in {}", key.kind.range_text()),
            });
        }
        self.state.lock().core.config.max_non_split_rounding = bytes;
        Ok(())
    }

    /// The cap on reserved memory in bytes, if any.
    pub fn memory_cap(&self) -> Option<u64> {
        self.state.lock().core.cap
    }

    /// A copy of the statistics (PyTorch's `memory_stats()`).
    ///
    /// With thread caches, what threads did without the allocator's lock is
    /// folded in now: `current` values and totals are exact; a peak may count
    /// blocks a thread took back from its cache and freed again since the
    /// last read as if both were live at once (see `docs/POLICY.md`).
    pub fn stats(&self) -> MemoryStats {
        let st = &mut *self.state.lock();
        st.caches.sync_thread_caches(&mut st.core);
        st.core.stats.clone()
    }

    /// Current allocated / reserved / requested bytes, cheaply.
    pub fn usage(&self) -> Usage {
        let st = &mut *self.state.lock();
        st.caches.sync_thread_caches(&mut st.core);
        Usage {
            allocated: st.core.stats.allocated_bytes.all().current,
            reserved: st.core.reserved(),
            requested: st.core.stats.requested_bytes.all().current,
            num_alloc_retries: st.core.stats.num_alloc_retries,
        }
    }

    /// Resets every peak statistic to its current value.
    pub fn reset_peak_stats(&self) {
        let st = &mut *self.state.lock();
        st.caches.sync_thread_caches(&mut st.core);
        st.core.stats.reset_peak();
    }

    /// How fragmented the cache is now.
    /// Blocks parked in thread caches go back to the bins first.
    pub fn fragmentation(&self) -> FragmentationReport {
        let st = &mut *self.state.lock();
        st.flush_thread_caches();
        st.fragmentation()
    }

    /// PyTorch's `cacheInfo` asked with a zero guess: the largest block a
    /// request could get now, which is the largest cached free block or the
    /// memory the device (within the cap) would still give, whichever is
    /// larger. cuDNN's benchmark mode keeps only the algorithms whose
    /// workspace fits in it, so reporting only cached blocks would hide the
    /// fast ones from a tight cache.
    pub fn cache_info(&self) -> Result<u64, AllocError> {
        let st = &mut *self.state.lock();
        st.flush_thread_caches();
        let cached = st.fragmentation_totals().1;
        let free = self.device.mem_info()?.free;
        let headroom = match st.core.cap_now() {
            Some(cap) => free.min(cap.saturating_sub(st.core.reserved())),
            None => free,
        };
        Ok(cached.max(headroom))
    }

    /// Every segment and block.
    pub fn snapshot(&self) -> Snapshot {
        let st = &mut *self.state.lock();
        st.caches.sync_thread_caches(&mut st.core);
        st.core.snapshot()
    }

    /// Starts sending every malloc / free / empty_cache to `sink` as trace
    /// events (ids are assigned in allocation order). Replaces any earlier sink.
    /// Thread caches are off while recording, so that every call is seen.
    pub fn start_recording(&self, sink: TraceSink) {
        let st = &mut *self.state.lock();
        self.thread_cache_on.store(false, Ordering::Relaxed);
        st.flush_thread_caches();
        let mut ids = FastMap::default();
        let mut next_id = 0;
        // Allocations already live get ids too, so that their frees are valid
        // in the trace; their allocation lines are emitted first.
        let mut sink = sink;
        let mut live: Vec<(u64, BlockId)> = st.core.live.iter().collect();
        live.sort_unstable();
        for (addr, id) in live {
            let b = st.core.blocks.get(id.0);
            let stream = st.core.segments.get(b.segment.0).stream;
            sink(&TraceEvent::Alloc {
                id: next_id,
                bytes: b.requested,
                stream: stream.0,
            });
            ids.insert(addr, next_id);
            next_id += 1;
        }
        st.core.recorder = Some(Recorder { sink, ids, next_id });
    }

    /// Stops recording; returns whether a recording was running.
    pub fn stop_recording(&self) -> bool {
        let st = &mut *self.state.lock();
        self.thread_cache_on.store(
            self.thread_cache_enabled && st.caches.paying(),
            Ordering::Relaxed,
        );
        st.core.recorder.take().is_some()
    }

    /// Checks every internal invariant; the first violation is returned as text.
    ///
    /// Segments tile exactly into address-ordered blocks, no two free
    /// neighbours are left unmerged, every free block is in its bins and only
    /// there, the address map holds exactly the allocated blocks, pending
    /// events match the blocks awaiting them, and every statistic equals what
    /// the blocks recompute. Used by the property tests and the fuzzers.
    pub fn check_invariants(&self) -> Result<(), String> {
        let st = &mut *self.state.lock();
        st.caches.sync_thread_caches(&mut st.core);
        st.check_invariants()?;
        st.core.check_pins()?;
        for (&addr, &seg) in &st.core.segment_by_addr {
            let kind = st.core.segments.get(seg.0).pool.kind() as usize;
            if st.core.segment_is_free(seg)
                && !st.core.free_candidates[kind].contains(&(st.core.free_since(seg), addr, seg.0))
            {
                return Err(format!(
                    "free segment at {addr:#x} is not among the free candidates"
                ));
            }
        }
        st.caches.check_slots(&mut st.core)
    }
}
