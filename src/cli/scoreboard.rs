//! `cachealloc scoreboard DIR`: every trace of a folder, and jittered copies
//! of each, under our presets and the PyTorch emulations; per trace the peak
//! reserved and the smallest device that suffices, both over the peak
//! allocated bytes, then the worst case and geometric mean per configuration,
//! and, when `pytorch` is among the configurations, every other
//! configuration's figures that are above the `pytorch` emulation's for the
//! same trace and copy (a policy meant to beat PyTorch's on every workload
//! names its exceptions there).
//!
//! Jittered copies (`--jitter N`, copy k seeded with k) scale every distinct
//! request size by a factor in [0.95, 1.05] (the same factor for the same
//! size, so a tensor shape stays one size) and shuffle the requests within
//! each step: every event moves by up to [`SHUFFLE_WINDOW`] places, never out
//! of its step and a free never before its allocation. Steps come from the
//! trace's `# step N` comments; a trace without them is cut at the rhythm of
//! its live bytes (see [`infer_steps`]).
//!
//! `--scale-down N` divides every request size of every trace (and so of
//! its copies) by N first: a rule whose figures hold only at the recorded
//! scale (a segment size fixed in bytes) shows up there.
//!
//! `--write-copies DIR` writes the copies replayed (`NAME.jN.trace.gz`), so
//! that a cell can be replayed on its own with the same figures.

use super::format::trace_name;
use super::min_capacity::{bisect, SearchError};
use super::{configs_or, jobs, threads, CliError, ConfigArg, ScoreboardArgs};
use cachealloc::core::replay::{replay, ReplayOptions};
use cachealloc::core::{TraceError, TraceEvent};
use cachealloc::trace_file::{self, read_all};
use flate2::read::MultiGzDecoder;
use serde_json::json;
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

/// The configurations a scoreboard compares by default.
pub const DEFAULT_CONFIGS: &[&str] = &[
    "pytorch",
    "pytorch,expandable_segments:True",
    "default",
    "segments",
];
/// How far (in events) the jitter moves an event within its step.
pub const SHUFFLE_WINDOW: f64 = 64.0;
/// How much the jitter scales a request size, up or down.
pub const SIZE_JITTER: f64 = 0.05;

/// A trace in memory with its step boundaries.
pub struct Loaded {
    /// The trace's path.
    pub path: PathBuf,
    /// Its events.
    pub events: Vec<TraceEvent>,
    /// End (exclusive event index) of every step, ascending; the last is `events.len()`.
    pub steps: Vec<usize>,
    /// Whether the steps come from `# step` comments (else inferred).
    pub marked: bool,
}

/// Reads a trace and its `# step` comments.
pub fn load(path: &Path) -> Result<Loaded, String> {
    let events = read_all(path).map_err(|e| e.to_string())?;
    let mut marks = step_marks(path).map_err(|e| format!("{}: {e}", path.display()))?;
    marks.retain(|&m| m > 0 && m < events.len());
    marks.dedup();
    let marked = marks.len() >= 2;
    let mut steps = if marked { marks } else { infer_steps(&events) };
    if steps.last() != Some(&events.len()) {
        steps.push(events.len());
    }
    Ok(Loaded {
        path: path.to_path_buf(),
        events,
        steps,
        marked,
    })
}

/// Event counts at which a `# step` comment stands (none in a PyTorch
/// memory snapshot pickle, whose steps are inferred).
fn step_marks(path: &Path) -> io::Result<Vec<usize>> {
    let mut raw = BufReader::new(File::open(path)?);
    let head = raw.fill_buf()?;
    if cachealloc::pickle_trace::is_pickle(head) {
        return Ok(Vec::new());
    }
    let gzip = head.starts_with(&[0x1f, 0x8b]);
    let text: Box<dyn BufRead> = if gzip {
        Box::new(BufReader::new(MultiGzDecoder::new(raw)))
    } else {
        Box::new(raw)
    };
    let (mut events, mut marks) = (0usize, Vec::new());
    for line in text.lines() {
        let line = line?;
        let t = line.trim();
        if t.is_empty() {
            continue;
        }
        if let Some(c) = t.strip_prefix('#') {
            if c.trim_start().starts_with("step") {
                marks.push(events);
            }
            continue;
        }
        events += 1;
    }
    Ok(marks)
}

/// Step ends of a trace without markers, from the rhythm of its live bytes:
/// a step ends where live bytes fall back to within 10% of the range above
/// their floor, after having risen past the middle of the range (floor and
/// range measured after the first tenth of the trace, which holds the
/// model's set-up). Falls back to runs of 4096 events when that finds fewer
/// than four steps.
pub fn infer_steps(events: &[TraceEvent]) -> Vec<usize> {
    let mut live: HashMap<u64, u64> = HashMap::new();
    let mut bytes = 0u64;
    let mut series = Vec::with_capacity(events.len());
    for e in events {
        match *e {
            TraceEvent::Alloc { id, bytes: b, .. } => {
                live.insert(id, b);
                bytes += b;
            }
            TraceEvent::Free { id } => bytes -= live.remove(&id).unwrap_or(0),
            TraceEvent::EmptyCache => {}
        }
        series.push(bytes);
    }
    let tail = &series[series.len() / 10..];
    let (lo, hi) = (
        tail.iter().copied().min().unwrap_or(0),
        tail.iter().copied().max().unwrap_or(0),
    );
    let range = hi - lo;
    let (low, high) = (lo + range / 10, lo + range / 2);
    let mut steps = Vec::new();
    let mut armed = false;
    for (i, &b) in series.iter().enumerate() {
        if b >= high && range > 0 {
            armed = true;
        } else if armed && b <= low {
            steps.push(i + 1);
            armed = false;
        }
    }
    if steps.len() < 4 {
        steps = (1..=events.len() / 4096).map(|k| k * 4096).collect();
    }
    steps.retain(|&s| s < events.len());
    steps.push(events.len());
    steps
}

/// SplitMix64: a small seeded generator (no dependency, the same on every platform).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Divides every request size by `n` (at least 1 byte); frees and
/// `empty_cache` stay as they are.
pub fn scale_down(events: &mut [TraceEvent], n: u64) {
    for e in events {
        if let TraceEvent::Alloc { bytes, .. } = e {
            *bytes = (*bytes / n).max(1);
        }
    }
}

/// A jittered copy of a trace (see the module docs); `steps` are step ends
/// as in [`Loaded::steps`]. Ids are renumbered, one per allocation.
pub fn jitter(events: &[TraceEvent], steps: &[usize], seed: u64) -> Vec<TraceEvent> {
    // Unique ids first, so that reordering cannot make two live allocations share one.
    let mut renamed = HashMap::new();
    let mut unique = Vec::with_capacity(events.len());
    for (n, e) in events.iter().enumerate() {
        unique.push(match *e {
            TraceEvent::Alloc { id, bytes, stream } => {
                renamed.insert(id, n as u64);
                let f = 1.0 - SIZE_JITTER + 2.0 * SIZE_JITTER * unit(mix(seed ^ mix(bytes)));
                TraceEvent::Alloc {
                    id: n as u64,
                    bytes: if bytes == 0 {
                        0
                    } else {
                        ((bytes as f64 * f).round() as u64).max(1)
                    },
                    stream,
                }
            }
            TraceEvent::Free { id } => TraceEvent::Free {
                id: renamed.remove(&id).unwrap_or(u64::MAX),
            },
            TraceEvent::EmptyCache => TraceEvent::EmptyCache,
        });
    }
    let mut rng = SplitMix(mix(seed.wrapping_add(0x5eed)));
    let mut out = Vec::with_capacity(events.len());
    let mut start = 0;
    let mut keyed: Vec<(f64, TraceEvent)> = Vec::new();
    let mut alloc_key: HashMap<u64, f64> = HashMap::new();
    for &end in steps {
        let end = end.min(unique.len());
        keyed.clear();
        alloc_key.clear();
        for (i, e) in unique[start..end].iter().enumerate() {
            let mut key = i as f64 + rng.unit() * SHUFFLE_WINDOW;
            match *e {
                TraceEvent::Alloc { id, .. } => {
                    alloc_key.insert(id, key);
                }
                TraceEvent::Free { id } => {
                    if let Some(&k) = alloc_key.get(&id) {
                        key = key.max(k + 1e-6);
                    }
                }
                TraceEvent::EmptyCache => key = i as f64,
            }
            keyed.push((key, *e));
        }
        keyed.sort_by(|a, b| a.0.total_cmp(&b.0));
        out.extend(keyed.iter().map(|k| k.1));
        start = end;
    }
    out.extend_from_slice(&unique[start..]);
    out
}

fn unit(h: u64) -> f64 {
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// Peak of live bytes with every request rounded up to 512 bytes, as
/// PyTorch counts allocated memory: the one denominator of every ratio on
/// the board, whatever a configuration's own rounding.
pub fn peak_allocated(events: &[TraceEvent]) -> u64 {
    let mut live: HashMap<u64, u64> = HashMap::new();
    let (mut now, mut peak) = (0u64, 0u64);
    for e in events {
        match *e {
            TraceEvent::Alloc { id, bytes, .. } => {
                let b = if bytes == 0 {
                    0
                } else {
                    bytes.div_ceil(512) * 512
                };
                live.insert(id, b);
                now += b;
                peak = peak.max(now);
            }
            TraceEvent::Free { id } => now -= live.remove(&id).unwrap_or(0),
            TraceEvent::EmptyCache => {}
        }
    }
    peak
}

/// One cell of the board.
#[derive(Clone, Debug)]
pub struct Cell {
    /// Peak allocated (see [`peak_allocated`]).
    pub allocated: u64,
    /// Peak reserved with no capacity limit.
    pub reserved: u64,
    /// The smallest capacity found to complete (None: not searched).
    pub min_capacity: Option<u64>,
    /// Page map calls (expandable segments) with no capacity limit.
    pub maps: u64,
}

impl Cell {
    fn ratio(&self) -> f64 {
        self.reserved as f64 / self.allocated.max(1) as f64
    }
    fn min_ratio(&self) -> Option<f64> {
        self.min_capacity
            .map(|m| m as f64 / self.allocated.max(1) as f64)
    }
}

/// Replays `events` under `config`, and searches the smallest capacity if asked.
pub fn score(
    events: &[TraceEvent],
    config: &ConfigArg,
    search: bool,
    on_fraction: &dyn Fn(f64),
) -> Result<Cell, String> {
    let allocated = peak_allocated(events);
    let steps = std::cell::Cell::new((0u32, 1u32));
    let run = |capacity: Option<u64>| {
        let opts = ReplayOptions {
            capacity,
            timeline_points: 2,
            report_at_peak: false,
            ..Default::default()
        };
        let r = replay(
            || Ok(events.iter().map(|&e| Ok::<_, TraceError>(e))),
            &config.config,
            opts,
        );
        let (done, expected) = steps.get();
        on_fraction(done as f64 / expected.max(1) as f64);
        r
    };
    if !search {
        let r = run(None).map_err(|e| e.to_string())?;
        return Ok(Cell {
            allocated,
            reserved: r.peak_reserved,
            min_capacity: None,
            maps: r.stats.num_map,
        });
    }
    match bisect(run, |d, e| steps.set((d, e))) {
        Ok(s) => Ok(Cell {
            allocated,
            reserved: s.unlimited.peak_reserved,
            min_capacity: Some(s.min_capacity),
            maps: s.unlimited.stats.num_map,
        }),
        Err(SearchError::Replay(e)) => Err(e.to_string()),
        Err(SearchError::NeverCompletes) => Err("never completes".into()),
    }
}

/// The trace files of a folder (`*.trace`, `*.trace.gz`, and PyTorch
/// memory snapshots `*.pickle`), by name.
pub fn trace_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot read the folder {}: {e}", dir.display()))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            p.is_file()
                && (n.ends_with(".trace") || n.ends_with(".trace.gz") || n.ends_with(".pickle"))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!(
            "no trace files (*.trace, *.trace.gz, *.pickle) in {}",
            dir.display()
        ));
    }
    Ok(files)
}

/// Worst case and geometric mean of `(value, where)` pairs.
fn summarize(values: &[(f64, String)]) -> Option<(f64, String, f64)> {
    let worst = values.iter().max_by(|a, b| a.0.total_cmp(&b.0))?;
    let geo = (values.iter().map(|v| v.0.ln()).sum::<f64>() / values.len() as f64).exp();
    Some((worst.0, worst.1.clone(), geo))
}

/// A figure of a configuration above the baseline's for the same trace and copy.
#[derive(Debug)]
struct Above {
    trace: usize,
    copy: usize,
    /// "ratio" (peak reserved) or "min cap" (smallest device).
    measure: &'static str,
    ours: f64,
    theirs: f64,
}

/// Compares every figure of `ours` with the baseline's figure of the same
/// (trace, copy): how many figures both have, and those where `ours` is higher.
fn above_baseline(
    ours: &[(usize, usize, Cell)],
    base: &[(usize, usize, Cell)],
) -> (usize, Vec<Above>) {
    let base: HashMap<(usize, usize), &Cell> = base.iter().map(|(t, c, x)| ((*t, *c), x)).collect();
    let mut compared = 0;
    let mut above = Vec::new();
    for (t, c, cell) in ours {
        let Some(b) = base.get(&(*t, *c)) else {
            continue;
        };
        let pairs = [
            ("ratio", Some(cell.ratio()), Some(b.ratio())),
            ("min cap", cell.min_ratio(), b.min_ratio()),
        ];
        for (measure, x, y) in pairs {
            if let (Some(x), Some(y)) = (x, y) {
                compared += 1;
                if x > y {
                    above.push(Above {
                        trace: *t,
                        copy: *c,
                        measure,
                        ours: x,
                        theirs: y,
                    });
                }
            }
        }
    }
    above.sort_by_key(|a| (a.trace, a.copy));
    (compared, above)
}

/// The events of copy `c` of a trace: the trace itself for 0, else its
/// jittered copy seeded with `c`.
fn copy_events(l: &Loaded, c: usize) -> std::borrow::Cow<'_, [TraceEvent]> {
    match c {
        0 => std::borrow::Cow::Borrowed(&l.events),
        c => std::borrow::Cow::Owned(jitter(&l.events, &l.steps, c as u64)),
    }
}

/// Writes the copies the scoreboard replays (jittered ones, and the
/// recorded trace too when it was scaled) to `dir`, one gzip trace each.
#[cold]
fn write_copies(
    dir: &Path,
    loaded: &[Loaded],
    names: &[String],
    copies: usize,
    scaled: bool,
) -> Result<(), CliError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| CliError::Message(format!("cannot create {}: {e}", dir.display())))?;
    let mut written = 0;
    for (l, name) in loaded.iter().zip(names) {
        for c in 0..copies {
            let path = match c {
                0 if !scaled => continue,
                0 => dir.join(format!("{name}.rec.trace.gz")),
                c => dir.join(format!("{name}.j{c}.trace.gz")),
            };
            trace_file::write_all(&path, copy_events(l, c).iter())
                .map_err(|e| CliError::Message(e.to_string()))?;
            written += 1;
        }
    }
    eprintln!("wrote {written} trace copies to {}", dir.display());
    Ok(())
}

pub fn run(args: ScoreboardArgs) -> Result<(), CliError> {
    let configs = configs_or(args.configs, DEFAULT_CONFIGS);
    let files = trace_files(&args.dir).map_err(CliError::Message)?;
    let copies = args.jitter as usize + 1;
    let search = !args.no_min_capacity;
    let mut loaded: Vec<Loaded> = files
        .iter()
        .map(|f| load(f))
        .collect::<Result<_, _>>()
        .map_err(CliError::Message)?;
    if args.scale_down > 1 {
        for l in &mut loaded {
            scale_down(&mut l.events, args.scale_down);
        }
    }
    // Jobs: (trace, copy, config); copy 0 is the recorded trace.
    let n_configs = configs.len();
    let items: Vec<(usize, usize, usize)> = (0..loaded.len())
        .flat_map(|t| (0..copies).flat_map(move |c| (0..n_configs).map(move |k| (t, c, k))))
        .collect();
    let names: Vec<String> = loaded
        .iter()
        .map(|l| {
            let n = l
                .path
                .file_name()
                .map_or(trace_name(&l.path), |n| n.to_string_lossy().into_owned());
            n.trim_end_matches(".gz")
                .trim_end_matches(".trace")
                .trim_end_matches(".pickle")
                .to_string()
        })
        .collect();
    if let Some(dir) = &args.write_copies {
        write_copies(dir, &loaded, &names, copies, args.scale_down > 1)?;
    }
    let work = |&(t, c, k): &(usize, usize, usize), slot: &jobs::Slot| {
        score(&copy_events(&loaded[t], c), &configs[k], search, &|f| {
            slot.set(f)
        })
    };
    let mut out = io::stdout().lock();
    let name_w = names.iter().map(|n| n.len()).max().unwrap_or(5).max(5);
    let conf_w = configs.iter().map(|c| c.label.len()).max().unwrap_or(6);
    if !args.json {
        writeln!(
            out,
            "{:<name_w$}  {:<4}  {:<conf_w$}  {:>14}  {:>16}  {:>16}  {:>9}",
            "trace",
            "copy",
            "config",
            "peak allocated",
            "reserved / alloc",
            "min cap / alloc",
            "map calls"
        )?;
        out.flush()?;
    }
    // Per config: (ratio, min ratio) of recorded traces and of all copies.
    let mut cells: Vec<Vec<(usize, usize, Cell)>> = vec![Vec::new(); configs.len()];
    let mut failed = false;
    jobs::run(
        &items,
        threads(args.jobs, items.len()),
        "scoreboard",
        work,
        |i, result| {
            let (t, c, k) = items[i];
            let copy = if c == 0 {
                "rec".to_string()
            } else {
                format!("j{c}")
            };
            match result {
                Ok(cell) => {
                    if args.json {
                        let v = json!({
                            "trace": names[t],
                            "copy": copy,
                            "config": configs[k].label,
                            "steps": loaded[t].steps.len(),
                            "steps_marked": loaded[t].marked,
                            "peak_allocated_bytes": cell.allocated,
                            "peak_reserved_bytes": cell.reserved,
                            "reserved_over_allocated": cell.ratio(),
                            "min_capacity_bytes": cell.min_capacity,
                            "min_capacity_over_allocated": cell.min_ratio(),
                            "num_vmm_map": cell.maps,
                        });
                        writeln!(out, "{v}")?;
                    } else {
                        writeln!(
                            out,
                            "{:<name_w$}  {:<4}  {:<conf_w$}  {:>14}  {:>16.3}  {:>16}  {:>9}",
                            names[t],
                            copy,
                            configs[k].label,
                            super::format::size(cell.allocated),
                            cell.ratio(),
                            cell.min_ratio().map_or("–".into(), |m| format!("{m:.3}")),
                            super::format::grouped(cell.maps)
                        )?;
                    }
                    out.flush()?;
                    cells[k].push((t, c, cell));
                }
                Err(e) => {
                    super::report_error(&format!(
                        "{} (copy {copy}), config {}: {e}",
                        names[t], configs[k].label
                    ));
                    failed = true;
                }
            }
            Ok(())
        },
    )?;
    if !args.json {
        writeln!(
            out,
            "\nper configuration: worst (trace) and geometric mean; \"recorded\" = the traces as recorded, \"all\" = with {} jittered cop{} each",
            args.jitter,
            if args.jitter == 1 { "y" } else { "ies" }
        )?;
        writeln!(
            out,
            "{:<conf_w$}  {:<8}  {:>7}  {:<22}  {:>7}  {:>7}  {:<22}  {:>7}",
            "config", "set", "ratio", "worst at", "geomean", "min cap", "worst at", "geomean"
        )?;
    }
    for (k, config) in configs.iter().enumerate() {
        for (set, all) in [("recorded", false), ("all", true)] {
            if !all || copies > 1 {
                let pick = |f: &dyn Fn(&Cell) -> Option<f64>| -> Vec<(f64, String)> {
                    cells[k]
                        .iter()
                        .filter(|(_, c, _)| all || *c == 0)
                        .filter_map(|(t, c, cell)| {
                            let at = if *c == 0 {
                                names[*t].clone()
                            } else {
                                format!("{} j{c}", names[*t])
                            };
                            f(cell).map(|v| (v, at))
                        })
                        .collect()
                };
                let r = summarize(&pick(&|c| Some(c.ratio())));
                let m = summarize(&pick(&|c| c.min_ratio()));
                if args.json {
                    let v = json!({
                        "summary": set,
                        "config": config.label,
                        "worst_ratio": r.as_ref().map(|x| x.0),
                        "worst_ratio_at": r.as_ref().map(|x| x.1.clone()),
                        "geomean_ratio": r.as_ref().map(|x| x.2),
                        "worst_min_capacity": m.as_ref().map(|x| x.0),
                        "worst_min_capacity_at": m.as_ref().map(|x| x.1.clone()),
                        "geomean_min_capacity": m.as_ref().map(|x| x.2),
                    });
                    writeln!(out, "{v}")?;
                } else {
                    let f3 = |x: Option<f64>| x.map_or("–".to_string(), |x| format!("{x:.3}"));
                    writeln!(
                        out,
                        "{:<conf_w$}  {:<8}  {:>7}  {:<22}  {:>7}  {:>7}  {:<22}  {:>7}",
                        config.label,
                        set,
                        f3(r.as_ref().map(|x| x.0)),
                        r.as_ref().map_or(String::new(), |x| x.1.clone()),
                        f3(r.as_ref().map(|x| x.2)),
                        f3(m.as_ref().map(|x| x.0)),
                        m.as_ref().map_or(String::new(), |x| x.1.clone()),
                        f3(m.as_ref().map(|x| x.2)),
                    )?;
                }
            }
        }
    }
    if let Some(base) = configs.iter().position(|c| c.label == "pytorch") {
        let at = |t: usize, c: usize| match c {
            0 => names[t].clone(),
            c => format!("{} j{c}", names[t]),
        };
        let mut header = false;
        for (k, config) in configs
            .iter()
            .enumerate()
            .filter(|(_, c)| c.label != "pytorch")
        {
            let (compared, above) = above_baseline(&cells[k], &cells[base]);
            if args.json {
                let figures: Vec<_> = above
                    .iter()
                    .map(|a| {
                        json!({
                            "at": at(a.trace, a.copy),
                            "measure": a.measure,
                            "value": a.ours,
                            "pytorch": a.theirs,
                        })
                    })
                    .collect();
                let v = json!({
                    "summary": "above_pytorch",
                    "config": config.label,
                    "compared": compared,
                    "above": above.len(),
                    "figures": figures,
                });
                writeln!(out, "{v}")?;
            } else {
                if !header {
                    writeln!(
                        out,
                        "\nfigures above the `pytorch` emulation's (same trace and copy; ratio and min cap each count)"
                    )?;
                    header = true;
                }
                let list: Vec<String> = above
                    .iter()
                    .map(|a| {
                        format!(
                            "{} {} {:.3} > {:.3}",
                            at(a.trace, a.copy),
                            a.measure,
                            a.ours,
                            a.theirs
                        )
                    })
                    .collect();
                writeln!(
                    out,
                    "{:<conf_w$}  {} of {}{}{}",
                    config.label,
                    above.len(),
                    compared,
                    if list.is_empty() { "" } else { ": " },
                    list.join(", ")
                )?;
            }
        }
    }
    if !args.json {
        writeln!(
            out,
            "(ratios over peak allocated with PyTorch's 512-byte rounding; min cap: smallest simulated device that completes, precision max(2 MiB, 0.1%))"
        )?;
    }
    out.flush()?;
    if failed {
        Err(CliError::Reported)
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(id: u64, bytes: u64) -> TraceEvent {
        TraceEvent::Alloc {
            id,
            bytes,
            stream: 0,
        }
    }
    fn f(id: u64) -> TraceEvent {
        TraceEvent::Free { id }
    }

    /// A training-like trace: 3 persistent blocks, then `n` steps that each
    /// allocate ten activations and free them.
    fn steps_trace(n: u64) -> Vec<TraceEvent> {
        let mut v = vec![a(0, 1 << 20), a(1, 1 << 20), a(2, 1 << 20)];
        let mut id = 3;
        for s in 0..n {
            let first = id;
            for j in 0..10 {
                v.push(a(id, (j + 1 + s % 3) << 22));
                id += 1;
            }
            for k in first..id {
                v.push(f(k));
            }
        }
        v
    }

    fn valid(events: &[TraceEvent]) -> bool {
        let mut live = std::collections::HashSet::new();
        events.iter().all(|e| match *e {
            TraceEvent::Alloc { id, .. } => live.insert(id),
            TraceEvent::Free { id } => live.remove(&id),
            TraceEvent::EmptyCache => true,
        })
    }

    #[test]
    fn rhythm_finds_the_steps_of_a_training_loop() {
        let t = steps_trace(40);
        let steps = infer_steps(&t);
        assert_eq!(steps.len(), 40, "{steps:?}");
        assert_eq!(steps[0], 3 + 20);
        assert!(steps.windows(2).all(|w| w[1] - w[0] == 20));
    }

    #[test]
    fn jitter_keeps_every_free_after_its_alloc_and_stays_in_the_step() {
        let t = steps_trace(40);
        let steps = infer_steps(&t);
        for seed in 1..5 {
            let j = jitter(&t, &steps, seed);
            assert_eq!(j.len(), t.len());
            assert!(valid(&j), "seed {seed}");
            assert_ne!(j, t);
            // Every step holds the same allocations as before (ids are the
            // original event indices), only in another order.
            let mut start = 0;
            for &end in &steps {
                let ids = |v: &[TraceEvent]| -> Vec<u64> {
                    let mut x: Vec<u64> = v
                        .iter()
                        .filter_map(|e| match e {
                            TraceEvent::Alloc { id, .. } => Some(*id),
                            _ => None,
                        })
                        .collect();
                    x.sort_unstable();
                    x
                };
                let want: Vec<u64> = (start..end)
                    .filter(|&i| matches!(t[i], TraceEvent::Alloc { .. }))
                    .map(|i| i as u64)
                    .collect();
                assert_eq!(ids(&j[start..end]), want);
                start = end;
            }
        }
        assert_eq!(jitter(&t, &steps, 3), jitter(&t, &steps, 3), "seeded");
    }

    #[test]
    fn scale_down_divides_allocations_only() {
        let mut t = vec![
            TraceEvent::Alloc {
                id: 0,
                bytes: 8000,
                stream: 0,
            },
            TraceEvent::Alloc {
                id: 1,
                bytes: 3,
                stream: 1,
            },
            TraceEvent::Free { id: 0 },
            TraceEvent::EmptyCache,
        ];
        let before = t.clone();
        scale_down(&mut t, 8);
        assert_eq!(
            t[0],
            TraceEvent::Alloc {
                id: 0,
                bytes: 1000,
                stream: 0
            }
        );
        assert_eq!(
            t[1],
            TraceEvent::Alloc {
                id: 1,
                bytes: 1,
                stream: 1
            },
            "at least one byte"
        );
        assert_eq!(t[2..], before[2..]);
    }

    #[test]
    fn jitter_scales_one_size_by_one_factor_within_five_percent() {
        let t = steps_trace(10);
        let j = jitter(&t, &infer_steps(&t), 7);
        let mut map = HashMap::new();
        let sizes = |v: &[TraceEvent]| -> Vec<u64> {
            v.iter()
                .filter_map(|e| match e {
                    TraceEvent::Alloc { bytes, .. } => Some(*bytes),
                    _ => None,
                })
                .collect()
        };
        // Allocations keep their relative order only within a step, so compare sorted per size.
        let (mut s0, mut s1) = (sizes(&t), sizes(&j));
        s0.sort_unstable();
        s1.sort_unstable();
        for (x, y) in s0.iter().zip(&s1) {
            let r = *y as f64 / *x as f64;
            assert!((0.95..=1.05).contains(&r), "{x} -> {y}");
            assert_eq!(*map.entry(*x).or_insert(*y), *y, "one factor per size");
        }
    }

    #[test]
    fn peak_allocated_rounds_like_pytorch() {
        assert_eq!(
            peak_allocated(&[a(0, 1), a(1, 513), f(0), a(2, 100)]),
            512 + 1024
        );
        assert_eq!(peak_allocated(&[a(0, 0)]), 0);
    }

    #[test]
    fn summary_is_worst_and_geometric_mean() {
        let (w, at, g) = summarize(&[(1.0, "a".into()), (4.0, "b".into())]).unwrap();
        assert_eq!((w, at.as_str()), (4.0, "b"));
        assert!((g - 2.0).abs() < 1e-12);
        assert!(summarize(&[]).is_none());
    }

    /// Only figures strictly above the baseline's count; a figure one side
    /// lacks (no min-capacity search, or no baseline cell) is not compared.
    #[test]
    fn above_baseline_lists_higher_figures_of_the_same_copy() {
        let cell = |reserved, min_capacity| Cell {
            allocated: 100,
            reserved,
            min_capacity,
            maps: 0,
        };
        let ours = vec![
            (0, 0, cell(110, Some(105))),
            (0, 1, cell(120, Some(104))),
            (1, 0, cell(100, None)),
            (2, 0, cell(500, Some(500))),
        ];
        let base = vec![
            (0, 0, cell(150, Some(105))),
            (0, 1, cell(119, Some(103))),
            (1, 0, cell(100, Some(100))),
        ];
        let (compared, above) = above_baseline(&ours, &base);
        assert_eq!(compared, 5, "(0,0) and (0,1) twice, (1,0) ratio only");
        let got: Vec<_> = above.iter().map(|a| (a.trace, a.copy, a.measure)).collect();
        assert_eq!(got, [(0, 1, "ratio"), (0, 1, "min cap")]);
        assert_eq!((above[0].ours, above[0].theirs), (1.2, 1.19));
    }
}
