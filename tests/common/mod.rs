//! What the GPU tests (`tests/gpu_*.rs`) share: the device or a printed
//! reason to skip, one-test-at-a-time serialisation, filling and checking
//! device memory, and the test RNG.
// Each test binary compiles its own copy and uses a part of it.
#![allow(dead_code, unused_imports)]

use cachealloc::core::{CachingAllocator, DevicePtr, StreamId};
use cachealloc::cuda::driver;
use cachealloc::cuda::CudaDevice;
use std::sync::{Mutex, MutexGuard};

pub use cachealloc::cuda::first_device_or_skip as gpu_device;
pub use cachealloc_core::sample::XorShift64;

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// Device 0 if it has the virtual memory API; otherwise says why and skips.
pub fn vmm_device() -> Option<CudaDevice> {
    let dev = gpu_device()?;
    match dev.vmm_support() {
        Ok(_) => Some(dev),
        Err(why) => {
            println!("skipping: no virtual memory API on this device ({why})");
            None
        }
    }
}

static SERIAL: Mutex<()> = Mutex::new(());

/// Runs the tests of one binary one at a time: they compare the driver's
/// free memory, fill the device or time work, which a neighbour would skew.
/// A panicking test does not poison the others.
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Fills the `bytes` (a multiple of 4) at `ptr` with the word `v` on stream `s`.
/// The caller owns `[ptr, ptr + bytes)` and the allocator knows that `s` uses it.
pub fn fill(ptr: DevicePtr, bytes: u64, s: StreamId, v: u32) {
    // SAFETY: the caller owns [ptr, ptr+bytes) and the allocator knows `s` uses it.
    unsafe { driver::memset_d32_async(ptr, v, (bytes / 4) as usize, s) }.unwrap();
}

/// Words of `[ptr, ptr + bytes)` that do not hold `v`, read after the work
/// queued on `s`. The caller holds a live allocation of at least `bytes`.
pub fn mismatches(ptr: DevicePtr, bytes: u64, s: StreamId, v: u32) -> usize {
    // SAFETY: a live allocation of at least `bytes` bytes.
    let got = unsafe { driver::read_u32(ptr, (bytes / 4) as usize, s) }.unwrap();
    got.iter().filter(|&&w| w != v).count()
}

/// `n` blocks of `bytes` from `alloc` on `s`, block `i` filled with `base + i`.
pub fn filled_blocks(
    alloc: &CachingAllocator<CudaDevice>,
    n: u32,
    bytes: u64,
    s: StreamId,
    base: u32,
) -> Vec<DevicePtr> {
    (0..n)
        .map(|i| {
            let p = alloc.malloc(bytes, s).unwrap();
            fill(p, bytes, s, base + i);
            p
        })
        .collect()
}

/// [`mismatches`] summed over every `step`-th block of
/// [`filled_blocks`]`(_, _, bytes, s, base)`, each against its own value.
pub fn blocks_mismatches(
    blocks: &[DevicePtr],
    step: usize,
    bytes: u64,
    s: StreamId,
    base: u32,
) -> usize {
    blocks
        .iter()
        .enumerate()
        .step_by(step)
        .map(|(i, p)| mismatches(*p, bytes, s, base + i as u32))
        .sum()
}
