//! GPU pattern test: a long random alloc/free sequence over many sizes and two
//! streams; every live allocation is filled with its own 32-bit pattern
//! (`cuMemsetD32Async`) and all live allocations are read back at intervals.
//! Zero mismatches means no two live allocations overlap and no memory was
//! handed out while a stream could still write to it.
//!
//! It runs twice: on plain segments (`Config::segments()`) and on expandable
//! segments (`Config::expandable()`, CUDA virtual memory API), where pages are
//! also unmapped and re-mapped elsewhere during the run, with and without
//! shadow mappings.
//!
//! Skips (with a printed reason) when there is no CUDA driver or device.

use cachealloc::core::{AllocError, CachingAllocator, Config, DevicePtr, MemoryCap, StreamId};
use cachealloc::cuda::driver::{self, Stream};
use std::collections::BTreeMap;

mod common;
use common::{gpu_device, XorShift64};

struct Live {
    ptr: DevicePtr,
    bytes: u64,
    pattern: u32,
    stream: StreamId,
}

#[test]
fn pattern_two_streams() {
    pattern_two_streams_with(Config::segments());
}

#[test]
fn pattern_two_streams_expandable() {
    pattern_two_streams_with(Config::expandable());
}

/// Expandable without shadows: a page that moves is unmapped where it was.
#[test]
fn pattern_two_streams_expandable_no_shadows() {
    pattern_two_streams_with(Config::parse("expandable,expandable_shadows:false").unwrap());
}

/// Expandable with 2 MiB pages, so that pages move between the streams
/// often: a stream taking pages another stream may still use is made to wait
/// for that stream's work on the device (the read-backs catch a page written
/// by both streams at once).
#[test]
fn pattern_two_streams_expandable_cross_stream() {
    pattern_two_streams_with(Config::parse("expandable,expandable_page_mb:2").unwrap());
}

/// The same with those waits on the host (`expandable_cross_stream:false`).
#[test]
fn pattern_two_streams_expandable_host_waits() {
    pattern_two_streams_with(
        Config::parse("expandable,expandable_page_mb:2,expandable_cross_stream:false").unwrap(),
    );
}

/// Every small request from slabs (chunks of one size class per segment).
#[test]
fn pattern_two_streams_slabs() {
    pattern_two_streams_with(Config::parse("segments,slab_max_kb:1024").unwrap());
}

/// Expandable segments under a cap the workload keeps running into: every
/// allocation that fails frees a random live block and goes on, so the
/// rungs before out of memory (pinned pages swapped, pages shared by
/// granules whose live bytes do not meet) run again and again between the
/// pattern checks.
#[test]
fn pattern_two_streams_expandable_capped() {
    let config = Config::expandable()
        .into_builder()
        .memory_cap(Some(MemoryCap::Bytes(160 << 20)))
        .build()
        .unwrap();
    pattern_two_streams_with(config);
}

fn pattern_two_streams_with(config: Config) {
    let Some(dev) = gpu_device() else { return };
    println!("device: {}; config {}", dev.name(), config.name());
    dev.bind_thread().unwrap();
    let streams = [Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap()];
    let ids = [streams[0].id(), streams[1].id()];
    let expandable = config.expandable_segments();
    let config_capped = config.memory_cap().is_some();
    let alloc = CachingAllocator::new(dev, config);
    if expandable && !alloc.is_expandable() {
        println!(
            "skipping: no expandable segments here: {:?}",
            alloc.notices()
        );
        return;
    }

    const OPS: usize = 20_000;
    const CHECK_EVERY: usize = 1_000;
    const MAX_LIVE: usize = 400;
    let mut rng = XorShift64::new(0x5EED_CAFE);
    let mut live: Vec<Live> = Vec::new();
    // Host-side view of the live ranges: start -> end, to catch overlaps at once.
    let mut ranges: BTreeMap<u64, u64> = BTreeMap::new();
    let mut next_pattern: u32 = 0x1000_0001;
    let (mut checks, mut mismatches, mut verified_bytes) = (0u64, 0u64, 0u64);
    let (mut allocs, mut frees, mut cross) = (0u64, 0u64, 0u64);
    let capped = config_capped;
    let mut ooms = 0u64;

    let check_all = |live: &[Live], mismatches: &mut u64, verified: &mut u64| {
        for s in &streams {
            s.synchronize().unwrap();
        }
        for l in live {
            let words = (l.bytes / 4) as usize;
            // SAFETY: a live allocation of at least 4·words bytes; the streams are idle.
            let got = unsafe { driver::read_u32(l.ptr, words, l.stream) }.unwrap();
            let bad = got.iter().filter(|&&w| w != l.pattern).count() as u64;
            if bad > 0 {
                eprintln!(
                    "MISMATCH: {} of {} words at {} (pattern {:#x})",
                    bad, words, l.ptr, l.pattern
                );
            }
            *mismatches += bad;
            *verified += l.bytes;
        }
    };

    for op in 1..=OPS {
        let grow = live.len() < 8 || (live.len() < MAX_LIVE && rng.below(100) < 55);
        if grow {
            let bytes = rng.log_uniform(4, 8 << 20) / 4 * 4;
            let si = rng.below(2) as usize;
            let ptr = match alloc.malloc(bytes, ids[si]) {
                Ok(ptr) => ptr,
                Err(AllocError::OutOfMemory(_)) if capped && !live.is_empty() => {
                    // Under the cap: make room and go on.
                    let l = live.swap_remove(rng.below(live.len() as u64) as usize);
                    ranges.remove(&l.ptr.0);
                    alloc.free(l.ptr).expect("free");
                    frees += 1;
                    ooms += 1;
                    continue;
                }
                Err(e) => panic!("malloc({bytes}): {e}"),
            };
            // No overlap with any live range.
            if let Some((&s, &e)) = ranges.range(..=ptr.0).next_back() {
                assert!(e <= ptr.0, "{ptr} inside live [{s:#x}, {e:#x})");
            }
            if let Some((&s, _)) = ranges.range(ptr.0..).next() {
                assert!(ptr.0 + bytes <= s, "{ptr}+{bytes} runs into live {s:#x}");
            }
            ranges.insert(ptr.0, ptr.0 + bytes);
            let pattern = next_pattern;
            next_pattern = next_pattern.wrapping_mul(2_654_435_761).wrapping_add(7) | 1;
            // SAFETY: freshly allocated, owned, used by its stream only.
            unsafe { driver::memset_d32_async(ptr, pattern, (bytes / 4) as usize, ids[si]) }
                .unwrap();
            if rng.below(10) == 0 {
                // Used by the other stream too: the same pattern written there
                // (benign race: both writes store the same value).
                let other = ids[1 - si];
                alloc.record_stream(ptr, other).unwrap();
                // SAFETY: as above; the allocator now knows of the second stream.
                unsafe { driver::memset_d32_async(ptr, pattern, (bytes / 4) as usize, other) }
                    .unwrap();
                cross += 1;
            }
            live.push(Live {
                ptr,
                bytes,
                pattern,
                stream: ids[si],
            });
            allocs += 1;
        } else {
            let l = live.swap_remove(rng.below(live.len() as u64) as usize);
            if rng.below(4) == 0 {
                // Work still queued when it is freed: the next user of this
                // memory on the same stream is ordered after it.
                // SAFETY: still owned until the free below.
                unsafe {
                    driver::memset_d32_async(l.ptr, l.pattern, (l.bytes / 4) as usize, l.stream)
                }
                .unwrap();
            }
            ranges.remove(&l.ptr.0);
            alloc.free(l.ptr).expect("free");
            frees += 1;
        }
        if op % CHECK_EVERY == 0 {
            check_all(&live, &mut mismatches, &mut verified_bytes);
            alloc.check_invariants().expect("invariants");
            checks += 1;
        }
    }
    check_all(&live, &mut mismatches, &mut verified_bytes);
    checks += 1;
    let stats = alloc.stats();
    for l in live.drain(..) {
        alloc.free(l.ptr).unwrap();
    }
    let released = alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    if capped {
        println!(
            "capped: {ooms} allocations out of memory, {} pages swapped, {} pages shared, peak reserved {} MiB",
            stats.num_pages_rebacked,
            stats.num_pages_shared,
            stats.reserved_bytes.all().peak >> 20
        );
        assert!(
            ooms > 0 && stats.num_pages_shared > 0,
            "the cap was reached and pages shared"
        );
    }
    println!(
        "pattern: {OPS} ops ({allocs} allocs, {frees} frees, {cross} used by both streams), \
         {checks} checks, {:.2} GiB verified, {mismatches} mismatching words; \
         {} device allocs, {} pages created, {} maps, {} unmaps during the run \
         ({} with empty_cache), {} device syncs, {} marker waits, {} stream waits on the device, \
         {} pages taken back; {} segments released at the end, {} events pooled",
        verified_bytes as f64 / (1u64 << 30) as f64,
        stats.num_device_alloc,
        stats.num_page_create,
        stats.num_map,
        stats.num_unmap,
        alloc.stats().num_unmap,
        stats.num_sync_all_streams,
        stats.num_marker_waits,
        stats.num_stream_waits,
        stats.num_pages_revived,
        released.segments,
        alloc.device().pooled_events(),
    );
    assert_eq!(
        mismatches, 0,
        "live allocations overlapped or were reused while in use"
    );
    assert_eq!(alloc.usage().reserved, 0, "empty_cache released everything");
    assert!(cross > 0 && checks >= 20);
    if expandable {
        assert_eq!(stats.num_device_alloc, 0, "no plain segment");
        assert!(stats.num_map > 0, "pages were mapped");
    }
}
