//! Raw declarations of the CUDA driver-API functions this crate calls.
//!
//! They are declared here rather than taken from `cust::sys` on purpose:
//! `cust_raw` 0.11 types `CUresult` as a Rust `#[repr(i32)]` enum generated
//! from CUDA 11.4, and a newer driver (CUDA 12/13) can return codes that enum
//! has no variant for, which would be undefined behaviour. Every function
//! here returns a plain `i32`, mapped to a name by [`super::driver::error_name`].
//!
//! Handles are opaque pointers (`CUcontext`, `CUstream`, `CUevent`,
//! `CUmemoryPool`); device pointers are `u64` (`CUdeviceptr`).

use std::os::raw::{c_char, c_int, c_uint, c_void};

/// `CUcontext`.
pub type CuContext = *mut c_void;
/// `CUstream`; the null pointer is the legacy default stream.
pub type CuStream = *mut c_void;
/// `CUevent`.
pub type CuEvent = *mut c_void;
/// `CUmemoryPool`.
pub type CuMemPool = *mut c_void;
/// `CUdevice` (an ordinal).
pub type CuDevice = c_int;
/// `CUdeviceptr`.
pub type CuDevicePtr = u64;

pub const CUDA_SUCCESS: i32 = 0;
pub const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;
pub const CUDA_ERROR_NOT_READY: i32 = 600;
pub const CU_EVENT_DISABLE_TIMING: c_uint = 2;
pub const CU_STREAM_NON_BLOCKING: c_uint = 1;
pub const CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: c_int = 4;

// Linking: cust_raw's build script already emits `-l cuda` (from
// CUDA_LIBRARY_PATH, or the stub of scripts/make-cuda-stub.sh); naming the
// library here as well keeps this block correct on its own.
#[link(name = "cuda")]
extern "C" {
    pub fn cuInit(flags: c_uint) -> i32;
    pub fn cuDriverGetVersion(version: *mut c_int) -> i32;
    pub fn cuGetErrorName(error: i32, p_str: *mut *const c_char) -> i32;
    pub fn cuDeviceGet(device: *mut CuDevice, ordinal: c_int) -> i32;
    pub fn cuDeviceGetCount(count: *mut c_int) -> i32;
    pub fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CuDevice) -> i32;

    pub fn cuDevicePrimaryCtxRetain(pctx: *mut CuContext, dev: CuDevice) -> i32;
    pub fn cuDevicePrimaryCtxRelease_v2(dev: CuDevice) -> i32;
    pub fn cuCtxGetCurrent(pctx: *mut CuContext) -> i32;
    pub fn cuCtxSetCurrent(ctx: CuContext) -> i32;
    pub fn cuCtxSynchronize() -> i32;

    pub fn cuMemAlloc_v2(dptr: *mut CuDevicePtr, bytesize: usize) -> i32;
    pub fn cuMemFree_v2(dptr: CuDevicePtr) -> i32;
    pub fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> i32;
    pub fn cuMemsetD32Async(dst: CuDevicePtr, ui: c_uint, n: usize, stream: CuStream) -> i32;
    pub fn cuMemsetD8Async(dst: CuDevicePtr, uc: u8, n: usize, stream: CuStream) -> i32;
    pub fn cuMemcpyHtoDAsync_v2(
        dst: CuDevicePtr,
        src: *const c_void,
        bytes: usize,
        stream: CuStream,
    ) -> i32;
    pub fn cuMemcpyDtoHAsync_v2(
        dst: *mut c_void,
        src: CuDevicePtr,
        bytes: usize,
        stream: CuStream,
    ) -> i32;

    pub fn cuMemAllocAsync(dptr: *mut CuDevicePtr, bytesize: usize, stream: CuStream) -> i32;
    pub fn cuMemFreeAsync(dptr: CuDevicePtr, stream: CuStream) -> i32;
    pub fn cuDeviceGetDefaultMemPool(pool: *mut CuMemPool, dev: CuDevice) -> i32;
    pub fn cuMemPoolSetAttribute(pool: CuMemPool, attr: c_int, value: *mut c_void) -> i32;

    pub fn cuStreamCreate(stream: *mut CuStream, flags: c_uint) -> i32;
    pub fn cuStreamDestroy_v2(stream: CuStream) -> i32;
    pub fn cuStreamSynchronize(stream: CuStream) -> i32;

    pub fn cuEventCreate(event: *mut CuEvent, flags: c_uint) -> i32;
    pub fn cuEventRecord(event: CuEvent, stream: CuStream) -> i32;
    pub fn cuEventQuery(event: CuEvent) -> i32;
    pub fn cuEventSynchronize(event: CuEvent) -> i32;
    pub fn cuEventDestroy_v2(event: CuEvent) -> i32;
}
