//! The lab: measurement tools and policy studies of cachealloc, kept out of
//! the published crates. Each binary in `src/bin/` answers one question
//! (docs/BENCHMARKS.md has the answers):
//!
//! - `lean_core`: how fast could the core's algorithm go? A lean
//!   re-implementation of the `pytorch` policy's hot path ([`lean`]), timed
//!   next to the real allocator on the random-op plan.
//! - `slab_eval`: what would slabs for small requests cost in fragmentation
//!   on the shipped traces ([`slab_study`])?
//! - `policy_eval`: how do presets fare on perturbed traces (sizes jittered)?
//! - `peak_dump`: the segment map at the reserved peak of a replay.
//! - `oom_dump`: the segment map at the first out-of-memory on a device of a
//!   given capacity, or before a given event (to compare configurations).
//! - `call_log`: every trace event that made device allocations or frees.
//! - `random_ops`, `pair_ops`: host time per operation of the core on the
//!   simulated device, for profiling.
//!
//! ```text
//! cargo run -p lab --release --bin lean_core -- 256 8 2000000 check
//! ```
//!
//! The tests (`cargo test -p lab`) check that the studies decide as the core
//! does, so that their figures mean something; the studies themselves never
//! run in CI.

pub mod lean;
pub mod slab_study;

/// The random-op plan and the RNG every tool shares (the core's, so the
/// host and GPU benchmarks replay the same plan).
pub use cachealloc_core::sample::{random_plan, XorShift64};

use cachealloc_core::{BlockState, SegmentSnapshot, TraceEvent};

/// Mebibyte.
pub const MIB: u64 = 1 << 20;

/// Every event of a trace file (plain or gzip), through the CLI's reader;
/// exits with the reader's message (which names the file and line) if it
/// cannot be read.
pub fn load_trace(path: &str) -> Vec<TraceEvent> {
    cachealloc::trace_file::read_all(path).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(1)
    })
}

/// The tool's positional argument `i` parsed, or `default` when absent;
/// exits naming the argument if it does not parse.
pub fn arg<T: std::str::FromStr>(args: &[String], i: usize, name: &str, default: T) -> T {
    match args.get(i) {
        None => default,
        Some(s) => s.parse().unwrap_or_else(|_| {
            eprintln!("{name}: cannot parse {s:?}");
            std::process::exit(2)
        }),
    }
}

/// The tool's positional argument `i` as an allocator configuration
/// (`Config::parse`), or `default` when absent; exits with the parser's
/// message if it does not parse.
pub fn config_arg(args: &[String], i: usize, default: &str) -> cachealloc_core::Config {
    let text = args.get(i).map_or(default, String::as_str);
    cachealloc_core::Config::parse(text).unwrap_or_else(|e| {
        eprintln!("configuration {text:?}: {e}");
        std::process::exit(2)
    })
}

/// Bytes of `s`'s free blocks, and the segment as one line of block sizes in
/// MiB (`_` marks a free block), for the tools that print a segment map.
pub fn segment_line(s: &SegmentSnapshot) -> (u64, String) {
    let free: u64 = s
        .blocks
        .iter()
        .filter(|b| b.state == BlockState::Free)
        .map(|b| b.size)
        .sum();
    let blocks: Vec<String> = s
        .blocks
        .iter()
        .map(|b| {
            let mark = if b.state == BlockState::Free { "_" } else { "" };
            format!("{mark}{:.1}", b.size as f64 / MIB as f64)
        })
        .collect();
    let line = format!(
        "seg {:>7.1} MiB free {:>7.1}: {}",
        s.total_size as f64 / MIB as f64,
        free as f64 / MIB as f64,
        blocks.join(" ")
    );
    (free, line)
}
