//! GPU allocation latency, side by side on one device in one process:
//! cachealloc (the process-wide allocator of device 0, over `CudaDevice`),
//! raw `cuMemAlloc_v2`/`cuMemFree_v2`, and `cuMemAllocAsync`/`cuMemFreeAsync`
//! on the device's default pool with its release threshold at `u64::MAX`.
//!
//! The cases, iteration counts and "best of 3" mirror
//! `python/bench/latency_bench.py` (PyTorch's caching allocator, run in the
//! same device call), so the figures compare directly:
//! - an alloc + free pair at 512 B, 64 KiB, 1 MiB, 16 MiB, 256 MiB (ns per pair);
//! - random alloc/free over 256 live slots (sizes log-uniform 512 B – 8 MiB)
//!   and over 4096 slots (≤ 64 MiB) (ns per operation), the plan of
//!   `cachealloc_core::sample::random_plan` that the lab's host tools replay;
//! - pairs per second from 1, 2, 4, 8, 16 threads sharing the allocator
//!   (64 KiB + 512·(t mod 4) bytes, 200 000 pairs each, thread start included);
//! - `empty_cache` of 100 segments of 20 MiB and of 1000 × 2 MiB blocks (ms).
//!
//! ```text
//! cargo bench --features cuda --bench gpu_latency -- [--json FILE] [--quick]
//! ```
//! Plain harness (no criterion): prints one line per figure, then a table.

use cachealloc::cuda::driver::{self, Stream};
use cachealloc::cuda::{self, CudaDevice};
use cachealloc::{CachingAllocator, DevicePtr, StreamId};
use cachealloc_core::sample::random_plan;
use std::hint::black_box;
use std::time::Instant;

const SIZES: [u64; 5] = [512, 65536, 1 << 20, 16 << 20, 256 << 20];
const THREADS: [usize; 5] = [1, 2, 4, 8, 16];
const DEFAULT_STREAM: StreamId = StreamId(0);

type Alloc = &'static CachingAllocator<CudaDevice>;

struct Bench {
    results: Vec<(String, f64)>,
    quick: bool,
}

impl Bench {
    fn rec(&mut self, key: String, v: f64) {
        println!("{key:45} {v:12.1}");
        self.results.push((key, v));
    }
    fn get(&self, key: &str) -> Option<f64> {
        self.results.iter().find(|(k, _)| k == key).map(|r| r.1)
    }
    fn iters(&self, n: u64) -> u64 {
        if self.quick {
            (n / 20).max(10)
        } else {
            n
        }
    }
}

fn best_of_3(mut f: impl FnMut() -> f64) -> f64 {
    (0..3).map(|_| f()).fold(f64::INFINITY, f64::min)
}

fn ns_per(t0: Instant, n: u64) -> f64 {
    t0.elapsed().as_nanos() as f64 / n as f64
}

fn cachealloc_pair(alloc: Alloc, size: u64, iters: u64) -> f64 {
    for _ in 0..1000 {
        alloc
            .free(alloc.malloc(size, DEFAULT_STREAM).unwrap())
            .unwrap();
    }
    let t0 = Instant::now();
    for _ in 0..iters {
        let p = alloc.malloc(black_box(size), DEFAULT_STREAM).unwrap();
        alloc.free(black_box(p)).unwrap();
    }
    ns_per(t0, iters)
}

fn async_pair(size: u64, iters: u64, s: &Stream) -> f64 {
    let pair = || {
        let p = driver::mem_alloc_async(size, s.id()).unwrap();
        // SAFETY: allocated just above on the same stream, freed once.
        unsafe { driver::mem_free_async(black_box(p), s.id()) }.unwrap();
    };
    for _ in 0..1000 {
        pair();
    }
    s.synchronize().unwrap();
    let t0 = Instant::now();
    for _ in 0..iters {
        pair();
    }
    let r = ns_per(t0, iters);
    s.synchronize().unwrap();
    r
}

fn raw_pair(size: u64, iters: u64) -> f64 {
    let pair = || {
        let p = driver::mem_alloc(size).unwrap();
        // SAFETY: allocated just above, freed once, never used.
        unsafe { driver::mem_free(black_box(p)) }.unwrap();
    };
    pair();
    let t0 = Instant::now();
    for _ in 0..iters {
        pair();
    }
    ns_per(t0, iters)
}

/// Runs the plan twice (warm, then timed) with `alloc`/`free`; returns ns per op.
fn mixed(
    plan: &[(usize, u64)],
    slots: usize,
    mut alloc: impl FnMut(u64) -> DevicePtr,
    mut free: impl FnMut(DevicePtr),
    mut sync: impl FnMut(),
) -> f64 {
    let mut live: Vec<Option<DevicePtr>> = vec![None; slots];
    let mut run = |live: &mut Vec<Option<DevicePtr>>| {
        for &(slot, size) in plan {
            match live[slot].take() {
                Some(p) => free(p),
                None => live[slot] = Some(alloc(size)),
            }
        }
    };
    run(&mut live);
    sync();
    let t0 = Instant::now();
    run(&mut live);
    let r = ns_per(t0, plan.len() as u64);
    for p in live.into_iter().flatten() {
        free(p);
    }
    sync();
    r
}

fn threads_pairs_per_s(alloc: Alloc, threads: usize, size: u64, iters: u64) -> f64 {
    let t0 = Instant::now();
    std::thread::scope(|sc| {
        for t in 0..threads {
            sc.spawn(move || {
                let sz = size + 512 * (t as u64 % 4);
                for _ in 0..iters {
                    let p = alloc.malloc(black_box(sz), DEFAULT_STREAM).unwrap();
                    alloc.free(black_box(p)).unwrap();
                }
            });
        }
    });
    (threads as u64 * iters) as f64 / t0.elapsed().as_secs_f64()
}

fn empty_cache_ms(alloc: Alloc, n: usize, bytes: u64) -> (f64, u64) {
    let ptrs: Vec<_> = (0..n)
        .map(|_| alloc.malloc(bytes, DEFAULT_STREAM).unwrap())
        .collect();
    for p in ptrs {
        alloc.free(p).unwrap();
    }
    let t0 = Instant::now();
    let released = alloc.empty_cache().unwrap();
    (t0.elapsed().as_secs_f64() * 1e3, released.segments)
}

fn size_name(b: u64) -> String {
    match b {
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

fn main() {
    let mut json_out = None;
    let mut quick = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--json" => json_out = args.next(),
            "--quick" => quick = true,
            _ => {} // cargo bench passes --bench
        }
    }
    match driver::device_count() {
        Ok(n) if n > 0 => {}
        Ok(_) => {
            println!("skipping: the CUDA driver sees no device");
            return;
        }
        Err(e) => {
            println!("skipping: no usable CUDA driver ({e})");
            return;
        }
    }
    let alloc = cuda::allocator(0).expect("allocator of device 0");
    alloc.device().bind_thread().unwrap();
    let version = driver::driver_version().unwrap_or(0);
    let info = driver::mem_info().unwrap();
    println!(
        "device 0: {} ({:.1} GiB), CUDA driver {}.{}, cachealloc config: {}",
        alloc.device().name(),
        info.total as f64 / (1u64 << 30) as f64,
        version / 1000,
        version % 1000 / 10,
        alloc.config().to_conf_string()
    );
    driver::set_default_pool_release_threshold(0, u64::MAX).unwrap();
    let stream = Stream::new(alloc.device()).unwrap();
    let mut b = Bench {
        results: Vec::new(),
        quick,
    };

    for size in SIZES {
        let n = b.iters(200_000);
        let v = best_of_3(|| cachealloc_pair(alloc, size, n));
        b.rec(format!("cachealloc_pair_ns[{size}]"), v);
        let v = best_of_3(|| async_pair(size, n, &stream));
        b.rec(format!("async_pair_ns[{size}]"), v);
        let n = b.iters(300);
        let v = best_of_3(|| raw_pair(size, n));
        b.rec(format!("cuda_pair_ns[{size}]"), v);
    }

    for (slots, max, seed, label) in [
        (256usize, 8u64 << 20, 1u64, "256 slots, <=8MiB"),
        (4096, 64 << 20, 2, "4096 slots, <=64MiB"),
    ] {
        let plan = random_plan(slots, max, b.iters(400_000) as usize, seed);
        let v = best_of_3(|| {
            mixed(
                &plan,
                slots,
                |sz| alloc.malloc(sz, DEFAULT_STREAM).unwrap(),
                |p| alloc.free(p).unwrap(),
                || {},
            )
        });
        b.rec(format!("cachealloc_mixed_ns[{label}]"), v);
        let s = stream.id();
        let v = best_of_3(|| {
            mixed(
                &plan,
                slots,
                |sz| driver::mem_alloc_async(sz, s).unwrap(),
                // SAFETY: each pointer comes from mem_alloc_async and is freed once.
                |p| unsafe { driver::mem_free_async(p, s) }.unwrap(),
                || stream.synchronize().unwrap(),
            )
        });
        b.rec(format!("async_mixed_ns[{label}]"), v);
        // The raw driver is ~1000x slower: a shorter plan, one run.
        let raw_plan = &plan[..b.iters(20_000) as usize];
        let v = mixed(
            raw_plan,
            slots,
            |sz| driver::mem_alloc(sz).unwrap(),
            // SAFETY: each pointer comes from mem_alloc and is freed once, unused.
            |p| unsafe { driver::mem_free(p) }.unwrap(),
            || {},
        );
        b.rec(format!("cuda_mixed_ns[{label}]"), v);
    }

    alloc.empty_cache().unwrap();
    for t in THREADS {
        let v = threads_pairs_per_s(alloc, t, 65536, b.iters(200_000));
        b.rec(format!("cachealloc_threads_pairs_per_s[{t}]"), v);
    }

    alloc.empty_cache().unwrap();
    for (n, bytes, label) in [
        (100, 20u64 << 20, "100 x 20MiB"),
        (1000, 2 << 20, "1000 x 2MiB"),
    ] {
        let (ms, segs) = empty_cache_ms(alloc, n, bytes);
        b.rec(format!("cachealloc_empty_cache_ms[{label}]"), ms);
        b.rec(
            format!("cachealloc_empty_cache_segments[{label}]"),
            segs as f64,
        );
    }

    // Summary table.
    println!(
        "\n## {} — ns per alloc+free pair (best of 3)\n",
        alloc.device().name()
    );
    println!("| case | cachealloc | cuMemAllocAsync (pool, thr max) | cuMemAlloc/cuMemFree |");
    println!("|---|---:|---:|---:|");
    for size in SIZES {
        println!(
            "| pair {} | {:.0} | {:.0} | {:.0} |",
            size_name(size),
            b.get(&format!("cachealloc_pair_ns[{size}]"))
                .unwrap_or(f64::NAN),
            b.get(&format!("async_pair_ns[{size}]")).unwrap_or(f64::NAN),
            b.get(&format!("cuda_pair_ns[{size}]")).unwrap_or(f64::NAN),
        );
    }
    for label in ["256 slots, <=8MiB", "4096 slots, <=64MiB"] {
        println!(
            "| random ops, {label} (ns/op) | {:.0} | {:.0} | {:.0} |",
            b.get(&format!("cachealloc_mixed_ns[{label}]"))
                .unwrap_or(f64::NAN),
            b.get(&format!("async_mixed_ns[{label}]"))
                .unwrap_or(f64::NAN),
            b.get(&format!("cuda_mixed_ns[{label}]"))
                .unwrap_or(f64::NAN),
        );
    }
    let one = b
        .get("cachealloc_threads_pairs_per_s[1]")
        .unwrap_or(f64::NAN);
    for t in THREADS {
        let v = b
            .get(&format!("cachealloc_threads_pairs_per_s[{t}]"))
            .unwrap_or(f64::NAN);
        println!(
            "| {t} threads: pairs/s (× 1 thread) | {:.0}k ({:.2}×) | | |",
            v / 1e3,
            v / one
        );
    }
    for label in ["100 x 20MiB", "1000 x 2MiB"] {
        println!(
            "| empty_cache, {label} (ms; {} segments) | {:.2} | | |",
            b.get(&format!("cachealloc_empty_cache_segments[{label}]"))
                .unwrap_or(f64::NAN),
            b.get(&format!("cachealloc_empty_cache_ms[{label}]"))
                .unwrap_or(f64::NAN),
        );
    }

    if let Some(path) = json_out {
        let mut map = serde_json::Map::new();
        map.insert("device".into(), alloc.device().name().into());
        map.insert("driver_version".into(), version.into());
        map.insert("config".into(), alloc.config().to_conf_string().into());
        for (k, v) in &b.results {
            map.insert(k.clone(), (*v).into());
        }
        let text = serde_json::to_string_pretty(&serde_json::Value::Object(map)).unwrap();
        std::fs::write(&path, text).expect("write the JSON results");
        println!("\nwrote {path}");
    }
}
