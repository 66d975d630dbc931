//! GPU tests of the out-of-memory ladder on a real device:
//! - with a memory cap: a request that fits only after the cache is flushed
//!   succeeds (the retry is counted), one that can never fit under the cap
//!   returns the explaining error, and the allocator keeps working;
//! - with the device itself filled by other (raw `cuMemAlloc`) allocations:
//!   the same, against the driver's real out-of-memory;
//! - with `segments`' last rung (`oom_other_kinds`): under a cap that leaves
//!   no room for a segment, a large request and then a small one (of another
//!   kind) are carved from a large segment's free tail, and the block beside
//!   them keeps its data.
//!
//! Both use the `pytorch` policy, whose ladder goes straight from a failed
//! segment to the full flush (the default policy may release single cached
//! segments first, which is not counted as a retry).
//!
//! Skips (with a printed reason) when there is no CUDA driver or device.

use cachealloc::core::{AllocError, CachingAllocator, Config, DevicePtr, MemoryCap, StreamId};
use cachealloc::cuda::driver::{self, Stream};

mod common;
// One test at a time (`serial`): the second fills the whole device.
use common::{gpu_device, mismatches, serial, GIB, MIB};

/// Fills `bytes` at `ptr` with `v` on `s` and checks a prefix and suffix of up to 4 MiB.
fn write_and_check(ptr: DevicePtr, bytes: u64, s: StreamId, v: u32) {
    let words = (bytes / 4) as usize;
    // SAFETY: the caller owns [ptr, ptr+bytes), used by `s` only.
    unsafe { driver::memset_d32_async(ptr, v, words, s) }.unwrap();
    let probe = words.min((4 * MIB / 4) as usize);
    for start in [0, words - probe] {
        let at = DevicePtr(ptr.0 + 4 * start as u64);
        // SAFETY: inside the allocation.
        let got = unsafe { driver::read_u32(at, probe, s) }.unwrap();
        assert!(got.iter().all(|&w| w == v), "memory at {at} not writable");
    }
}

#[test]
fn ladder_under_a_memory_cap() {
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    println!("device: {}", dev.name());
    dev.bind_thread().unwrap();
    let s = Stream::new(&dev).unwrap();
    let cap = 256 * MIB;
    let config = Config::pytorch()
        .into_builder()
        .memory_cap(Some(MemoryCap::Bytes(cap)))
        .build()
        .unwrap();
    let alloc = CachingAllocator::new(dev, config);
    assert_eq!(alloc.memory_cap(), Some(cap));

    // Two cached 100 MiB segments: 200 MiB reserved, nothing allocated.
    let p1 = alloc.malloc(100 * MIB, s.id()).unwrap();
    let p2 = alloc.malloc(100 * MIB, s.id()).unwrap();
    alloc.free(p1).unwrap();
    alloc.free(p2).unwrap();
    assert_eq!(alloc.usage().reserved, 200 * MIB);

    // 200 MiB: no cached block fits, a new segment would pass the cap, so the
    // cache is flushed and the request retried.
    let q = alloc
        .malloc(200 * MIB, s.id())
        .expect("fits after the flush");
    let st = alloc.stats();
    println!(
        "cap: 200 MiB after flush: retries {}, device allocs {}, device frees {}",
        st.num_alloc_retries, st.num_device_alloc, st.num_device_free
    );
    assert_eq!(st.num_alloc_retries, 1);
    assert_eq!(st.num_device_free, 2);
    assert_eq!(alloc.usage().reserved, 200 * MIB);
    write_and_check(q, 200 * MIB, s.id(), 0xC0FF_EE00);

    // 300 MiB can never fit under a 256 MiB cap.
    let err = alloc.malloc(300 * MIB, s.id()).unwrap_err();
    let text = err.to_string();
    println!("cap: 300 MiB -> {text}");
    let AllocError::OutOfMemory(report) = &err else {
        panic!("expected OutOfMemory, got {err:?}");
    };
    assert_eq!(report.requested, 300 * MIB);
    assert_eq!(report.cap, Some(cap));
    assert_eq!(report.allocated, 200 * MIB);
    assert!(report.device_total > 0 && report.device_free > 0);
    assert!(
        text.contains("out of memory") && text.contains("capped"),
        "{text}"
    );
    assert_eq!(alloc.stats().num_ooms, 1);

    // Still works: q intact, new allocations fine.
    write_and_check(q, 200 * MIB, s.id(), 0x0DD_BA11);
    alloc.free(q).unwrap();
    let r = alloc.malloc(MIB, s.id()).unwrap();
    write_and_check(r, MIB, s.id(), 5);
    alloc.free(r).unwrap();
    alloc.check_invariants().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.usage().reserved, 0);
    println!("cap: the allocator kept working after the OOM");
}

#[test]
fn other_kinds_under_a_memory_cap() {
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    dev.bind_thread().unwrap();
    let s = Stream::new(&dev).unwrap();
    // One large segment takes the whole cap (`segments` has no huge pool):
    // no segment of any kind fits beside it.
    let config = Config::segments()
        .into_builder()
        .memory_cap(Some(MemoryCap::Bytes(300 * MIB)))
        .build()
        .unwrap();
    assert!(config.oom_other_kinds());
    let alloc = CachingAllocator::new(dev, config);
    let h = alloc.malloc(300 * MIB, s.id()).unwrap();
    alloc.free(h).unwrap();
    // A 260 MiB block in that segment leaves 40 MiB of free tail.
    let big = alloc.malloc(260 * MIB, s.id()).unwrap();
    assert_eq!(big, h);
    write_and_check(big, 260 * MIB, s.id(), 0xB16B_00B5);
    let large = alloc
        .malloc(30 * MIB, s.id())
        .expect("served from the tail (its own kind)");
    assert!(large.0 >= big.0 + 260 * MIB && large.0 + 30 * MIB <= big.0 + 300 * MIB);
    let small = alloc
        .malloc(4096, s.id())
        .expect("served from the large segment's tail (another kind)");
    assert!(small.0 >= large.0 + 30 * MIB && small.0 < big.0 + 300 * MIB);
    write_and_check(large, 30 * MIB, s.id(), 0x1A26_E000);
    write_and_check(small, 4096, s.id(), 0x5EA1_1000);
    let st = alloc.stats();
    println!(
        "other kinds: {} requests from the large tail, reserved {} MiB",
        st.num_other_kind_fits,
        alloc.usage().reserved / MIB
    );
    // Only the small request crossed kinds.
    assert_eq!((st.num_other_kind_fits, st.num_ooms), (1, 0));
    assert_eq!(alloc.usage().reserved, 300 * MIB);
    // The first block's data, up to the tail the others took, is intact.
    let end = DevicePtr(big.0 + 256 * MIB);
    assert_eq!(
        mismatches(end, 4 * MIB, s.id(), 0xB16B_00B5),
        0,
        "first block overwritten"
    );
    for p in [small, large, big] {
        alloc.free(p).unwrap();
    }
    alloc.check_invariants().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.usage().reserved, 0);
}

/// Raw allocations that leave about `leave` bytes of the device free.
fn fill_device(leave: u64) -> Vec<(DevicePtr, u64)> {
    let mut held = Vec::new();
    let mut chunk = u64::MAX;
    loop {
        let free = driver::mem_info().unwrap().free;
        if free <= leave + 64 * MIB {
            break;
        }
        let want = ((free - leave) / (2 * MIB) * (2 * MIB)).min(chunk);
        if want < 64 * MIB {
            break;
        }
        match driver::mem_alloc(want) {
            Ok(p) => held.push((p, want)),
            Err(cachealloc::core::DeviceError::OutOfMemory) => chunk = want / 2,
            Err(e) => panic!("filling the device: {e}"),
        }
    }
    held
}

#[test]
fn ladder_on_a_full_device() {
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    println!("device: {}", dev.name());
    dev.bind_thread().unwrap();
    let s = Stream::new(&dev).unwrap();
    // Warm the memset kernels before the device is full.
    let w = driver::mem_alloc(4 * MIB).unwrap();
    write_and_check(w, 4 * MIB, s.id(), 1);
    // SAFETY: allocated above; the stream is idle (write_and_check synchronises).
    unsafe { driver::mem_free(w) }.unwrap();

    let alloc = CachingAllocator::new(dev, Config::pytorch());
    // Two cached 1 GiB segments.
    let a1 = alloc.malloc(GIB, s.id()).unwrap();
    let a2 = alloc.malloc(GIB, s.id()).unwrap();
    alloc.free(a1).unwrap();
    alloc.free(a2).unwrap();

    // Another user takes all but ~512 MiB of the device.
    let held = fill_device(512 * MIB);
    let info = driver::mem_info().unwrap();
    let held_bytes: u64 = held.iter().map(|h| h.1).sum();
    println!(
        "full device: {} raw allocations hold {:.1} GiB; driver free {} MiB of {:.1} GiB",
        held.len(),
        held_bytes as f64 / GIB as f64,
        info.free / MIB,
        info.total as f64 / GIB as f64
    );
    assert!(
        info.free < 2 * GIB,
        "the device is not full enough for the test"
    );

    // 2 GiB: neither cached block fits, the driver has < 2 GiB, so the cache
    // is flushed (2 GiB back to the driver) and the request retried.
    let q = alloc.malloc(2 * GIB, s.id()).expect("fits after the flush");
    let st = alloc.stats();
    println!(
        "full device: 2 GiB after flush: retries {}, device frees {}",
        st.num_alloc_retries, st.num_device_free
    );
    assert_eq!(st.num_alloc_retries, 1);
    assert_eq!(st.num_device_free, 2);
    write_and_check(q, 2 * GIB, s.id(), 0xFACE_B00C);

    // The whole device can never fit.
    let err = alloc.malloc(info.total, s.id()).unwrap_err();
    let text = err.to_string();
    println!("full device: {} GiB -> {text}", info.total / GIB);
    let AllocError::OutOfMemory(report) = &err else {
        panic!("expected OutOfMemory, got {err:?}");
    };
    assert_eq!(report.requested, info.total);
    assert_eq!(report.device_total, info.total);
    assert!(report.device_free < 2 * GIB);
    assert_eq!(report.reserved, 2 * GIB);
    assert!(
        text.contains("out of memory") && text.contains("free"),
        "{text}"
    );
    assert_eq!(alloc.stats().num_ooms, 1);

    // Keeps working: q intact; a smaller request is carved from the cache.
    write_and_check(q, 2 * GIB, s.id(), 0x1234_5678);
    alloc.free(q).unwrap();
    let r = alloc.malloc(256 * MIB, s.id()).unwrap();
    write_and_check(r, 256 * MIB, s.id(), 9);
    assert_eq!(
        alloc.stats().num_device_alloc,
        3,
        "served from the cached 2 GiB"
    );
    alloc.free(r).unwrap();

    for (p, _) in held {
        // SAFETY: raw allocations made above, freed once, unused by any stream.
        unsafe { driver::mem_free(p) }.unwrap();
    }
    alloc.check_invariants().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.usage().reserved, 0);
    println!("full device: the allocator kept working after the OOM");
}
