//! GPU test: `empty_cache` is real. After everything is freed (some of it
//! still in use by a second stream), `empty_cache` gives the memory back to
//! the driver: `cuMemGetInfo`'s free bytes return to what they were before.
//! Runs on plain segments (`cuMemFree`) and on expandable segments (pages
//! unmapped, `cuMemRelease`d, virtual ranges freed).
//!
//! Skips (with a printed reason) when there is no CUDA driver or device.

use cachealloc::core::{CachingAllocator, Config, Device};
use cachealloc::cuda::driver::{self, Stream};

mod common;
use common::{fill, gpu_device, serial, XorShift64, MIB};

/// How far the driver's free memory may end from where it started.
const TOLERANCE: u64 = 4 * MIB;

#[test]
fn empty_cache_returns_memory_to_the_driver() {
    empty_cache_with(Config::segments());
}

#[test]
fn empty_cache_returns_memory_to_the_driver_expandable() {
    empty_cache_with(Config::expandable());
}

fn empty_cache_with(config: Config) {
    // One test at a time: each compares the driver's free memory before and after.
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    println!("device: {}; config {}", dev.name(), config.name());
    dev.bind_thread().unwrap();
    let (a, b) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
    // Warm up everything the driver sets up lazily (memset kernels, stream
    // resources, events) so that it is not counted as the allocator's.
    let warm = driver::mem_alloc(64 * MIB).unwrap();
    fill(warm, 64 * MIB, a.id(), 1);
    fill(warm, 64 * MIB, b.id(), 2);
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    // SAFETY: allocated above, both streams idle.
    unsafe { driver::mem_free(warm) }.unwrap();
    if let (true, Ok(g)) = (config.expandable_segments(), dev.vmm_support()) {
        // And the virtual memory API's own lazy set-up (one page, mapped and used).
        let range = dev.vmm_reserve(64 * g).unwrap();
        let page = dev.vmm_create_page(g).unwrap();
        dev.vmm_map(range, page, g).unwrap();
        fill(range, g, a.id(), 3);
        a.synchronize().unwrap();
        dev.vmm_unmap(range, g).unwrap();
        dev.vmm_release_page(page).unwrap();
        dev.vmm_free_range(range, 64 * g).unwrap();
    }
    let expandable = config.expandable_segments();
    let alloc = CachingAllocator::new(dev, config);
    if expandable && !alloc.is_expandable() {
        println!(
            "skipping: no expandable segments here: {:?}",
            alloc.notices()
        );
        return;
    }
    let ev = alloc.device().record_event(b.id()).unwrap();
    alloc.device().wait_event(&ev).unwrap();
    alloc.device().release_event(ev);

    for round in 1..=2 {
        let before = driver::mem_info().unwrap();
        let mut rng = XorShift64::new(0x1234_5678_9ABC_DEF0u64 ^ round);
        let mut next = || rng.next();
        let mut ptrs = Vec::new();
        for i in 0..300u64 {
            // 512 B .. 64 MiB, log-uniform-ish.
            let bytes = (512u64 << (next() % 18)) + (next() % 4096) * 4;
            let s = if i % 2 == 0 { a.id() } else { b.id() };
            let p = alloc.malloc(bytes, s).unwrap();
            fill(p, bytes / 4 * 4, s, i as u32);
            if i % 5 == 0 {
                // Also used by the other stream, with work still queued at free.
                let o = if s == a.id() { b.id() } else { a.id() };
                alloc.record_stream(p, o).unwrap();
                fill(p, bytes / 4 * 4, o, i as u32);
            }
            ptrs.push(p);
        }
        let usage = alloc.usage();
        let during = driver::mem_info().unwrap();
        for p in ptrs {
            alloc.free(p).unwrap();
        }
        let stats = alloc.stats();
        let segments = stats.segment.all().current;
        let released = alloc.empty_cache().unwrap();
        let after = driver::mem_info().unwrap();
        let drift = before.free.abs_diff(after.free);
        println!(
            "round {round}: reserved {} MiB in {segments} segments; driver free {} -> {} -> {} MiB; \
             empty_cache released {} MiB in {} segments; drift {} KiB \
             ({} pages created, {} maps so far)",
            usage.reserved / MIB,
            before.free / MIB,
            during.free / MIB,
            after.free / MIB,
            released.bytes / MIB,
            released.segments,
            drift / 1024,
            stats.num_page_create,
            stats.num_map,
        );
        assert!(
            before.free.saturating_sub(during.free) + TOLERANCE >= usage.reserved,
            "the segments came from the driver"
        );
        assert_eq!(
            released.bytes, usage.reserved,
            "every segment was entirely free"
        );
        assert_eq!(released.segments, segments);
        assert_eq!(alloc.usage().reserved, 0);
        assert!(
            drift <= TOLERANCE,
            "driver free memory did not come back: {} -> {} bytes",
            before.free,
            after.free
        );
    }
    alloc.check_invariants().unwrap();
}
