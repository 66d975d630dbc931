//! GPU stream-safety tests: memory used by a second stream is not handed
//! out again before that stream's work completed; `CachedBuffer` copies;
//! pooled events; calls from threads that never made a context current.
//! The cross-stream test and the threads test run on plain segments and on
//! expandable segments (`Config::expandable()`, CUDA virtual memory API).
//!
//! Skips (with a printed reason) when there is no CUDA driver or device.

use cachealloc::core::{CachingAllocator, Config, Device, StreamId};
use cachealloc::cuda::driver::{self, Stream};
use cachealloc::cuda::{self, CachedBuffer, CudaDevice, CudaError};
use std::time::Instant;

mod common;
// The tests of this file run one at a time (`serial`): device-wide calls of
// one (cuMemFree may synchronise the device) would skew the timing of another.
use common::{gpu_device, mismatches, serial, MIB};

/// Queues `n` fills of `bytes` at `ptr` on `stream`, the last with `last`.
fn long_work(ptr: cachealloc::DevicePtr, bytes: u64, stream: StreamId, n: u32, last: u32) {
    for i in 0..n {
        let v = if i + 1 == n { last } else { i };
        // SAFETY: the caller owns [ptr, ptr+bytes) and has told the allocator
        // that `stream` uses it.
        unsafe { driver::memset_d32_async(ptr, v, (bytes / 4) as usize, stream) }.unwrap();
    }
}

/// The allocator under test, or `None` (with a printed reason) where the
/// configuration asks for expandable segments and the device has no VMM API.
fn allocator_with(dev: CudaDevice, config: Config) -> Option<CachingAllocator<CudaDevice>> {
    let expandable = config.expandable_segments();
    let alloc = CachingAllocator::new(dev, config);
    if expandable && !alloc.is_expandable() {
        println!(
            "skipping: no expandable segments here: {:?}",
            alloc.notices()
        );
        return None;
    }
    Some(alloc)
}

#[test]
fn cross_stream_block_not_reused_before_work_completes() {
    cross_stream_with(Config::segments());
}

#[test]
fn cross_stream_block_not_reused_before_work_completes_expandable() {
    cross_stream_with(Config::expandable());
}

/// A stream that takes a hole in another stream's partly used segment
/// (`borrow_holes`) waits on the device for that stream's queued work, so
/// its writes land after the owner's last write there: a small block under
/// `segments`, a block of a 20 MiB medium segment under PyTorch's sizes.
#[test]
fn a_borrowed_hole_waits_for_its_owners_work() {
    let _serial = serial();
    for (config, size) in [
        ("segments,borrow_holes:true", 64 * 1024),
        ("pytorch,borrow_holes:true", 4 * MIB),
    ] {
        borrowed_hole_with(Config::parse(config).unwrap(), size);
    }
}

fn borrowed_hole_with(config: Config, size: u64) {
    let Some(dev) = gpu_device() else { return };
    println!(
        "device: {}; config {}, blocks of {size} bytes",
        dev.name(),
        config.name()
    );
    dev.bind_thread().unwrap();
    let (a, b) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
    let alloc = CachingAllocator::new(dev, config);
    let busy_size = 256 * MIB;
    let busy = alloc.malloc(busy_size, a.id()).unwrap();
    let keep = alloc.malloc(size, a.id()).unwrap();
    let x = alloc.malloc(size, a.id()).unwrap();
    // Stream a: long work on `busy`, then its last write of x; x freed on a
    // (stream-ordered: a's own later work could reuse it at once).
    long_work(busy, busy_size, a.id(), 2000, 1);
    long_work(x, size, a.id(), 1, 0xA0A0_A0A0);
    let a_done = alloc.device().record_event(a.id()).unwrap();
    alloc.free(x).unwrap();

    let borrowed = alloc.stats().num_blocks_borrowed;
    let y = alloc.malloc(size, b.id()).unwrap();
    assert_eq!(
        alloc.stats().num_blocks_borrowed,
        borrowed + 1,
        "stream b took a hole of stream a's segment"
    );
    assert_eq!(y, x, "the hole x left");
    assert!(
        !alloc.device().event_completed(&a_done).unwrap(),
        "stream a finished too early for the test to mean anything"
    );
    // SAFETY: y is ours, on stream b.
    unsafe { driver::memset_d32_async(y, 0xB0B0_B0B0, (size / 4) as usize, b.id()) }.unwrap();
    b.synchronize().unwrap();
    a.synchronize().unwrap();
    alloc.device().release_event(a_done);
    assert_eq!(
        mismatches(y, size, b.id(), 0xB0B0_B0B0),
        0,
        "stream a's last write of x landed after stream b's"
    );
    for p in [y, keep, busy] {
        alloc.free(p).unwrap();
    }
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.stats().num_sync_all_streams, 0);
}

/// A slab's chunk used by a second stream comes back to its slab only
/// after that stream's work on it completes: the chunk is small, so the
/// second stream is kept busy on a large buffer first.
#[test]
fn cross_stream_slab_chunk_not_reused_before_work_completes() {
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    dev.bind_thread().unwrap();
    let (a, b) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
    let alloc = CachingAllocator::new(dev, Config::parse("segments,slab_max_kb:1024").unwrap());
    let (big_size, small) = (256 * MIB, 64 * 1024);
    let big = alloc.malloc(big_size, b.id()).unwrap();
    let x = alloc.malloc(small, a.id()).unwrap();
    // SAFETY: x is ours, used by stream a only so far.
    unsafe { driver::memset_d32_async(x, 0x1111_1111, (small / 4) as usize, a.id()) }.unwrap();
    a.synchronize().unwrap();

    // Stream b: long work on its own buffer, then a write of x; free x on a.
    alloc.record_stream(x, b.id()).unwrap();
    long_work(big, big_size, b.id(), 2000, 1);
    long_work(x, small, b.id(), 1, 0xB0B0_B0B0);
    let b_done = alloc.device().record_event(b.id()).unwrap();
    alloc.free(x).unwrap();

    let y = alloc.malloc(small, a.id()).unwrap();
    let done_at_malloc = alloc.device().event_completed(&b_done).unwrap();
    println!("slab chunk x = {x}, y = {y}; stream b done when y was handed out: {done_at_malloc}");
    assert!(
        y != x || done_at_malloc,
        "the chunk was handed out again while stream b still had work on it"
    );
    assert!(
        !done_at_malloc,
        "stream b finished too early for the test to mean anything"
    );

    // Once b completes, x goes back to its slab and is the next chunk handed out.
    b.synchronize().unwrap();
    alloc.device().release_event(b_done);
    let z = alloc.malloc(small, a.id()).unwrap();
    assert_eq!(z, x, "the freed chunk is reused once its events completed");
    assert_eq!(
        mismatches(z, small, a.id(), 0xB0B0_B0B0),
        0,
        "x was written by someone else"
    );
    for p in [y, z, big] {
        alloc.free(p).unwrap();
    }
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.stats().num_sync_all_streams, 0);
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.usage().reserved, 0);
}

fn cross_stream_with(config: Config) {
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    println!("device: {}; config {}", dev.name(), config.name());
    dev.bind_thread().unwrap();
    let (a, b) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
    let Some(alloc) = allocator_with(dev, config) else {
        return;
    };
    let size = 256 * MIB;

    let x = alloc.malloc(size, a.id()).unwrap();
    // SAFETY: x is ours, used by stream a only so far.
    unsafe { driver::memset_d32_async(x, 0x1111_1111, (size / 4) as usize, a.id()) }.unwrap();
    // Ballast: a second block of the same size, freed at once. Its memory
    // stays cached (a segment, or mapped pages), so the next request is
    // served without growing. Otherwise expandable segments would grow past
    // the peak and first run a recycling round, which synchronises the
    // device and would end stream b's work before the check below.
    let ballast = alloc.malloc(size, a.id()).unwrap();
    alloc.free(ballast).unwrap();
    a.synchronize().unwrap();

    // Long work on stream b over x (about 0.5 TB of writes), then free x on a.
    alloc.record_stream(x, b.id()).unwrap();
    let t0 = Instant::now();
    long_work(x, size, b.id(), 2000, 0xB0B0_B0B0);
    let b_done = alloc.device().record_event(b.id()).unwrap();
    alloc.free(x).unwrap();

    let y = alloc.malloc(size, a.id()).unwrap();
    let done_at_malloc = alloc.device().event_completed(&b_done).unwrap();
    println!(
        "x = {x}, y = {y}; stream b's work done when y was handed out: {done_at_malloc} ({:.1} ms after queueing)",
        t0.elapsed().as_secs_f64() * 1e3
    );
    assert!(
        y != x || done_at_malloc,
        "x was handed out again while stream b still wrote to it"
    );
    assert!(
        !done_at_malloc,
        "stream b finished too early for the test to mean anything"
    );
    assert_ne!(y, x);
    // SAFETY: y is ours on stream a.
    unsafe { driver::memset_d32_async(y, 0xA0A0_A0A0, (size / 4) as usize, a.id()) }.unwrap();

    // After b completes, x is reusable, and holds b's last value (nobody else wrote it).
    b.synchronize().unwrap();
    let b_ms = t0.elapsed().as_secs_f64() * 1e3;
    alloc.device().release_event(b_done);
    let z = alloc.malloc(size, a.id()).unwrap();
    println!("stream b finished after {b_ms:.1} ms; z = {z}");
    assert_eq!(
        z, x,
        "the exact-fit block is reused once its events completed"
    );
    assert_eq!(
        mismatches(z, size, a.id(), 0xB0B0_B0B0),
        0,
        "x was written by someone else"
    );
    assert_eq!(
        mismatches(y, size, a.id(), 0xA0A0_A0A0),
        0,
        "y was written by someone else"
    );
    alloc.free(y).unwrap();
    alloc.free(z).unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(
        alloc.stats().num_sync_all_streams,
        0,
        "no device-wide wait: the safety came from the events"
    );

    // The same through CachedBuffer (needs a 'static allocator).
    let alloc: &'static CachingAllocator<CudaDevice> = Box::leak(Box::new(alloc));
    let n = (size / 4) as usize;
    let buf = CachedBuffer::<u32>::zeroed(alloc, n, a.id()).unwrap();
    let first = buf.device_ptr();
    buf.synchronize().unwrap();
    buf.record_stream(b.id()).unwrap();
    long_work(first, size, b.id(), 2000, 7);
    let b_done = alloc.device().record_event(b.id()).unwrap();
    drop(buf);
    let buf2 = CachedBuffer::<u32>::zeroed(alloc, n, a.id()).unwrap();
    let done = alloc.device().event_completed(&b_done).unwrap();
    assert!(buf2.device_ptr() != first || done);
    assert!(!done);
    b.synchronize().unwrap();
    alloc.device().release_event(b_done);
    let buf3 = CachedBuffer::<u32>::zeroed(alloc, n, a.id()).unwrap();
    assert_eq!(buf3.device_ptr(), first);
    let mut host = vec![1u32; n];
    buf3.copy_to_host(&mut host).unwrap();
    assert!(host.iter().all(|&w| w == 0));
    drop((buf2, buf3));
    let stats = alloc.stats();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.usage().reserved, 0);
    println!(
        "{} device allocs, {} pages created, {} maps, {} unmaps",
        stats.num_device_alloc, stats.num_page_create, stats.num_map, stats.num_unmap
    );
}

#[test]
fn events_are_pooled() {
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    dev.bind_thread().unwrap();
    let (a, b) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
    let alloc = CachingAllocator::new(dev, Config::segments());
    for _ in 0..100 {
        let p = alloc.malloc(MIB, a.id()).unwrap();
        alloc.record_stream(p, b.id()).unwrap();
        // SAFETY: p is ours and the allocator knows b uses it.
        unsafe { driver::memset_d32_async(p, 3, (MIB / 4) as usize, b.id()) }.unwrap();
        alloc.free(p).unwrap();
        b.synchronize().unwrap();
        alloc.process_events().unwrap();
    }
    assert_eq!(
        alloc.device().pooled_events(),
        1,
        "one event, recorded and given back 100 times"
    );
    alloc.empty_cache().unwrap();
}

#[test]
fn cached_buffer_roundtrip_through_the_registry() {
    let _serial = serial();
    if gpu_device().is_none() {
        return;
    }
    let alloc = cuda::allocator(0).expect("registry allocator");
    assert!(
        std::ptr::eq(alloc, cuda::allocator(0).unwrap()),
        "one allocator per device"
    );
    assert!(matches!(
        cuda::allocator(-1),
        Err(CudaError::NoSuchDevice { .. })
    ));
    alloc.device().bind_thread().unwrap();
    let s = Stream::new(alloc.device()).unwrap();

    let data: Vec<f32> = (0..1_000_003).map(|i| i as f32 * 0.5).collect();
    let buf = CachedBuffer::from_slice(alloc, &data, s.id()).unwrap();
    assert_eq!(buf.len(), data.len());
    assert_eq!(buf.as_device_ptr().as_raw(), buf.as_raw());
    let mut back = vec![0f32; data.len()];
    buf.copy_to_host(&mut back).unwrap();
    assert_eq!(back, data);
    assert!(matches!(
        buf.copy_to_host(&mut back[1..]),
        Err(CudaError::LengthMismatch { .. })
    ));

    let mut z = CachedBuffer::<u64>::zeroed(alloc, 4099, s.id()).unwrap();
    let mut host = vec![7u64; 4099];
    z.copy_to_host(&mut host).unwrap();
    assert!(host.iter().all(|&v| v == 0));
    z.fill_u32(0xFFFF_FFFF).unwrap();
    z.copy_to_host(&mut host).unwrap();
    assert!(host.iter().all(|&v| v == u64::MAX));

    let odd = CachedBuffer::<u8>::zeroed(alloc, 3, s.id()).unwrap();
    let mut three = [9u8; 3];
    odd.copy_to_host(&mut three).unwrap();
    assert_eq!(three, [0; 3]);

    let empty = CachedBuffer::<f32>::zeroed(alloc, 0, s.id()).unwrap();
    assert!(empty.is_empty() && empty.as_raw() == 0);
    drop((buf, z, odd, empty));
    println!("registry allocator: {}", alloc.device().name());
}

#[test]
fn calls_from_threads_without_a_current_context() {
    calls_from_threads_with(Config::segments());
}

#[test]
fn calls_from_threads_without_a_current_context_expandable() {
    calls_from_threads_with(Config::expandable());
}

fn calls_from_threads_with(config: Config) {
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    // Deliberately no bind_thread anywhere: every driver call (the VMM ones
    // of expandable segments included) must set the primary context itself.
    let expandable = config.expandable_segments();
    let Some(alloc) = allocator_with(dev, config) else {
        return;
    };
    std::thread::scope(|sc| {
        for t in 0..8u64 {
            let alloc = &alloc;
            sc.spawn(move || {
                let ptrs: Vec<_> = (0..10)
                    .map(|i| alloc.malloc((30 + t + i) * MIB, StreamId(0)).unwrap())
                    .collect();
                for p in ptrs {
                    alloc.free(p).unwrap();
                }
            });
        }
    });
    let info = alloc.device().mem_info().unwrap();
    let released = alloc.empty_cache().unwrap();
    println!(
        "threads ({}): released {} segments ({} MiB); device {} MiB free of {} MiB",
        alloc.config().name(),
        released.segments,
        released.bytes / MIB,
        info.free / MIB,
        info.total / MIB
    );
    if expandable {
        // One virtual range (one stream, large pool), its pages all released.
        assert_eq!(released.segments, 1);
        assert!(released.bytes >= 30 * MIB);
    } else {
        assert!(released.segments >= 10);
    }
    assert_eq!(alloc.usage().reserved, 0);
}

/// A stream id nobody registered (not made by `Stream::new`, not passed
/// through the C ABI) never reaches the driver: recording an event or
/// queuing work on it is an error, and the allocator guarding a block used
/// on it synchronizes the device instead.
#[test]
fn unregistered_stream_ids_never_reach_the_driver() {
    let _s = serial();
    let Some(dev) = gpu_device() else { return };
    let bogus = StreamId(0x7f00_dead_b000);
    let e = dev.record_event(bogus).unwrap_err();
    assert!(e.to_string().contains("not a live stream"), "{e}");
    assert!(driver::stream_synchronize(bogus).is_err());
    let s = Stream::new(&dev).unwrap();
    let id = s.id();
    assert!(driver::is_registered_stream(id));
    drop(s);
    assert!(
        !driver::is_registered_stream(id),
        "a dropped stream is unregistered"
    );
    let alloc = CachingAllocator::new(dev, Config::pytorch());
    let p = alloc.malloc(MIB, StreamId(0)).unwrap();
    alloc.record_stream(p, bogus).unwrap();
    alloc.free(p).unwrap();
    // No event could guard it, so the device was synchronized and the
    // block is free at once: the next request of its size gets it back.
    let q = alloc.malloc(MIB, StreamId(0)).unwrap();
    assert_eq!(q, p);
    alloc.free(q).unwrap();
    alloc.check_invariants().unwrap();
    alloc.empty_cache().unwrap();
}

// The stream-capture entry points (not wrapped by the crate: only this test
// captures). `CUresult` is an `i32`, `CUstreamCaptureMode` a `u32`.
extern "C" {
    fn cuStreamBeginCapture_v2(stream: *mut std::ffi::c_void, mode: u32) -> i32;
    fn cuStreamEndCapture(stream: *mut std::ffi::c_void, graph: *mut *mut std::ffi::c_void) -> i32;
    fn cuGraphDestroy(graph: *mut std::ffi::c_void) -> i32;
}
/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
const CAPTURE_MODE_RELAXED: u32 = 2;

/// A block used on a stream that is being captured into a CUDA graph and
/// freed during the capture: nothing is recorded behind the capture (it
/// ends cleanly), the block stays out of use until the capture is over, and
/// is guarded by an event then; `empty_cache` returns its memory at the end.
#[test]
fn a_block_freed_during_a_capture_is_guarded_after_it() {
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    dev.bind_thread().unwrap();
    let s = Stream::new(&dev).unwrap();
    let alloc = CachingAllocator::new(dev, Config::segments());
    let size = 4 * MIB;
    let x = alloc.malloc(size, StreamId(0)).unwrap();
    alloc.record_stream(x, s.id()).unwrap();
    let raw = s.id().0 as usize as *mut std::ffi::c_void;
    // SAFETY: `raw` is the live stream `s` (its id is its handle).
    assert_eq!(
        unsafe { cuStreamBeginCapture_v2(raw, CAPTURE_MODE_RELAXED) },
        0
    );
    assert!(alloc.device().stream_capturing(s.id()));
    // Captured work over x, then x freed while the capture goes on.
    // SAFETY: x is ours; stream s uses it (record_stream above).
    unsafe { driver::memset_d32_async(x, 0x5eed_5eed, (size / 4) as usize, s.id()) }.unwrap();
    alloc.free(x).unwrap();
    assert_eq!(
        alloc.stats().active.all().current,
        1,
        "held until the capture ends"
    );
    let y = alloc.malloc(size, StreamId(0)).unwrap();
    assert_ne!(y, x, "not reused during the capture");
    let mut graph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above; `graph` is a valid out-pointer.
    let ended = unsafe { cuStreamEndCapture(raw, &mut graph) };
    assert_eq!(ended, 0, "the capture was not invalidated");
    // SAFETY: the graph made by the capture, destroyed once.
    unsafe { cuGraphDestroy(graph) };
    assert!(!alloc.device().stream_capturing(s.id()));
    alloc.free(y).unwrap();
    s.synchronize().unwrap();
    // The capture is over: the next call guards x; empty_cache waits for it.
    let z = alloc.malloc(size, StreamId(0)).unwrap();
    alloc.free(z).unwrap();
    alloc.check_invariants().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.usage().reserved, 0, "x's memory came back");
}
