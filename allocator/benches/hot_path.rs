//! Host cost of the caching allocator on the simulated device.
//!
//! - `cached_pair/<config>/<size>`: one `malloc` + `free` pair served from
//!   the cache (the segment is allocated once, before measuring).
//! - `random_256_slots/<config>`: one op per iteration on 256 slots: a random
//!   slot is freed if live, else filled with a log-uniform 512 B–8 MiB
//!   request; pre-warmed so that the cache holds the segments it needs.
//! - `cold_growth/<config>/<size>`: one request that grows an empty
//!   expandable allocator by `size` (every page created and mapped), freed
//!   and given back with `empty_cache`: the host cost of the page loop.
//!
//! Run: `cargo bench -p cachealloc-core --bench hot_path`
//! (add `-- --warm-up-time 1 --measurement-time 3` for a quicker run).

use cachealloc_core::sample::XorShift64;
use cachealloc_core::{CachingAllocator, Config, DevicePtr, SimulatedDevice, StreamId};
use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};

const S0: StreamId = StreamId(0);
const SLOTS: usize = 256;

/// Log-uniform from 512 B to 8 MiB.
#[inline]
fn size(rng: &mut XorShift64) -> u64 {
    let r = rng.next();
    let e = 9 + (r % 14); // 2^9 … 2^22
    let base = 1u64 << e;
    base + ((r >> 8) & (base - 1))
}

fn configs() -> [(&'static str, Config); 4] {
    [
        ("default", Config::default()),
        (
            "default-no-thread-cache",
            Config::parse("default,thread_cache:0").expect("valid"),
        ),
        ("pytorch", Config::pytorch()),
        ("expandable", Config::expandable()),
    ]
}

fn cached_pair(c: &mut Criterion) {
    let mut g = c.benchmark_group("cached_pair");
    for (name, config) in configs() {
        for (label, size) in [
            ("512B", 512u64),
            ("64KiB", 64 << 10),
            ("1MiB", 1 << 20),
            ("16MiB", 16 << 20),
            ("256MiB", 256 << 20),
        ] {
            let dev = SimulatedDevice::unlimited();
            let a = CachingAllocator::new(dev.clone(), config.clone());
            let p = a.malloc(size, S0).unwrap();
            a.free(p).unwrap();
            let warm = dev.counters();
            let mut pairs = 0u64;
            g.bench_with_input(BenchmarkId::new(name, label), &size, |b, &size| {
                b.iter(|| {
                    let p = a.malloc(black_box(size), S0).unwrap();
                    a.free(black_box(p)).unwrap();
                    pairs += 1;
                })
            });
            let after = dev.counters();
            assert_eq!(
                (after.allocs, after.vmm_creates, after.vmm_maps),
                (warm.allocs, warm.vmm_creates, warm.vmm_maps),
                "the pair must stay on the cached path"
            );
            eprintln!(
                "cached_pair/{name}/{label}: per 1,000 pairs {} events recorded, {} queried",
                (after.events_recorded - warm.events_recorded) * 1000 / pairs.max(1),
                (after.event_queries - warm.event_queries) * 1000 / pairs.max(1),
            );
        }
    }
    g.finish();
}

struct Slots {
    alloc: CachingAllocator<SimulatedDevice>,
    slots: Vec<Option<DevicePtr>>,
    rng: XorShift64,
}

impl Slots {
    fn new(config: Config) -> Self {
        Slots {
            alloc: CachingAllocator::new(SimulatedDevice::unlimited(), config),
            slots: vec![None; SLOTS],
            rng: XorShift64::new(0x2545_f491_4f6c_dd1d),
        }
    }

    #[inline]
    fn op(&mut self) {
        let r = self.rng.next();
        let slot = &mut self.slots[(r >> 32) as usize % SLOTS];
        match slot.take() {
            Some(p) => self.alloc.free(p).unwrap(),
            None => *slot = Some(self.alloc.malloc(size(&mut self.rng), S0).unwrap()),
        }
    }
}

fn random_256_slots(c: &mut Criterion) {
    let mut g = c.benchmark_group("random_256_slots");
    for (name, config) in configs() {
        let mut s = Slots::new(config);
        for _ in 0..200_000 {
            s.op();
        }
        let warm = s.alloc.device().counters();
        g.bench_function(name, |b| b.iter(|| s.op()));
        let after = s.alloc.device().counters();
        eprintln!(
            "random_256_slots/{name}: {} device allocs and {} frees during measurement, reserved {} MiB",
            after.allocs - warm.allocs,
            after.frees - warm.frees,
            s.alloc.usage().reserved >> 20
        );
    }
    g.finish();
}

fn cold_growth(c: &mut Criterion) {
    let mut g = c.benchmark_group("cold_growth");
    g.sample_size(10);
    let cases = [
        ("expandable", "1GiB", 1u64 << 30),
        ("expandable", "16GiB", 16 << 30),
        ("expandable-2MiB-pages", "16GiB", 16 << 30),
    ];
    for (name, label, size) in cases {
        let config = match name {
            "expandable" => Config::expandable(),
            _ => Config::parse("expandable,expandable_page_mb:2").expect("valid"),
        };
        let a = CachingAllocator::new(SimulatedDevice::unlimited(), config);
        g.bench_with_input(BenchmarkId::new(name, label), &size, |b, &size| {
            b.iter(|| {
                let p = a.malloc(black_box(size), S0).unwrap();
                a.free(p).unwrap();
                a.empty_cache().unwrap();
            })
        });
        eprintln!(
            "cold_growth/{name}/{label}: {} pages created",
            a.stats().num_page_create
        );
    }
    g.finish();
}

criterion_group!(benches, cached_pair, random_256_slots, cold_growth);
criterion_main!(benches);
