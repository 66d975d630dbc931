//! `cachealloc min-capacity`: the smallest simulated device on which a trace
//! runs to the end without out-of-memory, by bisection on the capacity.

use super::format::{gib, grouped, record, size, trace_name, Align, Table};
use super::{
    configs_or, jobs, report_error, threads, trace_config_jobs, CliError, ConfigArg,
    MinCapacityArgs,
};
use cachealloc::core::replay::{ReplayOptions, ReplayResult};
use cachealloc::trace_file::replay_file_with_progress;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::io::{self, Write};
use std::path::PathBuf;
use std::time::Instant;

const DEFAULT_CONFIGS: &[&str] = &["default"];
const MIB: u64 = 1 << 20;
/// No device is larger than this (1 PiB); a trace that fails there never completes.
const LARGEST: u64 = 1 << 50;

/// What the search found.
#[derive(Debug)]
pub struct Search {
    /// The smallest capacity found at which the trace completes.
    pub min_capacity: u64,
    /// The largest capacity tried at which it did not (`None`: it completes
    /// at peak allocated, below which no trace can).
    pub fails_at: Option<u64>,
    /// The replay with no capacity limit.
    pub unlimited: ReplayResult,
    /// The replay at `min_capacity`.
    pub at_min: ReplayResult,
    /// Replays made, the unlimited one included (about 12 on a trace of 10 GiB).
    pub replays: u32,
    /// Wall-clock seconds of the whole search.
    pub seconds: f64,
}

impl Search {
    /// `min_capacity` over the unlimited replay's peak allocated bytes.
    pub fn over_peak_allocated(&self) -> Option<f64> {
        (self.unlimited.peak_allocated > 0)
            .then(|| self.min_capacity as f64 / self.unlimited.peak_allocated as f64)
    }
}

/// The precision the search stops at for an upper bound `hi`: 2 MiB or
/// 0.1 %, whichever is coarser.
pub fn precision(hi: u64) -> u64 {
    (2 * MIB).max(hi / 1000)
}

/// Why a search failed.
#[derive(Debug)]
pub enum SearchError<E> {
    /// A replay failed.
    Replay(E),
    /// The trace runs out of memory even on the largest device.
    NeverCompletes,
}

/// Bisects on the capacity. `replay(None)` replays with no limit,
/// `replay(Some(c))` on a device of `c` bytes; `on_step(done, expected)`
/// tells how far the search is.
///
/// Below the peak allocated bytes a trace cannot complete (its live blocks
/// alone need that much), so that is the lower bound, tried first; the
/// unlimited replay's peak reserved is the upper bound (checked). Completion need not
/// be monotonic in the capacity (flush-and-retry changes the layout), so the
/// answer is a capacity that completes next to one that does not.
pub fn bisect<E>(
    mut replay: impl FnMut(Option<u64>) -> Result<ReplayResult, E>,
    mut on_step: impl FnMut(u32, u32),
) -> Result<Search, SearchError<E>> {
    let start = Instant::now();
    let unlimited = replay(None).map_err(SearchError::Replay)?;
    if !unlimited.completed() {
        return Err(SearchError::NeverCompletes);
    }
    let mut replays = 1;
    let lower = unlimited.peak_allocated;
    let mut hi = unlimited.peak_reserved;
    if hi == 0 {
        return Ok(Search {
            min_capacity: 0,
            fails_at: None,
            at_min: unlimited.clone(),
            unlimited,
            replays,
            seconds: start.elapsed().as_secs_f64(),
        });
    }
    // Bisection steps left from (lo, hi), assuming the upper half each time.
    let expected = |mut lo: u64, hi: u64| {
        let mut steps = 0;
        while hi - lo > precision(hi) {
            lo += (hi - lo) / 2;
            steps += 1;
        }
        steps
    };
    // The upper bound: peak reserved should complete; grow it if it does not.
    let mut at_hi = loop {
        on_step(replays, replays + 1 + expected(lower.saturating_sub(1), hi));
        let r = replay(Some(hi)).map_err(SearchError::Replay)?;
        replays += 1;
        if r.completed() {
            break r;
        }
        if hi >= LARGEST {
            return Err(SearchError::NeverCompletes);
        }
        hi = (hi * 2).min(LARGEST);
    };
    // One byte below peak allocated cannot hold the peak: a known failure.
    let mut lo = lower.saturating_sub(1);
    let mut fails_at = None;
    // Peak allocated itself is the best possible answer: try it first, so
    // that a trace that fits exactly gets the exact answer.
    if lower < hi && hi - lo > precision(hi) {
        on_step(replays, replays + 1 + expected(lo, hi));
        let r = replay(Some(lower)).map_err(SearchError::Replay)?;
        replays += 1;
        if r.completed() {
            hi = lower;
            at_hi = r;
        } else {
            lo = lower;
            fails_at = Some(lower);
        }
    }
    while hi - lo > precision(hi) {
        on_step(replays, replays + expected(lo, hi));
        let mid = lo + (hi - lo) / 2;
        let r = replay(Some(mid)).map_err(SearchError::Replay)?;
        replays += 1;
        if r.completed() {
            hi = mid;
            at_hi = r;
        } else {
            lo = mid;
            fails_at = Some(mid);
        }
    }
    on_step(replays, replays);
    Ok(Search {
        min_capacity: hi,
        fails_at,
        unlimited,
        at_min: at_hi,
        replays,
        seconds: start.elapsed().as_secs_f64(),
    })
}

pub fn run(args: MinCapacityArgs) -> Result<(), CliError> {
    let configs = configs_or(args.configs, DEFAULT_CONFIGS);
    let (jobs, trace_width, config_width) = trace_config_jobs(&args.traces, &configs);
    let table = Table::new(&[
        ("trace", trace_width, Align::Left),
        ("config", config_width, Align::Left),
        ("min capacity", 10, Align::Right),
        ("/ peak allocated", 6, Align::Right),
        ("retries there", 5, Align::Right),
        ("fails at", 12, Align::Right),
        ("peak allocated", 10, Align::Right),
        ("reserved, no limit", 10, Align::Right),
        ("replays", 3, Align::Right),
        ("seconds", 7, Align::Right),
    ]);
    let mut out = io::stdout().lock();
    if !args.json {
        writeln!(out, "{}", table.header())?;
        out.flush()?;
    }
    let work = |&(trace, config): &(&PathBuf, &ConfigArg), slot: &jobs::Slot| {
        // (replays done, replays expected), for the progress bar.
        let step = std::cell::Cell::new((0u32, 1u32));
        bisect(
            |capacity| {
                let options = ReplayOptions {
                    capacity,
                    timeline_points: 2,
                    report_at_peak: false,
                    ..Default::default()
                };
                replay_file_with_progress(trace, &config.config, options, &mut |p| {
                    let (done, expected) = step.get();
                    slot.set((done as f64 + p.fraction()) / expected.max(1) as f64);
                })
            },
            |done, expected| step.set((done, expected)),
        )
    };
    let mut failed: HashSet<PathBuf> = HashSet::new();
    jobs::run(
        &jobs,
        threads(args.jobs, jobs.len()),
        "min-capacity",
        work,
        |i, result| {
            let (trace, config) = jobs[i];
            match result {
                Ok(s) => {
                    if args.json {
                        let mut m = record(trace, config, Some(s.min_capacity), &s.at_min);
                        m.insert("seconds".into(), json!(s.seconds));
                        m.insert("events_per_second".into(), Value::Null);
                        m.insert("min_capacity_bytes".into(), json!(s.min_capacity));
                        m.insert(
                            "min_capacity_over_peak_allocated".into(),
                            json!(s.over_peak_allocated()),
                        );
                        m.insert("fails_at_bytes".into(), json!(s.fails_at));
                        m.insert("precision_bytes".into(), json!(precision(s.min_capacity)));
                        m.insert(
                            "unlimited_peak_allocated_bytes".into(),
                            json!(s.unlimited.peak_allocated),
                        );
                        m.insert(
                            "unlimited_peak_reserved_bytes".into(),
                            json!(s.unlimited.peak_reserved),
                        );
                        m.insert("replays".into(), json!(s.replays));
                        writeln!(out, "{}", Value::Object(m))?;
                    } else {
                        let cells = [
                            trace_name(trace),
                            config.label.clone(),
                            size(s.min_capacity),
                            s.over_peak_allocated()
                                .map_or("–".into(), |x| format!("{x:.3}")),
                            grouped(s.at_min.stats.num_alloc_retries),
                            s.fails_at.map_or("< peak alloc".into(), size),
                            size(s.unlimited.peak_allocated),
                            size(s.unlimited.peak_reserved),
                            s.replays.to_string(),
                            format!("{:.2}", s.seconds),
                        ];
                        writeln!(out, "{}", table.row(&cells))?;
                    }
                    out.flush()?;
                }
                Err(SearchError::Replay(e)) => {
                    if failed.insert(trace.clone()) {
                        report_error(&e.to_string());
                    }
                }
                Err(SearchError::NeverCompletes) => {
                    report_error(&format!(
                        "{}: config {}: the trace runs out of memory even on a {} device",
                        trace_name(trace),
                        config.label,
                        gib(LARGEST)
                    ));
                    failed.insert(trace.clone());
                }
            }
            Ok(())
        },
    )?;
    if !args.json {
        writeln!(
            out,
            "(smallest simulated device capacity at which the trace completes, flush-and-retry allowed; \
             precision max(2 MiB, 0.1%); GiB = 2^30 bytes; / peak allocated: over this configuration's own \
             peak of allocated blocks with no limit, where `scoreboard` divides by the requests' peak \
             rounded to 512 bytes, the same for every configuration)"
        )?;
    }
    out.flush()?;
    if failed.is_empty() {
        Ok(())
    } else {
        Err(CliError::Reported)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachealloc::core::replay::replay;
    use cachealloc::core::{Config, TraceReader};

    fn search(text: &str, config: &Config) -> Search {
        let r: Result<_, SearchError<()>> = bisect(
            |capacity| {
                let opts = ReplayOptions {
                    capacity,
                    report_at_peak: false,
                    ..Default::default()
                };
                Ok(replay(|| Ok(TraceReader::new(text.as_bytes())), config, opts).unwrap())
            },
            |_, _| {},
        );
        r.unwrap()
    }

    #[test]
    fn precision_is_the_coarser_of_2mib_and_a_permille() {
        assert_eq!(precision(0), 2 * MIB);
        assert_eq!(precision(1 << 30), 2 * MIB);
        assert_eq!(precision(20_000_000_000), 20_000_000);
    }

    #[test]
    fn a_trace_that_needs_no_retry() {
        // 100 MiB then 50 MiB live together: PyTorch's policy gives each its own
        // segment (2 MiB granules), so 150 MiB is both peak allocated and the answer.
        let s = search(
            "a 0 104857600 0\na 1 52428800 0\nf 0\nf 1\n",
            &Config::pytorch(),
        );
        assert_eq!(s.unlimited.peak_allocated, 150 * MIB);
        assert_eq!(s.min_capacity, 150 * MIB);
        assert_eq!(s.fails_at, None);
        assert!(s.at_min.completed());
        assert_eq!(s.at_min.stats.num_alloc_retries, 0);
    }

    #[test]
    fn empty_trace() {
        let s = search("# nothing\n", &Config::pytorch());
        assert_eq!(s.min_capacity, 0);
        assert_eq!(s.over_peak_allocated(), None);
    }
}
