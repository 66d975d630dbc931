//! Costs of the CUDA virtual memory API calls behind expandable segments, on
//! device 0, through `CudaDevice` (so each figure includes what the allocator
//! pays around the driver call: one `cuCtxGetCurrent`):
//! - `cuMemCreate` and `cuMemRelease` per physical page;
//! - `cuMemMap` + `cuMemSetAccess` per page, for pages mapped the first time
//!   and for pages unmapped and mapped again (the allocator's page pool);
//! - `cuMemUnmap` per page, of pages the GPU has written;
//!
//! each for pages of 2, 4, 8 and 20 MiB; then what shareable pages (CUDA
//! IPC: created with a POSIX file descriptor handle type, as the allocator
//! creates them where the device allows it) cost against plain ones, create,
//! map, unmap and release in alternating rounds, and the export of one as a
//! file descriptor; then `cuCtxSynchronize` on an idle
//! device, `cuEventRecord`, and `cuEventQuery` and `cuEventSynchronize` of a
//! completed event, and a cachealloc alloc + free pair on the cache-hit path
//! with the `default` (plain segments) and the `expandable` configuration.
//!
//! ```text
//! cargo bench --features cuda --bench gpu_vmm -- [--json FILE] [--quick]
//! ```
//! Plain harness (no criterion): prints one line per figure, then a table.
//! Per-page figures are the best of 3 rounds over a batch of pages (256 MiB
//! to 1.25 GiB of device memory per batch).

use cachealloc::cuda::driver::{self, Stream};
use cachealloc::cuda::CudaDevice;
use cachealloc::{CachingAllocator, Config, Device, DevicePtr, StreamId};
use std::hint::black_box;
use std::time::Instant;

const MIB: u64 = 1 << 20;
const PAGE_MIB: [u64; 4] = [2, 4, 8, 20];
const PAIR_SIZES: [u64; 4] = [512, 1 << 20, 16 << 20, 256 << 20];

struct Results {
    rows: Vec<(String, f64)>,
}

impl Results {
    fn rec(&mut self, key: String, v: f64) {
        println!("{key:55} {v:12.2}");
        self.rows.push((key, v));
    }
    fn get(&self, key: &str) -> Option<f64> {
        self.rows.iter().find(|(k, _)| k == key).map(|r| r.1)
    }
}

fn us_per(t0: Instant, n: u64) -> f64 {
    t0.elapsed().as_nanos() as f64 / n as f64 / 1e3
}

/// Per-page costs (µs) of one round over `n` pages of `page` bytes:
/// (create, map fresh, unmap, map again, unmap again, release).
fn page_round(dev: &CudaDevice, s: &Stream, page: u64, n: u64) -> [f64; 6] {
    let range = dev.vmm_reserve(n * page).unwrap();
    let at = |i: u64| DevicePtr(range.0 + i * page);

    let t0 = Instant::now();
    let handles: Vec<u64> = (0..n).map(|_| dev.vmm_create_page(page).unwrap()).collect();
    let create = us_per(t0, n);

    let map_unmap = || {
        let t0 = Instant::now();
        for (i, &h) in handles.iter().enumerate() {
            dev.vmm_map(at(i as u64), h, page).unwrap();
        }
        let map = us_per(t0, n);
        // The GPU writes every page before it is unmapped, as in real use.
        // SAFETY: the whole range is mapped and used by stream `s` only.
        unsafe { driver::memset_d32_async(range, 7, (n * page / 4) as usize, s.id()) }.unwrap();
        s.synchronize().unwrap();
        let t0 = Instant::now();
        for i in 0..n {
            dev.vmm_unmap(at(i), page).unwrap();
        }
        (map, us_per(t0, n))
    };
    let (map_fresh, unmap_fresh) = map_unmap();
    let (map_again, unmap_again) = map_unmap();

    let t0 = Instant::now();
    for h in handles {
        dev.vmm_release_page(h).unwrap();
    }
    let release = us_per(t0, n);
    dev.vmm_free_range(range, n * page).unwrap();
    [
        create,
        map_fresh,
        unmap_fresh,
        map_again,
        unmap_again,
        release,
    ]
}

/// Per-page costs (µs) of `n` pages of `page` bytes created plain or
/// `shareable` straight through the driver: (create, map, unmap, release).
fn shareable_round(dev: &CudaDevice, page: u64, n: u64, shareable: bool) -> [f64; 4] {
    let ord = dev.ordinal();
    let range = dev.vmm_reserve(n * page).unwrap();
    let at = |i: u64| DevicePtr(range.0 + i * page);
    let t0 = Instant::now();
    let handles: Vec<u64> = (0..n)
        .map(|_| driver::mem_create_with(page, ord, shareable).unwrap())
        .collect();
    let create = us_per(t0, n);
    let t0 = Instant::now();
    for (i, &h) in handles.iter().enumerate() {
        driver::mem_map(at(i as u64), h, page, ord).unwrap();
    }
    let map = us_per(t0, n);
    let t0 = Instant::now();
    for i in 0..n {
        // SAFETY: mapped just above; no work was queued on it.
        unsafe { driver::mem_unmap(at(i), page) }.unwrap();
    }
    let unmap = us_per(t0, n);
    let t0 = Instant::now();
    for h in handles {
        // SAFETY: created above, unmapped, released once.
        unsafe { driver::mem_release(h) }.unwrap();
    }
    let release = us_per(t0, n);
    dev.vmm_free_range(range, n * page).unwrap();
    [create, map, unmap, release]
}

fn pair_ns(alloc: &CachingAllocator<CudaDevice>, size: u64, iters: u64) -> f64 {
    let s = StreamId(0);
    for _ in 0..1000 {
        alloc.free(alloc.malloc(size, s).unwrap()).unwrap();
    }
    (0..3)
        .map(|_| {
            let t0 = Instant::now();
            for _ in 0..iters {
                let p = alloc.malloc(black_box(size), s).unwrap();
                alloc.free(black_box(p)).unwrap();
            }
            t0.elapsed().as_nanos() as f64 / iters as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let mut json = None;
    let mut quick = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--json" => json = args.next(),
            "--quick" => quick = true,
            "--bench" => {}
            other => {
                eprintln!("usage: gpu_vmm [--json FILE] [--quick] (unknown argument {other})");
                std::process::exit(2);
            }
        }
    }
    let count = match driver::device_count() {
        Ok(n) => n,
        Err(e) => {
            println!("skipping: no usable CUDA driver ({e})");
            return;
        }
    };
    if count == 0 {
        println!("skipping: the CUDA driver sees no device");
        return;
    }
    let dev = CudaDevice::new(0).unwrap();
    dev.bind_thread().unwrap();
    let g = match dev.vmm_support() {
        Ok(g) => g,
        Err(why) => {
            println!("skipping: no virtual memory API on {} ({why})", dev.name());
            return;
        }
    };
    let g_rec = driver::allocation_granularity(0, true).unwrap();
    println!(
        "device: {} (driver CUDA {}); granularity: minimum {} KiB, recommended {} KiB",
        dev.name(),
        driver::driver_version().unwrap_or(0),
        g / 1024,
        g_rec / 1024
    );
    let s = Stream::new(&dev).unwrap();
    let mut r = Results { rows: Vec::new() };

    // Warm up the driver's lazy set-up of the VMM path and the memset kernel.
    page_round(&dev, &s, g, 4);

    const OPS: [&str; 6] = [
        "cuMemCreate",
        "cuMemMap+cuMemSetAccess (fresh page)",
        "cuMemUnmap (after first map)",
        "cuMemMap+cuMemSetAccess (pooled page)",
        "cuMemUnmap",
        "cuMemRelease",
    ];
    for mib in PAGE_MIB {
        let page = mib * MIB;
        // 512 MiB of pages (at least 16 pages), 128 MiB with --quick.
        let bytes = if quick { 128 * MIB } else { 512 * MIB };
        let n = (bytes / page).max(16);
        let mut best = [f64::INFINITY; 6];
        for _ in 0..3 {
            for (b, v) in best.iter_mut().zip(page_round(&dev, &s, page, n)) {
                *b = b.min(v);
            }
        }
        for (op, v) in OPS.iter().zip(best) {
            r.rec(format!("{op}, {mib} MiB page (us)"), v);
        }
    }

    // Shareable pages against plain ones (alternating rounds, best of 3),
    // and exporting one as a file descriptor.
    const SHARE_OPS: [&str; 4] = ["create", "map", "unmap", "release"];
    match dev.pages_shareable() {
        Err(why) => println!("pages are not shareable on this device ({why}): no comparison"),
        Ok(()) => {
            for mib in [2u64, 8] {
                let page = mib * MIB;
                let n = (if quick { 128 } else { 512 } * MIB / page).max(16);
                let mut best = [[f64::INFINITY; 4]; 2];
                for _ in 0..3 {
                    for (k, shareable) in [false, true].into_iter().enumerate() {
                        let got = shareable_round(&dev, page, n, shareable);
                        for (b, v) in best[k].iter_mut().zip(got) {
                            *b = b.min(v);
                        }
                    }
                }
                for (i, op) in SHARE_OPS.iter().enumerate() {
                    r.rec(format!("plain page {op}, {mib} MiB (us)"), best[0][i]);
                    r.rec(format!("shareable page {op}, {mib} MiB (us)"), best[1][i]);
                }
            }
            let n = if quick { 64 } else { 256 };
            let pages: Vec<u64> = (0..n).map(|_| dev.vmm_create_page(g).unwrap()).collect();
            let t0 = Instant::now();
            for &p in &pages {
                black_box(dev.export_page_fd(p).unwrap());
            }
            r.rec(
                "export a page as a file descriptor (us)".into(),
                us_per(t0, n),
            );
            for p in pages {
                dev.vmm_release_page(p).unwrap();
            }
            assert_eq!(
                dev.exported_pages(),
                0,
                "released pages close their descriptors"
            );
        }
    }

    // cuCtxSynchronize with nothing queued.
    let n = if quick { 2000 } else { 20000 };
    dev.synchronize().unwrap();
    let best = (0..3)
        .map(|_| {
            let t0 = Instant::now();
            for _ in 0..n {
                dev.synchronize().unwrap();
            }
            us_per(t0, n)
        })
        .fold(f64::INFINITY, f64::min);
    r.rec("cuCtxSynchronize, idle device (us)".into(), best);

    // Events, as the allocator uses them (pooled by `CudaDevice`): a marker
    // recorded as a block is freed, polled before its pages move, waited for
    // when a page must move before its stream got there.
    let n = if quick { 2000 } else { 20000 };
    let mut ev_best = [f64::INFINITY; 3];
    for _ in 0..3 {
        let t0 = Instant::now();
        let events: Vec<_> = (0..n).map(|_| dev.record_event(s.id()).unwrap()).collect();
        let record = us_per(t0, n);
        s.synchronize().unwrap();
        let t0 = Instant::now();
        for e in &events {
            assert!(black_box(dev.event_completed(e).unwrap()));
        }
        let query = us_per(t0, n);
        let t0 = Instant::now();
        for e in &events {
            dev.wait_event(e).unwrap();
        }
        let wait = us_per(t0, n);
        events.into_iter().for_each(|e| dev.release_event(e));
        for (b, v) in ev_best.iter_mut().zip([record, query, wait]) {
            *b = b.min(v);
        }
    }
    r.rec("cuEventRecord (us)".into(), ev_best[0]);
    r.rec("cuEventQuery, completed (us)".into(), ev_best[1]);
    r.rec("cuEventSynchronize, completed (us)".into(), ev_best[2]);

    // Cache-hit alloc + free pairs, plain and expandable.
    let iters = if quick { 20_000 } else { 200_000 };
    for config in [Config::segments(), Config::default()] {
        let name = config.name().to_string();
        let alloc = CachingAllocator::new(CudaDevice::new(0).unwrap(), config);
        if name == "expandable" {
            assert!(alloc.is_expandable(), "{:?}", alloc.notices());
        }
        for size in PAIR_SIZES {
            let ns = pair_ns(&alloc, size, iters);
            r.rec(
                format!("cachealloc {name} pair {} (ns)", fmt_size(size)),
                ns,
            );
        }
        let st = alloc.stats();
        println!(
            "  ({name}: {} device allocs, {} pages created, {} maps in all: none on the hit path)",
            st.num_device_alloc, st.num_page_create, st.num_map
        );
        alloc.empty_cache().unwrap();
    }

    // The table.
    println!();
    println!("VMM costs on {} (µs per call, best of 3)", dev.name());
    println!();
    print!("| operation |");
    for mib in PAGE_MIB {
        print!(" {mib} MiB page |");
    }
    println!();
    println!("|---|{}", "---:|".repeat(PAGE_MIB.len()));
    for op in OPS {
        print!("| {op} |");
        for mib in PAGE_MIB {
            let v = r.get(&format!("{op}, {mib} MiB page (us)")).unwrap();
            print!(" {v:.1} |");
        }
        println!();
    }
    println!();
    if r.get("shareable page create, 2 MiB (us)").is_some() {
        println!("| shareable page (CUDA IPC) vs plain, µs per page | 2 MiB plain | 2 MiB shareable | 8 MiB plain | 8 MiB shareable |");
        println!("|---|---:|---:|---:|---:|");
        for op in SHARE_OPS {
            print!("| {op} |");
            for mib in [2, 8] {
                for kind in ["plain", "shareable"] {
                    let v = r.get(&format!("{kind} page {op}, {mib} MiB (us)")).unwrap();
                    print!(" {v:.1} |");
                }
            }
            println!();
        }
        println!(
            "export of a page as a file descriptor: {:.1} µs",
            r.get("export a page as a file descriptor (us)").unwrap()
        );
        println!();
    }
    println!(
        "cuCtxSynchronize on an idle device: {:.2} µs",
        r.get("cuCtxSynchronize, idle device (us)").unwrap()
    );
    println!();
    println!("| alloc + free pair (ns) | default | expandable |");
    println!("|---|---:|---:|");
    for size in PAIR_SIZES {
        let f = fmt_size(size);
        println!(
            "| {f} | {:.0} | {:.0} |",
            r.get(&format!("cachealloc default pair {f} (ns)")).unwrap(),
            r.get(&format!("cachealloc expandable pair {f} (ns)"))
                .unwrap()
        );
    }

    if let Some(path) = json {
        let mut obj = serde_json::Map::new();
        obj.insert("device".into(), dev.name().into());
        obj.insert("granularity".into(), g.into());
        obj.insert("granularity_recommended".into(), g_rec.into());
        for (k, v) in &r.rows {
            obj.insert(k.clone(), (*v).into());
        }
        std::fs::write(&path, serde_json::to_string_pretty(&obj).unwrap()).unwrap();
        println!("\nwrote {path}");
    }
}

fn fmt_size(b: u64) -> String {
    if b >= MIB {
        format!("{} MiB", b / MIB)
    } else if b >= 1024 {
        format!("{} KiB", b / 1024)
    } else {
        format!("{b} B")
    }
}
