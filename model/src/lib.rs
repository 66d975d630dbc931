//! Model-based checking of a [`CachingAllocator`] on a [`SimulatedDevice`]:
//! the test-only crate `cachealloc-model`, never published.
//!
//! A [`Model`] owns an allocator and a handle to its simulated device. It
//! applies one [`Op`] at a time and, after every step, checks every property
//! the allocator promises, returning the first violation as text:
//!
//! - [`CachingAllocator::check_invariants`] holds;
//! - no two live allocations overlap; each is 512-aligned, lies inside one
//!   live device segment, belongs to a segment of the stream that asked for
//!   it and to the right pool, and is at least the rounded request;
//! - the snapshot's segments are exactly the device's segments, and every
//!   statistic equals what the snapshot recomputes (per pool), as do the
//!   device counters; peaks never fall below any value seen since the last reset;
//! - no block is handed out while an event guarding it is incomplete: a block
//!   that other streams used stays guarded from its free until every event
//!   recorded for it completed, and a malloc must not return memory
//!   overlapping a guarded block (which must still sit, unmerged, in the
//!   snapshot as awaiting events);
//! - an out-of-memory error comes only after the full flush (no event left
//!   pending, no entirely free segment left cached, `num_alloc_retries` went
//!   up; with `oom_flush` off, after none: nothing cached given back) and only when the device truly could not give the segment: its free
//!   memory was below the segment size, or the cap would have been passed, or
//!   an injected failure was active; the report's figures are the real ones;
//! - misuse (size 0, absurd size, double, foreign or interior pointer)
//!   returns the right error variant and changes nothing;
//! - reserved memory passes the cap only when the cap was lowered below what
//!   is in use (a step that took a new segment ends at or under the cap);
//! - `empty_cache` reports what it released and leaves no free segment;
//! - at the end, after freeing everything, `empty_cache` leaves 0 reserved,
//!   every statistic at 0 and the device with no outstanding segment.
//!
//! The property tests (`allocator/tests/model.rs`) generate [`Op`]s with
//! proptest; fuzz targets can feed raw bytes to [`run_bytes`], which decodes
//! them with [`decode`]. It depends on `cachealloc-core` alone.

#![forbid(unsafe_code)]

use cachealloc_core::{
    round_size, AllocError, BlockState, CachingAllocator, Config, Device, DevicePtr, MemInfo,
    MemoryCap, MemoryStats, PoolKind, SimCounters, SimulatedDevice, Snapshot, StreamId,
    MAX_REQUEST, MIN_BLOCK,
};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

const MIB: u64 = 1 << 20;

/// One step of a test sequence. Indices (`slot`, `stream`, `index`) are taken
/// modulo the number of candidates, so every sequence of ops is valid.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// `malloc(size)` on stream `stream`.
    Malloc {
        /// Requested bytes (0 and absurd sizes included).
        size: u64,
        /// Index into the model's streams.
        stream: usize,
    },
    /// Frees a live allocation.
    Free {
        /// Index into the live allocations (insertion order).
        slot: usize,
    },
    /// Frees a pointer that was freed before (skipped if its address is live again).
    DoubleFree {
        /// Index into the recently freed pointers.
        slot: usize,
    },
    /// Frees an address the allocator never handed out (skipped if it is a live allocation's start).
    ForeignFree {
        /// Low bit set: this absolute address; clear: a place inside a segment chosen from the bits.
        seed: u64,
    },
    /// Frees a pointer inside a live allocation, not at its start.
    InteriorFree {
        /// Index into the live allocations.
        slot: usize,
        /// Offset into the block, taken modulo its size (0 becomes 1).
        offset: u64,
    },
    /// `record_stream(ptr, stream)` on a live allocation.
    RecordStream {
        /// Index into the live allocations.
        slot: usize,
        /// Index into the model's streams.
        stream: usize,
    },
    /// `record_stream` on a freed pointer (misuse).
    RecordStreamStale {
        /// Index into the recently freed pointers.
        slot: usize,
    },
    /// Completes one pending event on the device.
    CompleteEvent {
        /// Index into the pending events, oldest first.
        index: usize,
    },
    /// Completes every pending event on the device.
    CompleteAllEvents,
    /// `process_events()`.
    ProcessEvents,
    /// `empty_cache()`.
    EmptyCache,
    /// `set_memory_cap(cap)`.
    SetCap(Option<MemoryCap>),
    /// Makes the next `n` device allocations fail.
    FailNext(u64),
    /// Makes every device allocation above this size fail (`None` lifts it).
    FailAbove(Option<u64>),
    /// `reset_peak_stats()`.
    ResetPeak,
}

/// The streams a model uses, by index.
pub const STREAMS: [StreamId; 3] = [StreamId(0), StreamId(0x7f3a_1000), StreamId(u64::MAX)];

/// The configurations the model tests run: name and config.
pub fn configs() -> Vec<(&'static str, Config)> {
    let parse = |s: &str| Config::parse(s).expect("valid test config");
    vec![
        ("pytorch", Config::pytorch()),
        ("default", Config::default()),
        ("segments", Config::segments()),
        ("no-caching", Config::no_caching()),
        (
            "pytorch-max-split-64",
            parse("pytorch,max_split_size_mb:64"),
        ),
        (
            "pytorch-gc",
            parse("pytorch,garbage_collection_threshold:0.6,per_process_memory_fraction:0.8"),
        ),
        (
            "pytorch-roundup",
            parse("pytorch,roundup_power2_divisions:4"),
        ),
        ("segments-huge-64", parse("segments,huge_size_mb:64")),
        // One parked block per thread: every park past the first evicts.
        ("segments-thread-cache-1", parse("segments,thread_cache:1")),
        // Free blocks in other streams' partly used segments before growing.
        ("segments-borrow-holes", parse("segments,borrow_holes:true")),
        // Slabs for every small request, and for the smallest next to the bins.
        ("segments-slabs-1024", parse("segments,slab_max_kb:1024")),
        ("pytorch-slabs-16", parse("pytorch,slab_max_kb:16")),
        // Slabs for the smallest requests, plain small blocks above them
        // whose holes other streams borrow.
        (
            "segments-slabs-64",
            parse("segments,slab_max_kb:64,borrow_holes:true"),
        ),
        // PyTorch's expandable segments: 20 MiB pages, never moved.
        (
            "pytorch-expandable",
            parse("pytorch,expandable_segments:true"),
        ),
        // Page-backed segments: virtual ranges, physical pages mapped under blocks.
        ("expandable", Config::expandable()),
        // Other streams' busy pages waited for on the host instead.
        (
            "expandable-host-waits",
            parse("expandable,expandable_cross_stream:false"),
        ),
        // Pages moved away unmapped at once (no shadows).
        (
            "expandable-no-shadows",
            parse("expandable,expandable_shadows:false"),
        ),
        // Big pages at every edge, whatever the workload's size, and slabs
        // for small requests.
        (
            "expandable-big-edges",
            Config {
                expandable_edges: cachealloc_core::EdgePages::Big,
                expandable_page_divisor: 0,
                ..parse("expandable,expandable_page_mb:4,slab_max_kb:64")
            },
        ),
        // Pages scaled to the workload where the model's peaks cross the
        // steps: 2 MiB below 40 MiB, 10 MiB below 80 MiB, then 20 MiB.
        (
            "expandable-scaled-pages",
            Config {
                expandable_page_divisor: 4,
                ..parse("expandable,expandable_page_mb:20")
            },
        ),
        // Granule pages everywhere.
        (
            "expandable-small-pages",
            Config {
                expandable_edges: cachealloc_core::EdgePages::Small,
                ..parse("expandable,expandable_page_mb:2")
            },
        ),
        // A CUDA graph pool's allocator: never gives segments back on its own.
        ("graph-pool", parse("segments,oom_flush:false")),
    ]
}

/// What a model starts from.
#[derive(Clone, Debug)]
pub struct Setup {
    /// The allocator's configuration.
    pub config: Config,
    /// Device capacity in bytes.
    pub capacity: u64,
    /// Number of streams used (1 to 3, from [`STREAMS`]).
    pub streams: usize,
}

/// How a model judges (see [`Model::with_options`]); the model itself is
/// always strict.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// Also run [`CachingAllocator::check_invariants`] after every step.
    /// Turned off only to show that the model's own checks catch a broken
    /// allocator without the allocator's help.
    pub internal_checks: bool,
}

impl Default for Options {
    /// Internal checks on, unless the environment variable
    /// `MODEL_SKIP_INTERNAL` is set.
    fn default() -> Self {
        Options {
            internal_checks: std::env::var_os("MODEL_SKIP_INTERNAL").is_none(),
        }
    }
}

/// A size spread log-uniformly: `2^exp` plus `mantissa` modulo `2^exp`.
pub fn log_size(exp: u32, mantissa: u64) -> u64 {
    let base = 1u64 << exp.min(62);
    base + mantissa % base
}

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

/// Whether no block of the segment is in use (merged, that is one free block).
fn is_free_segment(s: &cachealloc_core::SegmentSnapshot) -> bool {
    s.blocks.iter().all(|b| b.state == BlockState::Free)
}

/// Number of entirely free (releasable) segments in a snapshot.
pub fn free_segments(snap: &Snapshot) -> usize {
    snap.segments.iter().filter(|s| is_free_segment(s)).count()
}

/// The statistics group of a pool: `small_pool` (1) or `large_pool` (2; the
/// huge pool counts with the large one).
fn group(kind: PoolKind) -> usize {
    match kind {
        PoolKind::Small => 1,
        _ => 2,
    }
}

/// Checks that every statistic's `current` equals what the snapshot
/// recomputes, per pool group, and that each stat is self-consistent
/// (plain segments; see [`check_expandable_stats_against_snapshot`]).
/// `unmapped`: bytes of pages of paged segments the device still holds
/// unmapped (a release it refused), counted reserved under some pool.
pub fn check_stats_against_snapshot(
    stats: &MemoryStats,
    snap: &Snapshot,
    max_split_size: u64,
    unmapped: u64,
) -> Result<(), String> {
    check_stats(stats, snap, max_split_size, false, unmapped)
}

/// [`check_stats_against_snapshot`] for expandable segments, where reserved
/// bytes are physical pages: the mapped bytes of the segments (their
/// `mapped_size`), per pool, plus `pooled` bytes of unmapped pages kept for
/// reuse (whose pool the snapshot does not show: each pool's reserved bytes
/// are at least its mapped bytes, and the total is exactly mapped plus
/// pooled). Free space of an expandable segment is not inactive-split
/// memory, and no segment counts as oversize.
pub fn check_expandable_stats_against_snapshot(
    stats: &MemoryStats,
    snap: &Snapshot,
    max_split_size: u64,
    pooled: u64,
) -> Result<(), String> {
    check_stats(stats, snap, max_split_size, true, pooled)
}

fn check_stats(
    stats: &MemoryStats,
    snap: &Snapshot,
    max_split_size: u64,
    expandable: bool,
    pooled: u64,
) -> Result<(), String> {
    // Indices into `stats.arrays()`.
    const ALLOCATION: usize = 0;
    const SEGMENT: usize = 1;
    const ACTIVE: usize = 2;
    const INACTIVE_SPLIT: usize = 3;
    const ALLOCATED_BYTES: usize = 4;
    const RESERVED_BYTES: usize = 5;
    const ACTIVE_BYTES: usize = 6;
    const INACTIVE_SPLIT_BYTES: usize = 7;
    const REQUESTED_BYTES: usize = 8;
    let mut expect = [[0u64; 3]; 9];
    let mut add = |array: usize, kind: PoolKind, n: u64| {
        expect[array][0] += n;
        expect[array][group(kind)] += n;
    };
    let mut oversize_allocs = 0;
    let mut oversize_segs = 0;
    for s in &snap.segments {
        let k = s.pool;
        add(SEGMENT, k, 1);
        if expandable {
            if s.mapped_size > s.total_size {
                return Err(format!(
                    "snapshot: segment {} maps {} of its {} bytes",
                    s.address, s.mapped_size, s.total_size
                ));
            }
            add(RESERVED_BYTES, k, s.mapped_size);
        } else {
            // (A paged segment may have given free pages back.)
            if s.mapped_size > s.total_size {
                return Err(format!(
                    "snapshot: plain segment {} says {} of its {} bytes are mapped",
                    s.address, s.mapped_size, s.total_size
                ));
            }
            add(RESERVED_BYTES, k, s.mapped_size);
            if s.total_size >= max_split_size {
                oversize_segs += 1;
            }
        }
        let split = s.blocks.len() > 1 && !expandable;
        let mut allocated = 0;
        let mut at = s.address.0;
        for b in &s.blocks {
            if b.address.0 != at {
                return Err(format!(
                    "snapshot: block at {} does not follow the previous one (expected {at:#x})",
                    b.address
                ));
            }
            at += b.size;
            match b.state {
                BlockState::Allocated => {
                    add(ALLOCATION, k, 1);
                    add(ALLOCATED_BYTES, k, b.size);
                    add(ACTIVE, k, 1);
                    add(ACTIVE_BYTES, k, b.size);
                    add(REQUESTED_BYTES, k, b.requested_size);
                    allocated += b.size;
                    if b.size >= max_split_size {
                        oversize_allocs += 1;
                    }
                }
                BlockState::AwaitingEvents => {
                    add(ACTIVE, k, 1);
                    add(ACTIVE_BYTES, k, b.size);
                    add(REQUESTED_BYTES, k, b.requested_size);
                }
                BlockState::Free | BlockState::Parked | BlockState::Aliased => {
                    if split {
                        add(INACTIVE_SPLIT, k, 1);
                        add(INACTIVE_SPLIT_BYTES, k, b.size);
                    }
                }
            }
        }
        if at != s.address.0 + s.total_size {
            return Err(format!(
                "snapshot: blocks of segment {} cover {} of {} bytes",
                s.address,
                at - s.address.0,
                s.total_size
            ));
        }
        if allocated != s.allocated_size {
            return Err(format!(
                "snapshot: segment {} says {} allocated, its blocks {allocated}",
                s.address, s.allocated_size
            ));
        }
    }
    for (i, (name, got)) in stats.arrays().iter().enumerate() {
        let groups = got.stats();
        for (g, group) in cachealloc_core::stats::STAT_GROUPS.iter().enumerate() {
            let s = groups[g];
            let (c, w) = (s.current, expect[i][g]);
            // Pooled (unmapped) pages count under some pool: each group
            // holds at least its mapped bytes, all of them mapped plus pooled.
            let wrong = match i {
                RESERVED_BYTES if g == 0 => c != w + pooled,
                RESERVED_BYTES => c < w || c > w + pooled,
                _ => c != w,
            };
            if wrong {
                return Err(format!(
                    "stat {name}.{group}.current is {c} but the snapshot recomputes {w} (and {pooled} bytes of unmapped pages)"
                ));
            }
            if s.peak < s.current || s.allocated.wrapping_sub(s.freed) != s.current {
                return Err(format!("stat {name}.{group} is inconsistent: {s:?}"));
            }
        }
    }
    if stats.oversize_allocations.current != oversize_allocs {
        return Err(format!(
            "oversize_allocations.current is {} but the snapshot has {oversize_allocs}",
            stats.oversize_allocations.current
        ));
    }
    if stats.oversize_segments.current != oversize_segs {
        return Err(format!(
            "oversize_segments.current is {} but the snapshot has {oversize_segs}",
            stats.oversize_segments.current
        ));
    }
    Ok(())
}

fn overlaps(a: u64, alen: u64, b: u64, blen: u64) -> bool {
    a < b.saturating_add(blen) && b < a.saturating_add(alen)
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
        let cap = setup.config.memory_cap.map(|c| c.bytes(setup.capacity));
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
        let own = rounded.div_ceil(c.segment_round) * c.segment_round;
        c.small_segment
            .max(cachealloc_core::config::MEDIUM_SEGMENT)
            .max(own.saturating_mul(2))
    }

    /// A malloc served from a segment of another kind (the ladder's last
    /// rung): plain segments only, after the flush, and only when the
    /// device, the cap or an injected failure left no room for a segment.
    fn check_other_kind_fit(&mut self, before: &Before, size: u64) -> Result<(), String> {
        let st = self.alloc.stats();
        if self.expandable || !self.config.caching || !self.config.oom_other_kinds {
            return Err(format!("malloc({size}) took a block of another kind"));
        }
        if self.config.oom_flush && st.num_alloc_retries != before.stats.num_alloc_retries + 1 {
            return Err(format!(
                "malloc({size}) took a block of another kind without the flush"
            ));
        }
        let rounded = round_size(size, &self.config.roundup_power2_divisions)
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

    fn malloc(&mut self, size: u64, stream: usize, before: &Before) -> Result<(), String> {
        let sid = self.streams[stream];
        let pending_before: BTreeSet<u64> = self.dev.pending_events().into_iter().collect();
        let stream_waits = self.alloc.stats().num_stream_waits;
        let res = self.alloc.malloc(size, sid);
        // An event a malloc records (another stream's work, waited for on
        // the device by the requesting stream) guards no block: a marker.
        for e in self.dev.pending_events() {
            if !pending_before.contains(&e) {
                self.markers.insert(e);
            }
        }
        if self.alloc.stats().num_stream_waits > stream_waits {
            self.saw("malloc made its stream wait for another on the device");
        }
        let valid = size > 0 && size <= MAX_REQUEST;
        match res {
            Ok(p) => {
                if !valid {
                    return Err(format!("malloc({size}) succeeded with {p}"));
                }
                self.mallocs += 1;
                let rounded = round_size(size, &self.config.roundup_power2_divisions)
                    .ok_or("model: round_size failed")?;
                if p.0 % MIN_BLOCK != 0 {
                    return Err(format!("malloc({size}) returned {p}, not 512-aligned"));
                }
                if let Some(l) = self
                    .live
                    .iter()
                    .find(|l| overlaps(p.0, rounded, l.addr, l.span()))
                {
                    return Err(format!(
                        "malloc({size}) returned {p}+{rounded}, overlapping the live allocation {:#x}+{}",
                        l.addr,
                        l.span()
                    ));
                }
                let mut reused_guarded = false;
                for g in &self.guards {
                    let pending = g.events.iter().any(|&e| self.dev.is_pending(e));
                    reused_guarded |= !pending && overlaps(p.0, rounded, g.addr, g.size);
                    if overlaps(p.0, rounded, g.addr, g.size) && pending {
                        return Err(format!(
                            "malloc({size}) returned {p}+{rounded}, overlapping the block {:#x}+{} whose events {:?} have not completed",
                            g.addr, g.size, g.events
                        ));
                    }
                }
                if reused_guarded {
                    self.saw("malloc reuses a block once its events completed");
                }
                if self
                    .guards
                    .iter()
                    .any(|g| g.events.iter().any(|&e| self.dev.is_pending(e)))
                {
                    self.saw("malloc while a block is guarded");
                }
                let st = self.alloc.stats();
                if st.num_ooms != before.stats.num_ooms {
                    return Err("a successful malloc counted an OOM".into());
                }
                let c = self.dev.counters();
                if self.expandable {
                    if c.vmm_creates > before.counters.vmm_creates {
                        self.saw("malloc created pages");
                    } else if c.vmm_maps > before.counters.vmm_maps {
                        self.saw("malloc mapped pooled or moved pages");
                    } else {
                        self.saw("malloc on mapped pages");
                    }
                    if c.vmm_reserves > before.counters.vmm_reserves {
                        self.saw("malloc reserved a range");
                    }
                    if st.num_pages_reused_early > before.stats.num_pages_reused_early {
                        self.saw("malloc reused its stream's pages early");
                    }
                } else if st.num_device_alloc == before.stats.num_device_alloc {
                    self.saw("malloc from the cache");
                }
                if st.num_alloc_retries != before.stats.num_alloc_retries {
                    self.saw("malloc served after the flush");
                }
                // A block taken from another stream's range or segment
                // (`expandable_borrow`, `borrow_holes`) belongs to that
                // stream, used on the requesting one.
                let (mut owner, mut uses) = (stream, BTreeSet::new());
                if st.num_blocks_borrowed > before.stats.num_blocks_borrowed {
                    if !(self.config.expandable_borrow || self.config.borrow_holes) {
                        return Err(format!("malloc({size}) borrowed with borrowing off"));
                    }
                    let snap = self.alloc.snapshot();
                    let seg = snap
                        .segments
                        .iter()
                        .find(|s| s.address.0 <= p.0 && p.0 < s.address.0 + s.total_size)
                        .ok_or(format!("borrowed block {p} lies in no segment"))?;
                    owner = self
                        .streams
                        .iter()
                        .position(|&s| s == seg.stream)
                        .ok_or(format!(
                            "borrowed block {p} lies in a range of an unknown stream"
                        ))?;
                    if owner == stream {
                        return Err(format!("malloc({size}) borrowed from its own stream"));
                    }
                    uses.insert(self.streams[stream]);
                    self.saw("malloc took another stream's free block");
                }
                if st.num_pages_shared > before.stats.num_pages_shared {
                    self.saw("malloc shared pages between granules");
                }
                let other_kind = st.num_other_kind_fits > before.stats.num_other_kind_fits;
                if other_kind {
                    self.check_other_kind_fit(before, size)?;
                    self.other_kind_blocks.insert(p.0);
                }
                let other_kind = self.other_kind_blocks.contains(&p.0);
                self.live.push(Live {
                    addr: p.0,
                    size,
                    rounded,
                    block: 0,
                    stream: owner,
                    uses,
                    other_kind,
                });
                Ok(())
            }
            Err(AllocError::ZeroSize) if size == 0 => self.unchanged(before, "malloc(0)"),
            Err(AllocError::SizeTooLarge(s)) if s == size && size > MAX_REQUEST => {
                self.unchanged(before, &format!("malloc({size}) (too large)"))
            }
            Err(AllocError::OutOfMemory(r)) if valid => {
                self.ooms += 1;
                let rounded = round_size(size, &self.config.roundup_power2_divisions)
                    .ok_or("model: round_size failed")?;
                // The segment size is policy; the report names it, within sane bounds.
                let seg = r.segment_size;
                let c = &self.config;
                let max_seg = self.max_segment(rounded);
                if seg < rounded
                    || ((!c.caching || self.expandable) && seg != rounded)
                    || seg > max_seg
                {
                    return Err(format!(
                        "the OOM report names a {seg}-byte segment for a request rounded to {rounded}"
                    ));
                }
                let st = self.alloc.stats();
                if st.num_ooms != before.stats.num_ooms + 1 {
                    return Err("an OOM was not counted in num_ooms".into());
                }
                if !self.config.oom_flush && !self.expandable {
                    // A graph pool's allocator: nothing cached is given back
                    // (the key concerns plain segments).
                    if st.num_alloc_retries != before.stats.num_alloc_retries
                        || self.dev.counters().frees != before.counters.frees
                    {
                        return Err(format!(
                            "OOM for malloc({size}) with oom_flush off released cached segments"
                        ));
                    }
                } else {
                    if st.num_alloc_retries != before.stats.num_alloc_retries + 1 {
                        return Err(format!(
                            "OOM for malloc({size}) without the flush-and-retry (num_alloc_retries {} → {})",
                            before.stats.num_alloc_retries, st.num_alloc_retries
                        ));
                    }
                    self.check_flushed_as(&format!("an OOM for malloc({size})"), !self.expandable)?;
                }
                let info: MemInfo = self.dev.mem_info().map_err(|e| e.to_string())?;
                let reserved = st.reserved_bytes.all().current;
                let attempts = self.attempts(before);
                // The device memory the request needs: its segment, or with
                // expandable segments its pages (the request plus at most one
                // page at each edge: a granule, unless big pages are mapped at
                // the edges whatever the pressure), less what the allocator
                // holds and can move under it (pooled pages, idle pages).
                let (need, largest_page) = if self.expandable {
                    let g = self.dev.vmm_granularity().ok_or("no granularity")?;
                    let page = self.config.expandable_page.div_ceil(g).max(1) * g;
                    let edge = if self.config.expandable_edges == cachealloc_core::EdgePages::Big {
                        page
                    } else {
                        g
                    };
                    let spare = self.pooled_bytes() + self.idle_page_bytes(&self.alloc.snapshot());
                    ((rounded + 2 * edge).saturating_sub(spare), page)
                } else {
                    (seg, seg)
                };
                let injected = (attempts > 0 && self.fail_next >= attempts)
                    || self.fail_above.is_some_and(|l| largest_page > l);
                let device_full = info.free < need;
                let capped = self
                    .cap
                    .is_some_and(|cap| reserved.saturating_add(need) > cap);
                if injected {
                    self.saw("OOM: injected failure");
                }
                if device_full {
                    self.saw("OOM: device full");
                }
                if capped {
                    self.saw("OOM: cap");
                }
                if !(injected || device_full || capped) {
                    return Err(format!(
                        "OOM for malloc({size}) (segment {seg}, {need} bytes of new memory at most) though the device had {} free, reserved {reserved}, cap {:?}, no injected failure",
                        info.free, self.cap
                    ));
                }
                let want_report = (
                    size,
                    seg,
                    info.free,
                    info.total,
                    self.cap,
                    st.allocated_bytes.all().current,
                    reserved,
                );
                let got_report = (
                    r.requested,
                    r.segment_size,
                    r.device_free,
                    r.device_total,
                    r.cap,
                    r.allocated,
                    r.reserved,
                );
                if want_report != got_report {
                    return Err(format!(
                        "OOM report (requested, segment, free, total, cap, allocated, reserved) is {got_report:?}, expected {want_report:?}"
                    ));
                }
                if !r.to_string().contains("out of memory") {
                    return Err(format!("OOM message does not say so: {r}"));
                }
                Ok(())
            }
            Err(e) => Err(format!("malloc({size}) returned Err({e:?})")),
        }
    }

    /// Every property that must hold between steps.
    fn check(&mut self, before: &Before) -> Result<(), String> {
        if self.internal_checks {
            self.alloc
                .check_invariants()
                .map_err(|e| format!("check_invariants: {e}"))?;
        }
        let snap = self.alloc.snapshot();
        let stats = self.alloc.stats();
        let counters = self.dev.counters();

        // The snapshot's segments are exactly the device's segments (its
        // reserved virtual ranges, with expandable segments).
        let (dev_segs, other) = if self.expandable {
            (self.dev.ranges(), self.dev.segments())
        } else {
            (self.dev.segments(), self.dev.ranges())
        };
        let snap_segs: Vec<(DevicePtr, u64)> = snap
            .segments
            .iter()
            .map(|s| (s.address, s.total_size))
            .collect();
        if dev_segs != snap_segs {
            return Err(format!(
                "the allocator's segments {snap_segs:?} are not the device's {dev_segs:?}"
            ));
        }
        if !other.is_empty() {
            return Err(format!(
                "the device holds {other:?}, of the kind (plain segments or virtual ranges) this allocator does not use"
            ));
        }
        if self.expandable {
            self.check_pages(&snap)?;
            let pooled = self.pooled_bytes();
            check_expandable_stats_against_snapshot(
                &stats,
                &snap,
                self.config.max_split_size,
                pooled,
            )?;
        } else {
            if !self.dev.mappings().is_empty() || self.dev.unmapped_page_bytes() != 0 {
                return Err("plain segments, yet the device holds physical pages".into());
            }
            let unmapped = self.dev.unmapped_page_bytes();
            check_stats_against_snapshot(&stats, &snap, self.config.max_split_size, unmapped)?;
        }
        let reserved = stats.reserved_bytes.all().current;
        if reserved != self.dev.used() {
            return Err(format!(
                "reserved_bytes is {reserved} but the device lends {}",
                self.dev.used()
            ));
        }
        if stats.num_device_alloc != counters.allocs || stats.num_device_free != counters.frees {
            return Err(format!(
                "num_device_alloc/free {}/{} but the device counted {}/{}",
                stats.num_device_alloc, stats.num_device_free, counters.allocs, counters.frees
            ));
        }
        let usage = self.alloc.usage();
        if usage.reserved != reserved
            || usage.allocated != stats.allocated_bytes.all().current
            || usage.requested != stats.requested_bytes.all().current
            || usage.num_alloc_retries != stats.num_alloc_retries
        {
            return Err(format!("usage() {usage:?} disagrees with the stats"));
        }

        // Peaks: at least every value seen since the last reset, never below current.
        for (i, (name, a)) in stats.arrays().iter().enumerate() {
            for (g, s) in a.stats().into_iter().enumerate() {
                self.seen_peak[i][g] = self.seen_peak[i][g].max(s.current);
                if s.peak < self.seen_peak[i][g] {
                    return Err(format!(
                        "peak of {name}[{g}] is {} but {} was reached since the last reset",
                        s.peak, self.seen_peak[i][g]
                    ));
                }
            }
        }

        // The cap: a step that took a new segment ends at or under it.
        if let Some(cap) = self.cap {
            if counters.allocs > before.counters.allocs && reserved > cap {
                return Err(format!(
                    "reserved {reserved} passed the cap {cap} with a new segment"
                ));
            }
        }

        // Blocks by address, with their segment.
        let mut blocks: BTreeMap<
            u64,
            (
                &cachealloc_core::SegmentSnapshot,
                &cachealloc_core::BlockSnapshot,
            ),
        > = BTreeMap::new();
        for s in &snap.segments {
            if !self.config.caching && (s.blocks.len() != 1 || is_free_segment(s)) {
                return Err(format!(
                    "no-caching: segment {} holds {} blocks (free: {})",
                    s.address,
                    s.blocks.len(),
                    is_free_segment(s)
                ));
            }
            for b in &s.blocks {
                blocks.insert(b.address.0, (s, b));
            }
        }

        // Live allocations: as the model knows them, in the snapshot, inside device segments.
        let n_alloc = blocks
            .values()
            .filter(|(_, b)| b.state == BlockState::Allocated)
            .count();
        if n_alloc != self.live.len() {
            return Err(format!(
                "the snapshot holds {n_alloc} allocated blocks, the caller {} allocations",
                self.live.len()
            ));
        }
        for l in &mut self.live {
            let Some(&(s, b)) = blocks.get(&l.addr) else {
                return Err(format!(
                    "live allocation {:#x} is not a block in the snapshot",
                    l.addr
                ));
            };
            if b.state != BlockState::Allocated || b.requested_size != l.size || b.size < l.rounded
            {
                return Err(format!(
                    "live allocation {:#x} ({} bytes, rounded {}) shows as {:?}",
                    l.addr, l.size, l.rounded, b
                ));
            }
            if l.block != 0 && l.block != b.size {
                return Err(format!(
                    "live allocation {:#x} changed size from {} to {}",
                    l.addr, l.block, b.size
                ));
            }
            l.block = b.size;
            if s.stream != self.streams[l.stream] {
                return Err(format!(
                    "allocation {:#x} for stream {:?} lies in a segment of stream {:?}",
                    l.addr, self.streams[l.stream], s.stream
                ));
            }
            let kind = if l.rounded <= cachealloc_core::config::SMALL_SIZE {
                PoolKind::Small
            } else if l.rounded >= self.config.huge_size && !self.expandable {
                PoolKind::Huge
            } else {
                PoolKind::Large
            };
            // (The last rung puts a request in a segment of another kind,
            // never a small segment.)
            if s.pool != kind && !(l.other_kind && s.pool != PoolKind::Small) {
                return Err(format!(
                    "allocation {:#x} of {} bytes is in the {:?} pool",
                    l.addr, l.rounded, s.pool
                ));
            }
            let uses: BTreeSet<StreamId> = b.stream_uses.iter().copied().collect();
            if uses != l.uses {
                return Err(format!(
                    "allocation {:#x} shows stream uses {:?}, recorded {:?}",
                    l.addr, uses, l.uses
                ));
            }
            let inside = if self.expandable {
                self.dev.mapped_bytes_in(DevicePtr(l.addr), b.size) == b.size
                    && l.addr >= s.address.0
                    && l.addr + b.size <= s.address.0 + s.total_size
            } else {
                self.dev.contains(DevicePtr(l.addr), b.size)
            };
            if l.addr % MIN_BLOCK != 0 || !inside {
                return Err(format!(
                    "allocation {:#x}+{} is not 512-aligned inside one live device segment{}",
                    l.addr,
                    b.size,
                    if self.expandable {
                        format!(
                            " (its range, {} of its bytes mapped)",
                            self.dev.mapped_bytes_in(DevicePtr(l.addr), b.size)
                        )
                    } else {
                        String::new()
                    }
                ));
            }
        }
        let mut spans: Vec<(u64, u64)> = self.live.iter().map(|l| (l.addr, l.span())).collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(format!(
                    "live allocations {:#x}+{} and {:#x}+{} overlap",
                    w[0].0, w[0].1, w[1].0, w[1].1
                ));
            }
        }

        // Guarded blocks: still awaiting events, untouched, until their events complete.
        // (Guards whose events completed stay listed a while, to see reuse.)
        if self.guards.len() > 64 {
            let dev = &self.dev;
            let mut excess = self.guards.len() - 64;
            self.guards.retain(|g| {
                let keep = excess == 0 || g.events.iter().any(|&e| dev.is_pending(e));
                excess -= usize::from(!keep);
                keep
            });
        }
        for g in &self.guards {
            if !g.events.iter().any(|&e| self.dev.is_pending(e)) {
                continue;
            }
            match blocks.get(&g.addr) {
                Some((_, b)) if b.state == BlockState::AwaitingEvents && b.size == g.size => {}
                other => {
                    return Err(format!(
                        "block {:#x}+{} is guarded by pending events {:?} but shows as {:?}",
                        g.addr,
                        g.size,
                        g.events,
                        other.map(|(_, b)| b)
                    ))
                }
            }
        }
        self.last_snapshot = snap;
        Ok(())
    }

    /// Frees everything, empties the cache and checks that nothing is left;
    /// then lifts the cap and failures and checks the allocator still serves.
    pub fn finish(&mut self) -> Result<(), String> {
        while let Some(l) = self.live.pop() {
            self.alloc
                .free(DevicePtr(l.addr))
                .map_err(|e| format!("final free({:#x}): {e}", l.addr))?;
        }
        if self.internal_checks {
            self.alloc
                .check_invariants()
                .map_err(|e| format!("check_invariants after freeing everything: {e}"))?;
        }
        self.alloc
            .empty_cache()
            .map_err(|e| format!("final empty_cache: {e}"))?;
        if self.internal_checks {
            self.alloc
                .check_invariants()
                .map_err(|e| format!("check_invariants after the final empty_cache: {e}"))?;
        }
        let st = self.alloc.stats();
        for (name, a) in st.arrays() {
            if a.stats().iter().any(|s| s.current != 0) {
                return Err(format!(
                    "after freeing everything and empty_cache, {name} is {a:?}"
                ));
            }
        }
        if self.dev.outstanding() != 0 || self.dev.used() != 0 {
            return Err(format!(
                "after freeing everything and empty_cache, the device still lends {} segments, pages or ranges ({} bytes)",
                self.dev.outstanding(),
                self.dev.used()
            ));
        }
        let c = self.dev.counters();
        if c.vmm_creates != c.vmm_releases
            || c.vmm_maps != c.vmm_pages_unmapped
            || c.allocs != c.frees
        {
            return Err(format!(
                "after freeing everything and empty_cache, the device counts {}/{} segments allocated/freed, {}/{} pages created/released, {}/{} mapped/unmapped",
                c.allocs, c.frees, c.vmm_creates, c.vmm_releases, c.vmm_maps, c.vmm_pages_unmapped
            ));
        }
        if !self.dev.pending_events().is_empty() {
            return Err("events left pending after the final empty_cache".into());
        }
        self.alloc.set_memory_cap(None).map_err(|e| e.to_string())?;
        self.dev.fail_next_allocations(0);
        self.dev.fail_allocations_above(None);
        if self.dev.capacity() >= 2 * MIB {
            let p = self
                .alloc
                .malloc(4096, self.streams[0])
                .map_err(|e| format!("malloc(4096) on an empty allocator: {e}"))?;
            self.alloc.free(p).map_err(|e| e.to_string())?;
            self.alloc.empty_cache().map_err(|e| e.to_string())?;
            if self.dev.outstanding() != 0 {
                return Err("a segment outlived the last empty_cache".into());
            }
        }
        Ok(())
    }
}

/// Runs `ops` on a fresh model (strict contract) and finishes it; the error names the step.
pub fn run(setup: &Setup, ops: &[Op]) -> Result<Model, String> {
    run_with(setup, ops, Options::default())
}

/// [`run`] with the given options.
pub fn run_with(setup: &Setup, ops: &[Op], options: Options) -> Result<Model, String> {
    let mut m = Model::with_options(setup, options);
    for (i, op) in ops.iter().enumerate() {
        m.apply(op).map_err(|e| {
            let mut msg = format!("step {i} {op:?}: {e}\nops so far:\n");
            for (j, o) in ops[..=i].iter().enumerate() {
                let _ = writeln!(msg, "  {j}: {o:?}");
            }
            msg
        })?;
    }
    m.finish().map_err(|e| format!("finish: {e}"))?;
    Ok(m)
}

/// Reads bytes as a setup and ops (for fuzzers); never fails, any input is a test.
pub struct Bytes<'a> {
    data: &'a [u8],
}

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }
    fn u64(&mut self, n: usize) -> u64 {
        (0..n).fold(0, |acc, i| acc | (u64::from(self.u8()) << (8 * i)))
    }
}

/// Capacities [`decode`] chooses from.
pub const CAPACITIES: [u64; 4] = [64 * MIB, 512 * MIB, 2048 * MIB, 16384 * MIB];

/// Decodes fuzzer bytes into a setup and a sequence of ops.
pub fn decode(data: &[u8]) -> (Setup, Vec<Op>) {
    let mut b = Bytes { data };
    let configs = configs();
    let config = configs[b.u8() as usize % configs.len()].1.clone();
    let capacity = CAPACITIES[b.u8() as usize % CAPACITIES.len()];
    let streams = 2 + b.u8() as usize % 2;
    let mut ops = Vec::new();
    while !b.data.is_empty() && ops.len() < 1000 {
        let op = match b.u8() % 20 {
            0..=6 => {
                let e = u32::from(b.u8()) % 48;
                let m = b.u64(4);
                let size = match e {
                    29..=44 => log_size(e - 29, m),
                    45 => 0,
                    46 => [MAX_REQUEST, MAX_REQUEST + 1, u64::MAX, 1 << 40][m as usize % 4],
                    47 => capacity + m % capacity,
                    _ => log_size(e, m).min(300 * MIB),
                };
                Op::Malloc {
                    size,
                    stream: b.u8() as usize,
                }
            }
            7..=10 => Op::Free {
                slot: b.u8() as usize,
            },
            11 => Op::DoubleFree {
                slot: b.u8() as usize,
            },
            12 => match b.u8() % 3 {
                0 => Op::ForeignFree { seed: b.u64(8) },
                1 => Op::InteriorFree {
                    slot: b.u8() as usize,
                    offset: b.u64(4),
                },
                _ => Op::RecordStreamStale {
                    slot: b.u8() as usize,
                },
            },
            13 | 14 => Op::RecordStream {
                slot: b.u8() as usize,
                stream: b.u8() as usize,
            },
            15 => Op::CompleteEvent {
                index: b.u8() as usize,
            },
            16 => match b.u8() % 4 {
                0 => Op::CompleteAllEvents,
                1 => Op::ProcessEvents,
                2 => Op::EmptyCache,
                _ => Op::ResetPeak,
            },
            17 => Op::SetCap(match b.u8() % 3 {
                0 => None,
                1 => Some(MemoryCap::Bytes(b.u64(2) * (capacity >> 15))),
                _ => Some(MemoryCap::Fraction(f64::from(b.u8().max(1)) / 255.0)),
            }),
            18 => Op::FailNext(b.u64(1) % 4),
            _ => Op::FailAbove(match b.u8() {
                0..=63 => None,
                e => Some(log_size(u32::from(e) % 31 + 9, b.u64(2))),
            }),
        };
        ops.push(op);
    }
    (
        Setup {
            config,
            capacity,
            streams,
        },
        ops,
    )
}

/// Decodes `data` with [`decode`] and runs it with [`run`]: a fuzz target's whole body.
pub fn run_bytes(data: &[u8]) -> Result<(), String> {
    let (setup, ops) = decode(data);
    run(&setup, &ops)
        .map(|_| ())
        .map_err(|e| format!("config {}: {e}", setup.config.name))
}

/// The first block of a snapshot that still awaits events, if any.
fn awaiting_block(snap: &cachealloc_core::Snapshot) -> Option<&cachealloc_core::BlockSnapshot> {
    snap.segments
        .iter()
        .flat_map(|s| &s.blocks)
        .find(|b| b.state == BlockState::AwaitingEvents)
}
