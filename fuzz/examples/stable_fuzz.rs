//! The three fuzz bodies on stable Rust, without libFuzzer: random inputs,
//! and mutations of the committed seeds (`corpus/<target>/seed-*`), for a
//! time budget; every panic or error is a crash, its input saved.
//!
//! ```text
//! stable_fuzz SECONDS [SEED] [CRASH_DIR]
//! ```
//!
//! - `CRASH_DIR` (or the environment variable `STABLE_FUZZ_CRASH_DIR`;
//!   default `fuzz/artifacts/stable` of the source tree) receives each
//!   crashing input as `<target>-<hash>`, with `<target>-<hash>.txt` holding
//!   the message.
//! - The seeds are read from `STABLE_FUZZ_CORPUS` (a directory holding
//!   `ops/`, `trace/`, `config/`), else `fuzz/corpus` or `corpus` under the
//!   working directory, else the source tree's `fuzz/corpus`.
//! - Crash messages go to stderr; the last line on stdout is one JSON
//!   object: seed, seconds asked and elapsed, per target the inputs run,
//!   the allocator operations executed and the crashes, their totals, and
//!   the seeds found per target.
//!
//! - `STABLE_FUZZ_PRESET=NAME` runs every `ops` input under that preset
//!   (e.g. `default`) instead of the configuration its first byte picks;
//!   the final line names it as `"preset"`.
//!
//! Allocator operations: for `ops`, the decoded operations of each input
//! (each one a step the model checker judges); for `trace`, the events of
//! each trace replayed; for `config`, the fixed sequence's operations, once
//! per configuration the parser accepted.

use cachealloc_core::sample::XorShift64;
use cachealloc_core::Config;
use cachealloc_model as model;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// `rng.below(n)` for lengths and indices (0 for an empty range).
fn below(rng: &mut XorShift64, n: usize) -> usize {
    rng.below(n.max(1) as u64) as usize
}

/// The directory the seeds are read from (see the module docs).
fn corpus_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("STABLE_FUZZ_CORPUS") {
        return PathBuf::from(d);
    }
    for d in ["fuzz/corpus", "corpus"] {
        if Path::new(d).join("ops").is_dir() {
            return PathBuf::from(d);
        }
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus")
}

fn seeds(corpus: &Path, target: &str) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(corpus.join(target)) {
        let mut paths: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("seed-"))
            .map(|e| e.path())
            .collect();
        // The same seed and corpus give the same inputs, whatever the directory order.
        paths.sort();
        for p in paths {
            if let Ok(d) = std::fs::read(p) {
                out.push(d);
            }
        }
    }
    out
}

/// A random input, or a seed with a few random byte edits.
fn input(rng: &mut XorShift64, seeds: &[Vec<u8>], max_len: usize) -> Vec<u8> {
    if seeds.is_empty() || below(rng, 3) == 0 {
        let len = below(rng, max_len);
        return (0..len).map(|_| rng.next() as u8).collect();
    }
    let mut d = seeds[below(rng, seeds.len())].clone();
    for _ in 0..1 + below(rng, 8) {
        match below(rng, 4) {
            0 if !d.is_empty() => {
                let i = below(rng, d.len());
                d[i] = rng.next() as u8;
            }
            1 if d.len() < max_len => {
                let i = below(rng, d.len() + 1);
                d.insert(i, rng.next() as u8);
            }
            2 if !d.is_empty() => {
                let i = below(rng, d.len());
                d.remove(i);
            }
            _ => {
                let other = &seeds[below(rng, seeds.len())];
                if !other.is_empty() {
                    let a = below(rng, other.len());
                    let n = below(rng, other.len() - a + 1).min(max_len);
                    let at = below(rng, d.len() + 1);
                    d.splice(at..at, other[a..a + n].iter().copied());
                    d.truncate(max_len);
                }
            }
        }
    }
    d
}

/// Saves a crashing input and its message; returns the file name.
fn save(dir: &Path, target: &str, data: &[u8], why: &str) {
    let _ = std::fs::create_dir_all(dir);
    let name = format!("{target}-{:016x}", fxhash(data));
    let _ = std::fs::write(dir.join(&name), data);
    let _ = std::fs::write(dir.join(format!("{name}.txt")), why);
    eprintln!("CRASH {target} ({}): {why}", dir.join(&name).display());
}

fn fxhash(d: &[u8]) -> u64 {
    d.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// The message of a caught panic.
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        format!("panic: {s}")
    } else if let Some(s) = p.downcast_ref::<String>() {
        format!("panic: {s}")
    } else {
        "panic".into()
    }
}

/// Runs one input of `target`; returns its allocator operations, or the crash message.
fn run_one(target: usize, d: &[u8], only: Option<&Config>) -> Result<u64, String> {
    let r = catch_unwind(AssertUnwindSafe(|| match target {
        0 => {
            let n = d
                .split_first()
                .map_or(0, |(_, rest)| model::decode(rest).1.len() as u64);
            cachealloc_fuzz::ops::run_under(d, only).map(|()| n)
        }
        1 => Ok(cachealloc_fuzz::trace::check_counted(d)),
        _ => Ok(cachealloc_fuzz::config::check_counted(d)),
    }));
    match r {
        Ok(r) => r,
        Err(p) => Err(panic_message(p.as_ref())),
    }
}

const TARGETS: [&str; 3] = ["ops", "trace", "config"];

fn main() {
    let mut args = std::env::args().skip(1);
    let seconds: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(60);
    let seed: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(1);
    let crash_dir = args
        .next()
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("STABLE_FUZZ_CRASH_DIR").map(PathBuf::from))
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("artifacts/stable"));
    let preset = std::env::var("STABLE_FUZZ_PRESET").ok();
    let only = preset.as_deref().map(|n| match Config::preset(n) {
        Some(c) => c,
        None => {
            eprintln!("STABLE_FUZZ_PRESET: unknown preset {n:?}");
            std::process::exit(2);
        }
    });
    let mut rng = XorShift64::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let corpus = corpus_dir();
    let all_seeds: Vec<Vec<Vec<u8>>> = TARGETS.iter().map(|t| seeds(&corpus, t)).collect();
    // Crashes are reported with their message, not the default hook's output.
    std::panic::set_hook(Box::new(|_| {}));
    let (mut runs, mut ops, mut crashes) = ([0u64; 3], [0u64; 3], [0u64; 3]);
    let max_len = [4096, 2048, 96];
    let start = Instant::now();
    let end = start + Duration::from_secs(seconds);
    'run: loop {
        // ops: most of the budget; trace and config: one input each per round.
        for t in std::iter::repeat_n(0, 64).chain([1, 2]) {
            if Instant::now() >= end {
                break 'run;
            }
            let d = input(&mut rng, &all_seeds[t], max_len[t]);
            match run_one(t, &d, only.as_ref()) {
                Ok(n) => ops[t] += n,
                Err(e) => {
                    crashes[t] += 1;
                    save(&crash_dir, TARGETS[t], &d, &e);
                }
            }
            runs[t] += 1;
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let per_target: Vec<String> = (0..3)
        .map(|t| {
            format!(
                "\"{}\":{{\"runs\":{},\"ops\":{},\"crashes\":{},\"seeds\":{}}}",
                TARGETS[t],
                runs[t],
                ops[t],
                crashes[t],
                all_seeds[t].len()
            )
        })
        .collect();
    let total_ops: u64 = ops.iter().sum();
    println!(
        "{{\"seed\":{seed},\"preset\":{},\"seconds\":{seconds},\"elapsed_s\":{elapsed:.3},\"ops_per_s\":{:.0},\"targets\":{{{}}},\"runs\":{},\"ops\":{total_ops},\"crashes\":{}}}",
        preset.map_or("null".into(), |p| format!("\"{p}\"")),
        total_ops as f64 / elapsed.max(1e-9),
        per_target.join(","),
        runs.iter().sum::<u64>(),
        crashes.iter().sum::<u64>()
    );
}
