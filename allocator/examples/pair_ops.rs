use cachealloc_core::{CachingAllocator, Config, SimulatedDevice, StreamId};
use std::hint::black_box;
use std::time::Instant;
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let size: u64 = args.first().map_or(512, |s| s.parse().unwrap());
    let n: u64 = args.get(1).map_or(10_000_000, |s| s.parse().unwrap());
    let a = CachingAllocator::new(
        SimulatedDevice::unlimited(),
        Config::parse(args.get(2).map_or("default", |s| s.as_str())).unwrap(),
    );
    for _ in 0..1000 {
        let p = a.malloc(size, StreamId(0)).unwrap();
        a.free(p).unwrap();
    }
    let t = Instant::now();
    for _ in 0..n {
        let p = a.malloc(black_box(size), StreamId(0)).unwrap();
        a.free(black_box(p)).unwrap();
    }
    println!("{:.1} ns/pair", t.elapsed().as_nanos() as f64 / n as f64);
}
