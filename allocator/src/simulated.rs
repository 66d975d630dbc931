//! A fake device for tests and trace replay.
//!
//! `SimulatedDevice` hands out deterministic addresses from a 64-bit space
//! that never holds any memory, enforces a capacity, counts every driver
//! call, fails on demand, and keeps events pending until the test completes
//! them. It is a cheap handle: clones share one state, so a test keeps a
//! clone to steer the device the allocator owns.

use crate::device::{Device, DeviceError, DevicePtr, MemInfo, StreamId};
use parking_lot::Mutex;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// Highest simulated address; segments are laid out downwards from here,
/// each below the last, the way the H200's driver placed PyTorch's segments.
const TOP_ADDRESS: u64 = 0x7f00_0000_0000;
/// Alignment of simulated segments (the driver aligns allocations to at least this).
const SEGMENT_ALIGN: u64 = 512;

/// Counters of the calls the allocator made to the device.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct SimCounters {
    /// Successful segment allocations.
    pub allocs: u64,
    /// Segment frees.
    pub frees: u64,
    /// Allocation attempts that failed (capacity or injected).
    pub failed_allocs: u64,
    /// Events recorded.
    pub events_recorded: u64,
    /// Events recorded on a stream being captured (they would join the graph).
    pub events_in_capture: u64,
    /// Event queries.
    pub event_queries: u64,
    /// Blocking event waits.
    pub event_waits: u64,
    /// Device synchronizations.
    pub synchronizes: u64,
    /// Waits of one stream for an event, queued on the device.
    pub stream_waits: u64,
    /// Virtual ranges reserved.
    pub vmm_reserves: u64,
    /// Physical pages created.
    pub vmm_creates: u64,
    /// Physical pages released.
    pub vmm_releases: u64,
    /// Page maps.
    pub vmm_maps: u64,
    /// Unmap calls (one may unmap several pages side by side).
    pub vmm_unmaps: u64,
    /// Mappings removed by unmap calls.
    pub vmm_pages_unmapped: u64,
    /// Device-to-device copies ([`Device::copy`]).
    pub copies: u64,
    /// Bytes copied by [`Device::copy`].
    pub copied_bytes: u64,
    /// With a lag ([`SimulatedDevice::with_event_lag`]): the device work,
    /// in host operations, that blocking waits and synchronizes waited out
    /// (how far behind the waited-for point the device still was).
    pub stalled_ops: u64,
    /// Calls that failed because of [`SimulatedDevice::inject_faults`] or
    /// [`SimulatedDevice::fail_calls`].
    pub injected_faults: u64,
}

/// Device calls that fault injection can make fail, as bits of a mask.
pub mod calls {
    /// `allocate`.
    pub const ALLOCATE: u32 = 1 << 0;
    /// `free`.
    pub const FREE: u32 = 1 << 1;
    /// `record_event`.
    pub const RECORD_EVENT: u32 = 1 << 2;
    /// `event_completed`.
    pub const EVENT_QUERY: u32 = 1 << 3;
    /// `wait_event`.
    pub const WAIT_EVENT: u32 = 1 << 4;
    /// `synchronize`.
    pub const SYNCHRONIZE: u32 = 1 << 5;
    /// `mem_info`.
    pub const MEM_INFO: u32 = 1 << 6;
    /// `vmm_reserve`.
    pub const VMM_RESERVE: u32 = 1 << 7;
    /// `vmm_free_range`.
    pub const VMM_FREE_RANGE: u32 = 1 << 8;
    /// `vmm_create_page`.
    pub const VMM_CREATE: u32 = 1 << 9;
    /// `vmm_release_page`.
    pub const VMM_RELEASE: u32 = 1 << 10;
    /// `vmm_map`.
    pub const VMM_MAP: u32 = 1 << 11;
    /// `vmm_unmap`.
    pub const VMM_UNMAP: u32 = 1 << 12;
    /// `copy`.
    pub const COPY: u32 = 1 << 13;
    /// Every call above.
    pub const ALL: u32 = (1 << 14) - 1;
}

/// A seeded schedule of failing device calls: each call named in `calls`
/// fails with probability `1 / one_in`, decided by a generator seeded with
/// `seed` (the same seed and the same calls give the same failures).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FaultPlan {
    /// Seed of the schedule.
    pub seed: u64,
    /// One call in this many fails, on average (0 or 1: every call).
    pub one_in: u32,
    /// Which calls may fail (bits of [`calls`]).
    pub calls: u32,
}

/// A simulated event: completes when the test says so (or on a wait/synchronize).
#[derive(Debug, PartialEq, Eq)]
pub struct SimEvent {
    id: u64,
}

impl SimEvent {
    /// The event's number, to complete it with [`SimulatedDevice::complete_event`].
    pub fn id(&self) -> u64 {
        self.id
    }
}

#[derive(Debug)]
struct SimState {
    capacity: u64,
    used: u64,
    next_addr: u64,
    /// Released address space below `next_addr`: start → bytes.
    holes: BTreeMap<u64, u64>,
    segments: BTreeMap<u64, u64>,
    fail_next: u64,
    fail_above: Option<u64>,
    next_event: u64,
    pending_events: BTreeMap<u64, StreamId>,
    /// Streams being captured into a CUDA graph ([`SimulatedDevice::set_capturing`]).
    capturing: Vec<StreamId>,
    auto_complete: bool,
    /// Host operations (`tick`s) after which a recorded event completes.
    event_lag: Option<u64>,
    /// Host operations so far (`tick`).
    clock: u64,
    /// Pending events in the order recorded, with the clock then (with a lag).
    born: VecDeque<(u64, u64)>,
    counters: SimCounters,
    granularity: u64,
    ranges: BTreeMap<u64, u64>,
    /// Physical pages: handle → bytes.
    pages: BTreeMap<u64, u64>,
    next_page: u64,
    /// Mappings: address → (page, bytes).
    mapped: BTreeMap<u64, (u64, u64)>,
    /// Mappings per physical page (those in `mapped`), so that a release
    /// asks whether a page is mapped without a walk over every mapping.
    maps_of_page: BTreeMap<u64, u32>,
    /// The seeded schedule, with its generator's state.
    faults: Option<(FaultPlan, u64)>,
    /// Calls (bits of [`calls`]) that fail `n` times after `skip` more succeed: (calls, skip, n).
    fail_calls: Vec<(u32, u64, u64)>,
}

impl SimState {
    /// Whether this `call` fails now (injected); counts it.
    fn fault(&mut self, call: u32, name: &'static str) -> Result<(), DeviceError> {
        let mut fail = false;
        if let Some((_, skip, n)) = self
            .fail_calls
            .iter_mut()
            .find(|(c, _, n)| c & call != 0 && *n > 0)
        {
            if *skip > 0 {
                *skip -= 1;
            } else {
                *n -= 1;
                fail = true;
            }
        }
        if let Some((plan, state)) = self.faults.as_mut() {
            if plan.calls & call != 0 {
                // xorshift64*
                *state ^= *state >> 12;
                *state ^= *state << 25;
                *state ^= *state >> 27;
                let r = state.wrapping_mul(0x2545_f491_4f6c_dd1d);
                fail |= plan.one_in <= 1 || r % u64::from(plan.one_in) == 0;
            }
        }
        if fail {
            self.counters.injected_faults += 1;
            return Err(DeviceError::Driver {
                name: "CUDA_ERROR_UNKNOWN (injected)".into(),
                call: name,
            });
        }
        Ok(())
    }
}

/// A simulated device; see the module docs.
#[derive(Clone, Debug)]
pub struct SimulatedDevice {
    state: Arc<Mutex<SimState>>,
}

impl SimulatedDevice {
    /// A device with `capacity` bytes of memory. Events stay pending until completed.
    pub fn new(capacity: u64) -> Self {
        SimulatedDevice {
            state: Arc::new(Mutex::new(SimState {
                capacity,
                used: 0,
                next_addr: TOP_ADDRESS,
                holes: BTreeMap::new(),
                segments: BTreeMap::new(),
                fail_next: 0,
                fail_above: None,
                next_event: 1,
                pending_events: BTreeMap::new(),
                capturing: Vec::new(),
                auto_complete: false,
                event_lag: None,
                clock: 0,
                born: VecDeque::new(),
                counters: SimCounters::default(),
                granularity: 2 << 20,
                ranges: BTreeMap::new(),
                pages: BTreeMap::new(),
                next_page: 1,
                mapped: BTreeMap::new(),
                maps_of_page: BTreeMap::new(),
                faults: None,
                fail_calls: Vec::new(),
            })),
        }
    }

    /// A device whose capacity is, for practical purposes, unlimited (1 PiB).
    pub fn unlimited() -> Self {
        Self::new(1 << 50)
    }

    /// The same device without the virtual memory API (as an old driver or
    /// a device that lacks it): [`Device::vmm_granularity`] is `None`, so
    /// an allocator asked for expandable segments uses plain ones.
    pub fn without_vmm(self) -> Self {
        self.state.lock().granularity = 0;
        self
    }

    /// A device that runs behind the host: an event completes once the host
    /// made `lag` more operations ([`SimulatedDevice::tick`]), or when waited
    /// for (with the stream's earlier ones), or at a synchronize. `None`: as
    /// `with_auto_complete` says; with a lag, events do not complete at once.
    pub fn with_event_lag(self, lag: Option<u64>) -> Self {
        self.state.lock().event_lag = lag;
        self
    }

    /// One host operation (an allocation or a free): with a lag, the device
    /// catches up with the work recorded `lag` operations ago.
    pub fn tick(&self) {
        let mut s = self.state.lock();
        let Some(lag) = s.event_lag else { return };
        s.clock += 1;
        while let Some(&(id, at)) = s.born.front() {
            if at + lag > s.clock {
                break;
            }
            s.born.pop_front();
            s.pending_events.remove(&id);
        }
    }

    /// Makes every event complete at once (as on a device that is never behind).
    pub fn with_auto_complete(self, on: bool) -> Self {
        self.state.lock().auto_complete = on;
        self
    }

    /// Changes the capacity; live memory above it stays until freed.
    pub fn set_capacity(&self, capacity: u64) {
        self.state.lock().capacity = capacity;
    }

    /// The capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.state.lock().capacity
    }

    /// Makes the next `n` segment allocations fail with out-of-memory.
    pub fn fail_next_allocations(&self, n: u64) {
        self.state.lock().fail_next = n;
    }

    /// Makes every segment allocation above `bytes` fail (`None` lifts it).
    pub fn fail_allocations_above(&self, bytes: Option<u64>) {
        self.state.lock().fail_above = bytes;
    }

    /// Makes device calls fail on a seeded schedule (`None` stops it).
    /// Failing calls change nothing on the device and return a driver error.
    pub fn inject_faults(&self, plan: Option<FaultPlan>) {
        self.state.lock().faults = plan.map(|p| (p, p.seed | 1));
    }

    /// Makes the next `n` calls among `calls` (bits of [`calls`]) fail.
    pub fn fail_calls(&self, calls: u32, n: u64) {
        self.fail_calls_after(calls, 0, n);
    }

    /// Lets `skip` calls among `calls` succeed, then makes `n` fail.
    pub fn fail_calls_after(&self, calls: u32, skip: u64, n: u64) {
        let mut s = self.state.lock();
        s.fail_calls.retain(|&(c, _, _)| c != calls);
        s.fail_calls.push((calls, skip, n));
    }

    /// Stops every injected failure ([`SimulatedDevice::inject_faults`],
    /// [`SimulatedDevice::fail_calls`], [`SimulatedDevice::fail_next_allocations`],
    /// [`SimulatedDevice::fail_allocations_above`]).
    pub fn stop_faults(&self) {
        let mut s = self.state.lock();
        s.faults = None;
        s.fail_calls.clear();
        s.fail_next = 0;
        s.fail_above = None;
    }

    /// Marks `stream` as being captured into a CUDA graph (or not): events
    /// recorded there meanwhile are counted in `events_in_capture`.
    pub fn set_capturing(&self, stream: StreamId, on: bool) {
        let mut s = self.state.lock();
        s.capturing.retain(|&c| c != stream);
        if on {
            s.capturing.push(stream);
        }
    }

    /// Completes one pending event. Returns false if it was not pending.
    pub fn complete_event(&self, id: u64) -> bool {
        self.state.lock().pending_events.remove(&id).is_some()
    }

    /// Completes every pending event recorded on `stream`.
    pub fn complete_stream(&self, stream: StreamId) {
        self.state.lock().pending_events.retain(|_, s| *s != stream);
    }

    /// Completes every pending event.
    pub fn complete_all_events(&self) {
        self.state.lock().pending_events.clear();
    }

    /// Ids of the events still pending, oldest first.
    pub fn pending_events(&self) -> Vec<u64> {
        self.state.lock().pending_events.keys().copied().collect()
    }

    /// The stream a pending event was recorded on (`None` once it completed).
    pub fn event_stream(&self, id: u64) -> Option<StreamId> {
        self.state.lock().pending_events.get(&id).copied()
    }

    /// Whether event `id` is still pending.
    pub fn is_pending(&self, id: u64) -> bool {
        self.state.lock().pending_events.contains_key(&id)
    }

    /// Bytes of device memory in use (segments plus created physical pages).
    pub fn used(&self) -> u64 {
        self.state.lock().used
    }

    /// Number of segments, created physical pages and reserved virtual
    /// ranges the device holds for us.
    pub fn outstanding(&self) -> usize {
        let s = self.state.lock();
        s.segments.len() + s.pages.len() + s.ranges.len()
    }

    /// The reserved virtual ranges as (address, bytes), lowest address first.
    pub fn ranges(&self) -> Vec<(DevicePtr, u64)> {
        let s = self.state.lock();
        s.ranges.iter().map(|(&a, &n)| (DevicePtr(a), n)).collect()
    }

    /// Bytes of created physical pages that are not mapped anywhere.
    pub fn unmapped_page_bytes(&self) -> u64 {
        let s = self.state.lock();
        // A page may be mapped at several addresses at once.
        let mapped: std::collections::HashSet<u64> = s.mapped.values().map(|&(p, _)| p).collect();
        s.pages
            .iter()
            .filter(|(id, _)| !mapped.contains(id))
            .map(|(_, &n)| n)
            .sum()
    }

    /// Bytes of `[ptr, ptr+bytes)` backed by mapped pages.
    pub fn mapped_bytes_in(&self, ptr: DevicePtr, bytes: u64) -> u64 {
        Self::mapped_in(&self.state.lock(), ptr, bytes)
    }

    fn mapped_in(s: &SimState, ptr: DevicePtr, bytes: u64) -> u64 {
        let (lo, hi) = (ptr.0, ptr.0.saturating_add(bytes));
        // A mapping starting below `lo` may reach into the span: start from the last one before it.
        let from = s.mapped.range(..=lo).next_back().map_or(lo, |(&a, _)| a);
        s.mapped
            .range(from..hi)
            .map(|(&a, &(_, n))| (a + n).min(hi).saturating_sub(a.max(lo)))
            .sum()
    }

    /// The page mappings as (address, bytes), lowest address first.
    pub fn mappings(&self) -> Vec<(DevicePtr, u64)> {
        let s = self.state.lock();
        s.mapped
            .iter()
            .map(|(&a, &(_, n))| (DevicePtr(a), n))
            .collect()
    }

    /// The page mappings as (address, page handle, bytes), lowest address
    /// first: where one page is mapped at several addresses.
    pub fn page_mappings(&self) -> Vec<(DevicePtr, u64, u64)> {
        let s = self.state.lock();
        s.mapped
            .iter()
            .map(|(&a, &(p, n))| (DevicePtr(a), p, n))
            .collect()
    }

    /// The live segments as (address, bytes), lowest address first.
    pub fn segments(&self) -> Vec<(DevicePtr, u64)> {
        let s = self.state.lock();
        s.segments
            .iter()
            .map(|(&a, &b)| (DevicePtr(a), b))
            .collect()
    }

    /// The call counters.
    pub fn counters(&self) -> SimCounters {
        self.state.lock().counters
    }

    /// Whether `[ptr, ptr+bytes)` lies inside one live segment.
    pub fn contains(&self, ptr: DevicePtr, bytes: u64) -> bool {
        let s = self.state.lock();
        match s.segments.range(..=ptr.0).next_back() {
            Some((&base, &size)) => ptr.0 >= base && ptr.0 + bytes <= base + size,
            None => false,
        }
    }

    fn take_space(s: &mut SimState, bytes: u64) -> Result<(), DeviceError> {
        if s.fail_next > 0 {
            s.fail_next -= 1;
            s.counters.failed_allocs += 1;
            return Err(DeviceError::OutOfMemory);
        }
        if s.fail_above.is_some_and(|limit| bytes > limit)
            || s.used.saturating_add(bytes) > s.capacity
        {
            s.counters.failed_allocs += 1;
            return Err(DeviceError::OutOfMemory);
        }
        s.used += bytes;
        Ok(())
    }

    /// Address space for `bytes`: below the last segment while there is room
    /// (so addresses descend, as on the H200), else the highest released
    /// hole that fits (so long runs reuse what they gave back).
    fn carve(s: &mut SimState, bytes: u64, align: u64) -> Result<u64, DeviceError> {
        if let Some(addr) = s
            .next_addr
            .checked_sub(bytes)
            .map(|a| a & !(align - 1))
            .filter(|&a| a >= align)
        {
            s.next_addr = addr;
            return Ok(addr);
        }
        let fit = s.holes.iter().rev().find_map(|(&start, &len)| {
            let addr = (start + len).checked_sub(bytes)? & !(align - 1);
            (addr >= start).then_some((start, len, addr))
        });
        let (start, len, addr) = fit.ok_or(DeviceError::OutOfMemory)?;
        Self::split_hole(s, (start, len), addr, bytes);
        Ok(addr)
    }

    /// Address space for `bytes` at exactly `addr`, if that lies inside one hole.
    fn carve_at(s: &mut SimState, addr: u64, bytes: u64) -> Option<u64> {
        let (start, len) = s.holes.range(..=addr).next_back().map(|(&a, &l)| (a, l))?;
        (addr + bytes <= start + len).then(|| {
            Self::split_hole(s, (start, len), addr, bytes);
            addr
        })
    }

    /// Takes `[addr, addr + bytes)` out of the hole `(start, len)` that holds it.
    fn split_hole(s: &mut SimState, (start, len): (u64, u64), addr: u64, bytes: u64) {
        s.holes.remove(&start);
        if addr > start {
            s.holes.insert(start, addr - start);
        }
        if addr + bytes < start + len {
            s.holes.insert(addr + bytes, start + len - addr - bytes);
        }
    }

    /// A virtual range of `bytes`: at `hint` when that lies, aligned, inside
    /// one hole of the address space; else wherever [`Self::carve`] puts it.
    fn reserve_range(&self, bytes: u64, hint: Option<u64>) -> Result<DevicePtr, DeviceError> {
        let mut s = self.state.lock();
        s.fault(calls::VMM_RESERVE, "vmm_reserve")?;
        let g = s.granularity;
        if g == 0 || bytes == 0 || bytes % g != 0 {
            return Err(DeviceError::Driver {
                name: "CUDA_ERROR_INVALID_VALUE".into(),
                call: "vmm_reserve",
            });
        }
        let at = hint
            .filter(|h| h % g == 0)
            .and_then(|h| Self::carve_at(&mut s, h, bytes));
        let addr = match at {
            Some(addr) => addr,
            None => Self::carve(&mut s, bytes, g)?,
        };
        s.ranges.insert(addr, bytes);
        s.counters.vmm_reserves += 1;
        Ok(DevicePtr(addr))
    }

    /// Gives address space back (merged with neighbouring holes).
    fn uncarve(s: &mut SimState, mut addr: u64, mut bytes: u64) {
        if let Some((&prev, &len)) = s.holes.range(..addr).next_back() {
            if prev + len == addr {
                s.holes.remove(&prev);
                addr = prev;
                bytes += len;
            }
        }
        if let Some(len) = s.holes.remove(&(addr + bytes)) {
            bytes += len;
        }
        s.holes.insert(addr, bytes);
    }
}

impl Device for SimulatedDevice {
    type Event = SimEvent;

    fn allocate(&self, bytes: u64) -> Result<DevicePtr, DeviceError> {
        let mut s = self.state.lock();
        s.fault(calls::ALLOCATE, "allocate")?;
        if bytes == 0 {
            return Err(DeviceError::Driver {
                name: "CUDA_ERROR_INVALID_VALUE".into(),
                call: "allocate",
            });
        }
        Self::take_space(&mut s, bytes)?;
        let addr = match Self::carve(&mut s, bytes, SEGMENT_ALIGN) {
            Ok(a) => a,
            Err(e) => {
                s.used -= bytes;
                return Err(e);
            }
        };
        s.segments.insert(addr, bytes);
        s.counters.allocs += 1;
        Ok(DevicePtr(addr))
    }

    fn free(&self, ptr: DevicePtr, bytes: u64) -> Result<(), DeviceError> {
        let mut s = self.state.lock();
        s.fault(calls::FREE, "free")?;
        match s.segments.get(&ptr.0) {
            Some(&size) if size == bytes => {
                s.segments.remove(&ptr.0);
                Self::uncarve(&mut s, ptr.0, size);
                s.used -= size;
                s.counters.frees += 1;
                Ok(())
            }
            _ => Err(DeviceError::InvalidAddress(ptr)),
        }
    }

    fn mem_info(&self) -> Result<MemInfo, DeviceError> {
        let mut s = self.state.lock();
        s.fault(calls::MEM_INFO, "mem_info")?;
        Ok(MemInfo {
            free: s.capacity.saturating_sub(s.used),
            total: s.capacity,
        })
    }

    fn record_event(&self, stream: StreamId) -> Result<SimEvent, DeviceError> {
        let mut s = self.state.lock();
        s.fault(calls::RECORD_EVENT, "record_event")?;
        let id = s.next_event;
        s.next_event += 1;
        s.counters.events_recorded += 1;
        if s.capturing.contains(&stream) {
            s.counters.events_in_capture += 1;
        }
        if !s.auto_complete || s.event_lag.is_some() {
            s.pending_events.insert(id, stream);
        }
        if s.event_lag.is_some() {
            let now = s.clock;
            s.born.push_back((id, now));
        }
        Ok(SimEvent { id })
    }

    fn event_completed(&self, event: &SimEvent) -> Result<bool, DeviceError> {
        let mut s = self.state.lock();
        s.fault(calls::EVENT_QUERY, "event_completed")?;
        s.counters.event_queries += 1;
        Ok(!s.pending_events.contains_key(&event.id))
    }

    fn wait_event(&self, event: &SimEvent) -> Result<(), DeviceError> {
        let mut s = self.state.lock();
        s.fault(calls::WAIT_EVENT, "wait_event")?;
        s.counters.event_waits += 1;
        let stream = s.pending_events.remove(&event.id);
        if let (Some(_), Some(lag)) = (stream, s.event_lag) {
            let born = s
                .born
                .iter()
                .find(|&&(id, _)| id == event.id)
                .map(|&(_, at)| at);
            let stall = born.map_or(0, |at| (at + lag).saturating_sub(s.clock));
            s.counters.stalled_ops += stall;
        }
        // Behind the host, a stream's work runs in order: what came before is done too.
        if let (Some(stream), Some(_)) = (stream, s.event_lag) {
            s.pending_events
                .retain(|&id, &mut on| on != stream || id > event.id);
        }
        Ok(())
    }

    fn stream_wait_event(&self, _waiter: StreamId, _event: &SimEvent) -> Result<(), DeviceError> {
        let mut s = self.state.lock();
        s.fault(calls::WAIT_EVENT, "stream_wait_event")?;
        // The host does not wait: the event completes when it would have.
        s.counters.stream_waits += 1;
        Ok(())
    }

    fn stream_capturing(&self, stream: StreamId) -> bool {
        self.state.lock().capturing.contains(&stream)
    }

    fn release_event(&self, _event: SimEvent) {}

    fn synchronize(&self) -> Result<(), DeviceError> {
        let mut s = self.state.lock();
        s.fault(calls::SYNCHRONIZE, "synchronize")?;
        s.counters.synchronizes += 1;
        if let Some(lag) = s.event_lag {
            // The device is `lag` operations behind, all of which are waited out.
            s.counters.stalled_ops += lag.min(s.clock);
            s.born.clear();
        }
        s.pending_events.clear();
        Ok(())
    }

    fn vmm_granularity(&self) -> Option<u64> {
        Some(self.state.lock().granularity).filter(|&g| g > 0)
    }

    fn vmm_reserve(&self, bytes: u64) -> Result<DevicePtr, DeviceError> {
        self.reserve_range(bytes, None)
    }

    fn vmm_reserve_at(&self, bytes: u64, hint: DevicePtr) -> Result<DevicePtr, DeviceError> {
        self.reserve_range(bytes, Some(hint.0))
    }

    fn vmm_free_range(&self, ptr: DevicePtr, bytes: u64) -> Result<(), DeviceError> {
        let mut s = self.state.lock();
        s.fault(calls::VMM_FREE_RANGE, "vmm_free_range")?;
        if s.ranges.get(&ptr.0) != Some(&bytes) {
            return Err(DeviceError::InvalidAddress(ptr));
        }
        if s.mapped.range(ptr.0..ptr.0 + bytes).next().is_some() {
            return Err(DeviceError::Driver {
                name: "CUDA_ERROR_INVALID_VALUE".into(),
                call: "vmm_free_range (pages still mapped)",
            });
        }
        s.ranges.remove(&ptr.0);
        Self::uncarve(&mut s, ptr.0, bytes);
        Ok(())
    }

    fn vmm_create_page(&self, bytes: u64) -> Result<u64, DeviceError> {
        let mut s = self.state.lock();
        s.fault(calls::VMM_CREATE, "vmm_create_page")?;
        if s.granularity == 0 || bytes == 0 || bytes % s.granularity != 0 {
            return Err(invalid("vmm_create_page"));
        }
        Self::take_space(&mut s, bytes)?;
        let id = s.next_page;
        s.next_page += 1;
        s.pages.insert(id, bytes);
        s.counters.vmm_creates += 1;
        Ok(id)
    }

    fn vmm_release_page(&self, page: u64) -> Result<(), DeviceError> {
        let mut s = self.state.lock();
        s.fault(calls::VMM_RELEASE, "vmm_release_page")?;
        if s.maps_of_page.contains_key(&page) {
            return Err(invalid("vmm_release_page (page still mapped)"));
        }
        let Some(bytes) = s.pages.remove(&page) else {
            return Err(invalid("vmm_release_page"));
        };
        s.used -= bytes;
        s.counters.vmm_releases += 1;
        Ok(())
    }

    fn vmm_map(&self, ptr: DevicePtr, page: u64, bytes: u64) -> Result<(), DeviceError> {
        let mut s = self.state.lock();
        s.fault(calls::VMM_MAP, "vmm_map")?;
        let g = s.granularity;
        if g == 0 {
            return Err(invalid("vmm_map"));
        }
        let in_range = s
            .ranges
            .range(..=ptr.0)
            .next_back()
            .is_some_and(|(&b, &n)| ptr.0 + bytes <= b + n);
        let overlaps = s
            .mapped
            .range(..ptr.0 + bytes)
            .next_back()
            .is_some_and(|(&a, &(_, n))| a + n > ptr.0);
        if !in_range || ptr.0 % g != 0 || s.pages.get(&page) != Some(&bytes) || overlaps {
            return Err(invalid("vmm_map"));
        }
        s.mapped.insert(ptr.0, (page, bytes));
        *s.maps_of_page.entry(page).or_default() += 1;
        s.counters.vmm_maps += 1;
        Ok(())
    }

    fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: u64) -> Result<(), DeviceError> {
        let mut s = self.state.lock();
        s.fault(calls::COPY, "copy")?;
        for ptr in [src, dst] {
            if Self::mapped_in(&s, ptr, bytes) != bytes {
                return Err(DeviceError::InvalidAddress(ptr));
            }
        }
        s.counters.copies += 1;
        s.counters.copied_bytes += bytes;
        Ok(())
    }

    fn vmm_unmap(&self, ptr: DevicePtr, bytes: u64) -> Result<(), DeviceError> {
        let mut s = self.state.lock();
        s.fault(calls::VMM_UNMAP, "vmm_unmap")?;
        // Whole mappings side by side that cover the range exactly (as
        // `cuMemUnmap`), or nothing changes.
        let end = ptr
            .0
            .checked_add(bytes)
            .ok_or(DeviceError::InvalidAddress(ptr))?;
        let mut at = ptr.0;
        let mut starts = Vec::new();
        while at < end {
            match s.mapped.get(&at) {
                Some(&(_, n)) if n > 0 && at + n <= end => {
                    starts.push(at);
                    at += n;
                }
                _ => return Err(DeviceError::InvalidAddress(ptr)),
            }
        }
        if bytes == 0 {
            return Err(DeviceError::InvalidAddress(ptr));
        }
        s.counters.vmm_pages_unmapped += starts.len() as u64;
        for a in starts {
            if let Some((page, _)) = s.mapped.remove(&a) {
                match s.maps_of_page.get_mut(&page) {
                    Some(n) if *n > 1 => *n -= 1,
                    _ => {
                        s.maps_of_page.remove(&page);
                    }
                }
            }
        }
        s.counters.vmm_unmaps += 1;
        Ok(())
    }
}

fn invalid(call: &'static str) -> DeviceError {
    DeviceError::Driver {
        name: "CUDA_ERROR_INVALID_VALUE".into(),
        call,
    }
}

#[cfg(test)]
mod tests;
