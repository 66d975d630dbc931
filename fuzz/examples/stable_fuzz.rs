//! The three fuzz bodies on stable Rust, without libFuzzer: random inputs,
//! and mutations of the committed seeds (`fuzz/corpus/<target>/seed-*`),
//! for a time budget; every panic or error is a crash, saved under
//! `fuzz/artifacts/stable/`. Prints the inputs run per target and the
//! allocator operations executed: the `ops` inputs' decoded operations
//! (the fixed sequences that accepted configurations serve are not counted),
//! then the same as one JSON line (`{"seed":…,"ops":…,"crashes":…}`), which
//! `fuzz/run-parallel.sh` sums over processes.
//!
//! `cargo run --release --example stable_fuzz -- SECONDS [SEED]`
//!
//! `CACHEALLOC_FUZZ_DIR` names the folder holding `corpus/` and receiving
//! `artifacts/` (default: this crate's folder), so that a built binary runs
//! on another machine.

use cachealloc_core::sample::XorShift64;
use cachealloc_core::testing;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// `rng.below(n)` for lengths and indices (0 for an empty range).
fn below(rng: &mut XorShift64, n: usize) -> usize {
    rng.below(n.max(1) as u64) as usize
}

/// The folder holding `corpus/` and `artifacts/`.
fn fuzz_dir() -> PathBuf {
    std::env::var_os("CACHEALLOC_FUZZ_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

fn seeds(target: &str) -> Vec<Vec<u8>> {
    let dir = fuzz_dir().join("corpus").join(target);
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("seed-") {
                if let Ok(d) = std::fs::read(e.path()) {
                    out.push(d);
                }
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

fn save(target: &str, data: &[u8], why: &str) {
    let dir = fuzz_dir().join("artifacts/stable");
    let _ = std::fs::create_dir_all(&dir);
    let name = format!("{target}-{:016x}", fxhash(data));
    let _ = std::fs::write(dir.join(&name), data);
    eprintln!("CRASH {target} ({name}): {why}");
}

fn fxhash(d: &[u8]) -> u64 {
    d.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn main() {
    let mut args = std::env::args().skip(1);
    let seconds: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(60);
    let seed: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(1);
    let mut rng = XorShift64::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let (ops_seeds, trace_seeds, config_seeds) = (seeds("ops"), seeds("trace"), seeds("config"));
    if ops_seeds.is_empty() || trace_seeds.is_empty() || config_seeds.is_empty() {
        eprintln!(
            "stable_fuzz: no seeds under {}/corpus: random inputs only (set CACHEALLOC_FUZZ_DIR)",
            fuzz_dir().display()
        );
    }
    std::panic::set_hook(Box::new(|_| {}));
    let (mut runs, mut ops, mut crashes) = ([0u64; 3], 0u64, 0u64);
    let end = Instant::now() + Duration::from_secs(seconds);
    while Instant::now() < end {
        for _ in 0..64 {
            // ops: most of the budget.
            let d = input(&mut rng, &ops_seeds, 4096);
            let n = d
                .split_first()
                .map_or(0, |(_, rest)| testing::decode(rest).1.len() as u64);
            match catch_unwind(AssertUnwindSafe(|| cachealloc_fuzz::ops::run(&d))) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    crashes += 1;
                    save("ops", &d, &e);
                }
                Err(_) => {
                    crashes += 1;
                    save("ops", &d, "panic");
                }
            }
            runs[0] += 1;
            ops += n;
        }
        for (i, (target, seeds, max)) in
            [("trace", &trace_seeds, 2048), ("config", &config_seeds, 96)]
                .into_iter()
                .enumerate()
        {
            let d = input(&mut rng, seeds, max);
            let r = catch_unwind(AssertUnwindSafe(|| match target {
                "trace" => cachealloc_fuzz::trace::check(&d),
                _ => cachealloc_fuzz::config::check(&d),
            }));
            if r.is_err() {
                crashes += 1;
                save(target, &d, "panic");
            }
            runs[i + 1] += 1;
        }
    }
    println!(
        "stable_fuzz seed {seed}, {seconds} s: ops {} inputs, trace {} inputs, config {} inputs; \
         {ops} allocator operations; {crashes} crashes",
        runs[0], runs[1], runs[2]
    );
    println!(
        "{{\"seed\":{seed},\"seconds\":{seconds},\"ops_inputs\":{},\"trace_inputs\":{},\
         \"config_inputs\":{},\"ops\":{ops},\"crashes\":{crashes}}}",
        runs[0], runs[1], runs[2]
    );
}
