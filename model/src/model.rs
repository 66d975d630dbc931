//! The model: an allocator, its device and what the model knows of them;
//! one op at a time, checked after each (allocation in `malloc.rs`, the
//! checks after every step and at the end in `check.rs`).

use crate::stats::*;
use crate::{Op, Options, Setup, MIB, STREAMS};
use cachealloc_core::{
    round_size, AllocError, BlockState, CachingAllocator, Config, Device, DevicePtr, MemoryStats,
    SimCounters, SimulatedDevice, Snapshot, StreamId,
};
use std::collections::{BTreeMap, BTreeSet};

mod check;
mod malloc;

#[derive(Clone, Debug)]
struct Live {
    addr: u64,
    size: u64,
    rounded: u64,
    /// Block size as the snapshot shows it (0 until the first check).
    block: u64,
    stream: usize,
    /// Streams other than the owner recorded with `record_stream`.
    uses: BTreeSet<StreamId>,
    /// Served by the ladder's last rung from a segment of another kind.
    other_kind: bool,
}

impl Live {
    fn span(&self) -> u64 {
        self.block.max(self.rounded)
    }
}

#[derive(Clone, Debug)]
struct Guard {
    addr: u64,
    size: u64,
    events: Vec<u64>,
}

struct Before {
    stats: MemoryStats,
    counters: SimCounters,
    pending: Vec<u64>,
    snapshot: Snapshot,
}

/// An allocator on a simulated device, with what the test knows about it.
pub struct Model {
    /// The simulated device (a handle sharing state with the allocator's).
    pub dev: SimulatedDevice,
    /// The allocator under test.
    pub alloc: CachingAllocator<SimulatedDevice>,
    config: Config,
    /// Whether the allocator uses expandable (page-backed) segments.
    expandable: bool,
    internal_checks: bool,
    streams: Vec<StreamId>,
    live: Vec<Live>,
    freed: Vec<u64>,
    guards: Vec<Guard>,
    /// Marker events of expandable segments (how far a stream's work got;
    /// they guard no block).
    markers: BTreeSet<u64>,
    cap: Option<u64>,
    fail_next: u64,
    fail_above: Option<u64>,
    /// Per stat array and group: highest `current` seen since the last reset.
    seen_peak: Vec<[u64; 3]>,
    last_snapshot: Snapshot,
    /// Number of OOMs seen (for test statistics).
    pub ooms: u64,
    /// Addresses of blocks the last rung served from a segment of another
    /// kind: a thread cache may hand such a block out again as it is.
    other_kind_blocks: BTreeSet<u64>,
    /// Number of successful mallocs.
    pub mallocs: u64,
    /// How often each interesting situation came up (coverage of the sequences).
    pub coverage: BTreeMap<&'static str, u64>,
}

impl Model {
    /// A fresh allocator with `setup.config` on a device of `setup.capacity`
    /// bytes, judged by the strict contract ([`Options::default`]).
    pub fn new(setup: &Setup) -> Self {
        Self::with_options(setup, Options::default())
    }

    /// A fresh model judged with `options`.
    pub fn with_options(setup: &Setup, options: Options) -> Self {
        let dev = SimulatedDevice::new(setup.capacity);
        let alloc = CachingAllocator::new(dev.clone(), setup.config.clone());
        let expandable = alloc.is_expandable();
        let cap = setup.config.memory_cap().map(|c| c.bytes(setup.capacity));
        let n = setup.streams.clamp(1, STREAMS.len());
        Model {
            dev,
            alloc,
            expandable,
            config: setup.config.clone(),
            internal_checks: options.internal_checks,
            streams: STREAMS[..n].to_vec(),
            live: Vec::new(),
            freed: Vec::new(),
            guards: Vec::new(),
            markers: BTreeSet::new(),
            cap,
            fail_next: 0,
            fail_above: None,
            seen_peak: vec![[0; 3]; 9],
            last_snapshot: Snapshot::default(),
            ooms: 0,
            other_kind_blocks: BTreeSet::new(),
            mallocs: 0,
            coverage: BTreeMap::new(),
        }
    }

    /// Whether an experimental key has the value `value` (as written in a
    /// configuration string): such keys have no typed accessor.
    fn key_is(&self, key: &str, value: &str) -> bool {
        self.config.get(key).ok().flatten().as_deref() == Some(value)
    }

    fn saw(&mut self, what: &'static str) {
        *self.coverage.entry(what).or_default() += 1;
    }

    /// Number of live allocations.
    pub fn live(&self) -> usize {
        self.live.len()
    }

    fn before(&self) -> Before {
        Before {
            stats: self.alloc.stats(),
            counters: self.dev.counters(),
            pending: self.dev.pending_events(),
            snapshot: self.last_snapshot.clone(),
        }
    }

    /// Applies one op and checks every property; the error names the violation.
    pub fn apply(&mut self, op: &Op) -> Result<(), String> {
        let before = self.before();
        self.step(op, &before)?;
        // Device attempts while injected failures were armed consumed them.
        let attempts = self.attempts(&before);
        self.fail_next = self.fail_next.saturating_sub(attempts);
        self.check(&before)
    }

    /// The largest segment the policy may make for a request rounded to
    /// `rounded` bytes.
    fn max_segment(&self, rounded: u64) -> u64 {
        let c = &self.config;
        let own = rounded.div_ceil(c.segment_round()) * c.segment_round();
        c.small_segment()
            .max(cachealloc_core::MEDIUM_SEGMENT)
            .max(own.saturating_mul(2))
    }

    /// A malloc served from a segment of another kind (the ladder's last
    /// rung): plain segments only, after the flush, and only when the
    /// device, the cap or an injected failure left no room for a segment.
    fn check_other_kind_fit(&mut self, before: &Before, size: u64) -> Result<(), String> {
        let st = self.alloc.stats();
        if self.expandable || !self.config.caching() || !self.config.oom_other_kinds() {
            return Err(format!("malloc({size}) took a block of another kind"));
        }
        if self.key_is("oom_flush", "True")
            && st.num_alloc_retries != before.stats.num_alloc_retries + 1
        {
            return Err(format!(
                "malloc({size}) took a block of another kind without the flush"
            ));
        }
        let rounded = round_size(size, self.config.roundup_power2_divisions())
            .ok_or("model: round_size failed")?;
        let free = self.dev.mem_info().map_err(|e| e.to_string())?.free;
        let reserved = st.reserved_bytes.all().current;
        // (What a segment for it would need at most.)
        let seg = self.max_segment(rounded);
        let no_room = free < seg
            || self
                .cap
                .is_some_and(|cap| reserved.saturating_add(seg) > cap)
            || self.attempts(before) > 0 && self.fail_next >= self.attempts(before)
            || self.fail_above.is_some();
        if !no_room {
            return Err(format!(
                "malloc({size}) took a block of another kind though the device had {free} free"
            ));
        }
        self.saw("malloc served from a segment of another kind");
        Ok(())
    }

    /// No two blocks in use (allocated or awaiting events) reach the same
    /// byte of a physical page, however pages are mapped (a page may be
    /// mapped at several addresses: shared pages, old mappings).
    fn check_physical_overlap(&self, snap: &Snapshot) -> Result<(), String> {
        let maps = self.dev.page_mappings();
        if maps.is_empty() {
            return Ok(());
        }
        // (page, offset start, offset end, block address)
        let mut used: Vec<(u64, u64, u64, u64)> = Vec::new();
        for b in snap.segments.iter().flat_map(|s| &s.blocks) {
            if !matches!(b.state, BlockState::Allocated | BlockState::AwaitingEvents) {
                continue;
            }
            let (lo, hi) = (b.address.0, b.address.0 + b.size);
            let first = maps.partition_point(|m| m.0 .0 + m.2 <= lo);
            for &(a, page, n) in maps[first..].iter().take_while(|m| m.0 .0 < hi) {
                let (x, y) = (lo.max(a.0), hi.min(a.0 + n));
                if x < y {
                    used.push((page, x - a.0, y - a.0, lo));
                }
            }
        }
        used.sort_unstable();
        for w in used.windows(2) {
            if w[0].0 == w[1].0 && w[1].1 < w[0].2 && w[0].3 != w[1].3 {
                return Err(format!(
                    "blocks at {:#x} and {:#x} both use bytes {:#x}.. of page {}",
                    w[0].3, w[1].3, w[1].1, w[0].0
                ));
            }
        }
        Ok(())
    }

    /// Requests for device memory (segments or physical pages) since `before`, failed ones included.
    fn attempts(&self, before: &Before) -> u64 {
        let (a, b) = (self.dev.counters(), &before.counters);
        (a.allocs - b.allocs)
            + (a.vmm_creates - b.vmm_creates)
            + (a.failed_allocs - b.failed_allocs)
    }

    /// Expandable segments: the pages under the blocks, as the device maps them.
    /// Every segment's `mapped_size`, plus the old mappings of pages reused early
    /// there, is what the device maps in its range; every block in use or
    /// awaiting events (queued work may still touch it) is wholly mapped,
    /// and no old mapping lies under one.
    fn check_pages(&self, snap: &Snapshot) -> Result<(), String> {
        let stale = self.alloc.stale_mappings();
        // Granules mapped to a page another range counts (shared pages)
        // hold no memory of their own either; they lie under blocks in use.
        let shared = self.alloc.shared_mappings();
        self.check_physical_overlap(snap)?;
        let stale_in = |lo: u64, hi: u64| -> u64 {
            stale
                .iter()
                .filter(|(a, n, _)| a.0 >= lo && a.0 + n <= hi)
                .map(|m| m.1)
                .sum()
        };
        let mut mapped = 0;
        for s in &snap.segments {
            if !self.expandable && self.dev.contains(s.address, s.total_size) {
                continue; // a plain segment among paged ones
            }
            let dev = self.dev.mapped_bytes_in(s.address, s.total_size);
            let (lo, hi) = (s.address.0, s.address.0 + s.total_size);
            let old = stale_in(lo, hi)
                + shared
                    .iter()
                    .filter(|(a, n)| a.0 >= lo && a.0 + n <= hi)
                    .map(|m| m.1)
                    .sum::<u64>();
            if dev != s.mapped_size + old {
                return Err(format!(
                    "segment {} says {} bytes mapped and {old} bytes of old mappings, the device maps {dev} in it",
                    s.address, s.mapped_size
                ));
            }
            mapped += dev;
            for b in &s.blocks {
                let lo = b.address.0;
                let under = stale
                    .iter()
                    .any(|(a, n, _)| a.0 < lo + b.size && a.0 + n > lo);
                if matches!(b.state, BlockState::Allocated | BlockState::AwaitingEvents)
                    && (self.dev.mapped_bytes_in(b.address, b.size) != b.size || under)
                {
                    return Err(format!(
                        "{:?} block {}+{} is not wholly mapped ({} bytes are)",
                        b.state,
                        b.address,
                        b.size,
                        self.dev.mapped_bytes_in(b.address, b.size)
                    ));
                }
            }
        }
        let all: u64 = self.dev.mappings().iter().map(|m| m.1).sum();
        if all != mapped {
            return Err(format!(
                "the device maps {all} bytes, {mapped} of them inside the allocator's segments"
            ));
        }
        Ok(())
    }

    /// Bytes of pages the allocator holds unmapped under no block: the
    /// device's unmapped pages and pages reused early, pooled with only their old
    /// mapping left.
    fn pooled_bytes(&self) -> u64 {
        let early: u64 = self
            .alloc
            .stale_mappings()
            .iter()
            .filter(|m| m.2)
            .map(|m| m.1)
            .sum();
        self.dev.unmapped_page_bytes() + early
    }

    /// Bytes of whole mapped pages lying inside free blocks (pages a
    /// recycling round can move), old mappings of pages reused early left out.
    fn idle_page_bytes(&self, snap: &Snapshot) -> u64 {
        let stale = self.alloc.stale_mappings();
        let mut mappings = self.dev.mappings();
        mappings.retain(|(a, _)| !stale.iter().any(|m| m.0 == *a));
        let mut idle = 0;
        for s in &snap.segments {
            for b in s.blocks.iter().filter(|b| b.state == BlockState::Free) {
                let (lo, hi) = (b.address.0, b.address.0 + b.size);
                idle += mappings
                    .iter()
                    .filter(|(a, n)| a.0 >= lo && a.0 + n <= hi)
                    .map(|m| m.1)
                    .sum::<u64>();
            }
        }
        idle
    }

    fn unchanged(&self, before: &Before, what: &str) -> Result<(), String> {
        let stats = self.alloc.stats();
        if stats != before.stats {
            return Err(format!(
                "{what} changed the stats: before {:?}, after {:?}",
                before.stats, stats
            ));
        }
        if self.dev.counters() != before.counters || self.dev.pending_events() != before.pending {
            return Err(format!("{what} called the device"));
        }
        if self.alloc.snapshot() != before.snapshot {
            return Err(format!("{what} changed the snapshot"));
        }
        Ok(())
    }

    /// The error the allocator must give for a pointer that is not a live allocation's start.
    fn expected_misuse(&self, ptr: u64, snap: &Snapshot) -> Result<AllocError, String> {
        let p = DevicePtr(ptr);
        for l in &self.live {
            if l.addr == ptr {
                return Err("model error: misuse of a live pointer".into());
            }
            if ptr > l.addr && ptr < l.addr + l.span() {
                return Ok(AllocError::InteriorPointer {
                    ptr: p,
                    block: DevicePtr(l.addr),
                });
            }
        }
        let seg = snap
            .segments
            .iter()
            .find(|s| ptr >= s.address.0 && ptr < s.address.0 + s.total_size);
        let Some(seg) = seg else {
            return Ok(AllocError::UnknownPointer(p));
        };
        Ok(if seg.blocks.iter().any(|b| b.address.0 == ptr) {
            AllocError::DoubleFree(p)
        } else {
            AllocError::UnknownPointer(p)
        })
    }

    fn misuse(&mut self, ptr: u64, record: bool, before: &Before) -> Result<(), String> {
        if self.live.iter().any(|l| l.addr == ptr) {
            return Ok(()); // the address is live again: not misuse
        }
        let want = self.expected_misuse(ptr, &before.snapshot)?;
        self.saw(match want {
            AllocError::InteriorPointer { .. } => "misuse: interior pointer",
            AllocError::DoubleFree(_) => "misuse: double free",
            _ => "misuse: unknown pointer",
        });
        let got = if record {
            self.alloc.record_stream(DevicePtr(ptr), self.streams[0])
        } else {
            self.alloc.free(DevicePtr(ptr))
        };
        let call = if record { "record_stream" } else { "free" };
        match got {
            Err(e) if e == want => self.unchanged(before, &format!("a rejected {call}({ptr:#x})")),
            other => Err(format!(
                "{call}({ptr:#x}) returned {other:?}, expected Err({want:?})"
            )),
        }
    }

    fn step(&mut self, op: &Op, before: &Before) -> Result<(), String> {
        match *op {
            Op::Malloc { size, stream } => self.malloc(size, stream % self.streams.len(), before),
            Op::Free { slot } => {
                if self.live.is_empty() {
                    return Ok(());
                }
                let l = self.live.remove(slot % self.live.len());
                let pending_before: BTreeSet<u64> = before.pending.iter().copied().collect();
                self.alloc
                    .free(DevicePtr(l.addr))
                    .map_err(|e| format!("free({:#x}) of a live allocation failed: {e}", l.addr))?;
                let recorded =
                    self.dev.counters().events_recorded - before.counters.events_recorded;
                let mut new: Vec<u64> = self
                    .dev
                    .pending_events()
                    .into_iter()
                    .filter(|e| !pending_before.contains(e))
                    .collect();
                let mut recorded = recorded;
                if self.expandable {
                    // Expandable segments also record, now and then, a marker
                    // event on the freeing stream (how far its work got): one
                    // at most, not a guard of this block.
                    let owner = self.streams[l.stream];
                    let markers = new
                        .iter()
                        .filter(|&&e| self.dev.event_stream(e) == Some(owner))
                        .count() as u64;
                    if markers > 1 {
                        return Err(format!(
                            "free recorded {markers} events on the freeing stream"
                        ));
                    }
                    if markers == 1 {
                        self.saw("free recorded a marker");
                    }
                    let dev = &self.dev;
                    self.markers.retain(|&e| dev.is_pending(e));
                    for &e in &new {
                        if self.dev.event_stream(e) == Some(owner) {
                            self.markers.insert(e);
                        }
                    }
                    new.retain(|e| !self.markers.contains(e));
                    recorded -= markers;
                }
                if recorded != l.uses.len() as u64 || new.len() != l.uses.len() {
                    return Err(format!(
                        "free of a block used by {} other streams recorded {recorded} events ({} new pending)",
                        l.uses.len(),
                        new.len()
                    ));
                }
                if !new.is_empty() {
                    self.saw("free guarded by events");
                    self.guards.push(Guard {
                        addr: l.addr,
                        size: l.span(),
                        events: new,
                    });
                }
                self.freed.push(l.addr);
                if self.freed.len() > 64 {
                    self.freed.remove(0);
                }
                Ok(())
            }
            Op::DoubleFree { slot } | Op::RecordStreamStale { slot } => {
                if self.freed.is_empty() {
                    return Ok(());
                }
                let ptr = self.freed[slot % self.freed.len()];
                self.misuse(ptr, matches!(op, Op::RecordStreamStale { .. }), before)
            }
            Op::ForeignFree { seed } => {
                let ptr = if seed & 1 == 1 || before.snapshot.segments.is_empty() {
                    seed
                } else {
                    let segs = &before.snapshot.segments;
                    let s = &segs[(seed >> 1) as usize % segs.len()];
                    let off = (seed >> 17) % (s.total_size + 4096);
                    // Half the time on a 512-byte boundary, where blocks start.
                    let off = if seed & 2 == 0 { off & !511 } else { off };
                    s.address.0 + off
                };
                self.misuse(ptr, false, before)
            }
            Op::InteriorFree { slot, offset } => {
                if self.live.is_empty() {
                    return Ok(());
                }
                let l = &self.live[slot % self.live.len()];
                let off = (offset % l.span()).max(1);
                self.misuse(l.addr + off, false, before)
            }
            Op::RecordStream { slot, stream } => {
                if self.live.is_empty() {
                    return Ok(());
                }
                let i = slot % self.live.len();
                let s = self.streams[stream % self.streams.len()];
                let addr = self.live[i].addr;
                self.alloc
                    .record_stream(DevicePtr(addr), s)
                    .map_err(|e| format!("record_stream({addr:#x}) of a live allocation: {e}"))?;
                let l = &mut self.live[i];
                if s != self.streams[l.stream] {
                    l.uses.insert(s);
                }
                if self.alloc.stats() != before.stats {
                    return Err("record_stream changed the stats".into());
                }
                Ok(())
            }
            Op::CompleteEvent { index } => {
                let p = &before.pending;
                if !p.is_empty() {
                    self.dev.complete_event(p[index % p.len()]);
                }
                Ok(())
            }
            Op::CompleteAllEvents => {
                self.dev.complete_all_events();
                Ok(())
            }
            Op::ProcessEvents => {
                self.alloc
                    .process_events()
                    .map_err(|e| format!("process_events: {e}"))?;
                if self.dev.pending_events().is_empty() {
                    let snap = self.alloc.snapshot();
                    if let Some(b) = awaiting_block(&snap) {
                        return Err(format!(
                            "every event completed, yet after process_events the block at {} still awaits events",
                            b.address
                        ));
                    }
                }
                Ok(())
            }
            Op::EmptyCache => {
                let r = self
                    .alloc
                    .empty_cache()
                    .map_err(|e| format!("empty_cache: {e}"))?;
                let st = self.alloc.stats();
                let (rb, ra) = (
                    before.stats.reserved_bytes.all().current,
                    st.reserved_bytes.all().current,
                );
                let (sb, sa) = (before.stats.segment.all().current, st.segment.all().current);
                let (wb, ws) = (rb - ra.min(rb), sb - sa.min(sb));
                let wrong = r.bytes != wb || r.segments != ws;
                if r.segments > 0 {
                    self.saw("empty_cache released segments");
                }
                if wrong || ra > rb {
                    return Err(format!(
                        "empty_cache reported {r:?} but reserved went {rb} → {ra}, segments {sb} → {sa}"
                    ));
                }
                self.check_flushed("empty_cache")
            }
            Op::SetCap(cap) => {
                self.alloc
                    .set_memory_cap(cap)
                    .map_err(|e| format!("set_memory_cap: {e}"))?;
                self.cap = cap.map(|c| c.bytes(self.dev.capacity()));
                if self.alloc.memory_cap() != self.cap {
                    return Err(format!(
                        "memory_cap() is {:?} after setting {:?} ({:?} expected)",
                        self.alloc.memory_cap(),
                        cap,
                        self.cap
                    ));
                }
                let reserved = self.alloc.usage().reserved;
                if self.cap.is_some_and(|c| reserved > c) {
                    self.saw("cap lowered below reserved");
                    self.check_flushed("lowering the cap below reserved memory")?;
                }
                Ok(())
            }
            Op::FailNext(n) => {
                self.dev.fail_next_allocations(n);
                self.fail_next = n;
                Ok(())
            }
            Op::FailAbove(limit) => {
                self.dev.fail_allocations_above(limit);
                self.fail_above = limit;
                Ok(())
            }
            Op::ResetPeak => {
                self.alloc.reset_peak_stats();
                let st = self.alloc.stats();
                for (name, a) in st.arrays() {
                    if a.stats().iter().any(|s| s.peak != s.current) {
                        return Err(format!("after reset_peak_stats, {name} has {a:?}"));
                    }
                }
                self.seen_peak = st.currents().iter().map(|(_, c)| *c).collect();
                Ok(())
            }
        }
    }

    /// After a full flush: no event pending, nothing awaiting, no entirely
    /// free segment; with expandable segments also no idle page mapped and
    /// none pooled (`release`: what `empty_cache` does; an OOM's flush only
    /// waits for every event, and the ranges stay).
    fn check_flushed(&self, what: &str) -> Result<(), String> {
        self.check_flushed_as(what, true)
    }

    fn check_flushed_as(&self, what: &str, release: bool) -> Result<(), String> {
        let mut pending = self.dev.pending_events();
        if !release {
            // Waiting for the work that guards blocks is the flush; markers guard none.
            pending.retain(|e| !self.markers.contains(e));
        }
        if !pending.is_empty() {
            return Err(format!(
                "after {what}, events {pending:?} are still pending (not waited for)"
            ));
        }
        let snap = self.alloc.snapshot();
        if let Some(s) = snap.segments.iter().find(|s| is_free_segment(s) && release) {
            return Err(format!(
                "after {what}, the entirely free segment at {} ({} bytes) is still cached",
                s.address, s.total_size
            ));
        }
        if self.expandable && release {
            let (idle, pooled) = (self.idle_page_bytes(&snap), self.pooled_bytes());
            if idle != 0 || pooled != 0 {
                return Err(format!(
                    "after {what}, {idle} bytes of idle pages are still mapped and {pooled} bytes of pages pooled"
                ));
            }
        }
        if let Some(b) = awaiting_block(&snap) {
            return Err(format!(
                "after {what}, the block at {} still awaits events",
                b.address
            ));
        }
        Ok(())
    }
}

/// The first block of a snapshot that still awaits events, if any.
fn awaiting_block(snap: &cachealloc_core::Snapshot) -> Option<&cachealloc_core::BlockSnapshot> {
    snap.segments
        .iter()
        .flat_map(|s| &s.blocks)
        .find(|b| b.state == BlockState::AwaitingEvents)
}
