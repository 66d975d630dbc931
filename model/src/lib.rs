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

use cachealloc_core::{Config, MemoryCap, StreamId};
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
            parse(
                "expandable,expandable_page_mb:4,slab_max_kb:64,\
                 expandable_edges:big,expandable_page_divisor:0",
            ),
        ),
        // Pages scaled to the workload where the model's peaks cross the
        // steps: 2 MiB below 40 MiB, 10 MiB below 80 MiB, then 20 MiB.
        (
            "expandable-scaled-pages",
            parse("expandable,expandable_page_mb:20,expandable_page_divisor:4"),
        ),
        // Granule pages everywhere.
        (
            "expandable-small-pages",
            parse("expandable,expandable_page_mb:2,expandable_edges:small"),
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

mod bytes;
mod model;
mod stats;

pub use bytes::{decode, run_bytes, Bytes, CAPACITIES};
pub use model::Model;
pub use stats::{
    check_expandable_stats_against_snapshot, check_stats_against_snapshot, free_segments,
};

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
