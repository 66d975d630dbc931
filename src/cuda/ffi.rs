//! Raw declarations of the CUDA driver-API functions this crate calls.
//!
//! They are declared here rather than taken from `cust::sys` on purpose:
//! `cust_raw` 0.11 types `CUresult` as a Rust `#[repr(i32)]` enum generated
//! from CUDA 11.4, and a newer driver (CUDA 12/13) can return codes that enum
//! has no variant for, which would be undefined behaviour. Every function
//! here returns a plain `i32`, mapped to a name by [`super::driver::error_name`].
//!
//! Handles are opaque pointers (`CUcontext`, `CUstream`, `CUevent`,
//! `CUmemoryPool`); device pointers are `u64` (`CUdeviceptr`), and so are
//! physical allocation handles of the virtual memory API
//! (`CUmemGenericAllocationHandle`).

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

// Virtual memory management (CUDA >= 10.2). The values are those of cuda.h,
// unchanged from CUDA 10.2 to 13.x (checked against cust_raw 0.11.3's
// bindgen output, generated from CUDA 11.4, and the CUDA 12/13 headers).

/// `CUmemGenericAllocationHandle`: a physical allocation of `cuMemCreate`.
pub type CuMemHandle = u64;
/// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`
/// (alias of `…_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED`).
pub const CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: c_int = 102;
/// `CU_MEM_ALLOCATION_TYPE_PINNED`: memory that stays resident on the device.
pub const CU_MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
/// `CU_MEM_HANDLE_TYPE_NONE`: no shareable (IPC) handle requested.
pub const CU_MEM_HANDLE_TYPE_NONE: c_int = 0;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: a page exportable as a file descriptor (an `int`).
pub const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_int = 1;
/// `CU_MEM_HANDLE_TYPE_FABRIC`: a page exportable as a fabric handle (`CUmemFabricHandle`, 64 bytes).
pub const CU_MEM_HANDLE_TYPE_FABRIC: c_int = 8;
/// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`.
pub const CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: c_int = 103;
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`: the only flag `cuIpcOpenMemHandle` takes.
pub const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
/// `CU_MEM_LOCATION_TYPE_DEVICE`: `CUmemLocation::id` is a device ordinal.
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;
/// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`.
pub const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_int = 0;
/// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`.
pub const CU_MEM_ALLOC_GRANULARITY_RECOMMENDED: c_int = 1;

/// `CUmemLocation` (`CUmemLocation_v1`): 8 bytes, align 4.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct CuMemLocation {
    /// `CUmemLocationType` (a C enum: `int`).
    pub type_: c_int,
    /// Device ordinal for `CU_MEM_LOCATION_TYPE_DEVICE`.
    pub id: c_int,
}

/// The anonymous `allocFlags` struct of `CUmemAllocationProp`: 8 bytes, align 2.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct CuMemAllocFlags {
    /// `CU_MEM_ALLOCATION_COMP_NONE` (0) or `…_GENERIC` (1).
    pub compression_type: u8,
    /// Whether the allocation may be used for GPUDirect RDMA.
    pub gpu_direct_rdma_capable: u8,
    /// `CU_MEM_CREATE_USAGE_*` bits (0: ordinary device memory).
    pub usage: u16,
    /// Must be zero.
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp` (`CUmemAllocationProp_v1`): 32 bytes, align 8, with
/// fields at offsets 0, 4, 8, 16, 24 (the same in CUDA 10.2 through 13.x; the
/// compile-time assertions below hold it to that).
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct CuMemAllocationProp {
    /// `CUmemAllocationType`.
    pub type_: c_int,
    /// `CUmemAllocationHandleType` bits.
    pub requested_handle_types: c_int,
    /// Where the memory lives.
    pub location: CuMemLocation,
    /// Windows only (`LPSECURITYATTRIBUTES`); null elsewhere.
    pub win32_handle_meta_data: *mut c_void,
    /// Compression, RDMA, usage.
    pub alloc_flags: CuMemAllocFlags,
}

/// `CUmemAccessDesc` (`CUmemAccessDesc_v1`): 12 bytes, align 4.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct CuMemAccessDesc {
    /// The device (or host) the access applies to.
    pub location: CuMemLocation,
    /// `CUmemAccess_flags`.
    pub flags: c_int,
}

/// `CUipcMemHandle`: 64 opaque bytes.
#[repr(C)]
#[derive(Copy, Clone)]
pub struct CuIpcMemHandle(pub [u8; 64]);

// The layouts of cuda.h (and of cust_raw's layout tests), checked at compile time.
const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<CuMemLocation>() == 8 && align_of::<CuMemLocation>() == 4);
    assert!(size_of::<CuMemAllocFlags>() == 8 && align_of::<CuMemAllocFlags>() == 2);
    assert!(offset_of!(CuMemAllocFlags, usage) == 2);
    assert!(offset_of!(CuMemAllocFlags, reserved) == 4);
    assert!(size_of::<CuMemAllocationProp>() == 32 && align_of::<CuMemAllocationProp>() == 8);
    assert!(offset_of!(CuMemAllocationProp, requested_handle_types) == 4);
    assert!(offset_of!(CuMemAllocationProp, location) == 8);
    assert!(offset_of!(CuMemAllocationProp, win32_handle_meta_data) == 16);
    assert!(offset_of!(CuMemAllocationProp, alloc_flags) == 24);
    assert!(size_of::<CuMemAccessDesc>() == 12 && align_of::<CuMemAccessDesc>() == 4);
    assert!(offset_of!(CuMemAccessDesc, flags) == 8);
};

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
    pub fn cuDeviceGetAttribute(pi: *mut c_int, attrib: c_int, dev: CuDevice) -> i32;

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
    pub fn cuMemsetD16Async(dst: CuDevicePtr, us: u16, n: usize, stream: CuStream) -> i32;
    pub fn cuMemcpyHtoDAsync_v2(
        dst: CuDevicePtr,
        src: *const c_void,
        bytes: usize,
        stream: CuStream,
    ) -> i32;
    pub fn cuMemcpyDtoD_v2(dst: CuDevicePtr, src: CuDevicePtr, bytes: usize) -> i32;
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

    pub fn cuMemGetAllocationGranularity(
        granularity: *mut usize,
        prop: *const CuMemAllocationProp,
        option: c_int,
    ) -> i32;
    pub fn cuMemAddressReserve(
        ptr: *mut CuDevicePtr,
        size: usize,
        alignment: usize,
        addr: CuDevicePtr,
        flags: u64,
    ) -> i32;
    pub fn cuMemAddressFree(ptr: CuDevicePtr, size: usize) -> i32;
    pub fn cuMemCreate(
        handle: *mut CuMemHandle,
        size: usize,
        prop: *const CuMemAllocationProp,
        flags: u64,
    ) -> i32;
    pub fn cuMemRelease(handle: CuMemHandle) -> i32;
    pub fn cuMemMap(
        ptr: CuDevicePtr,
        size: usize,
        offset: usize,
        handle: CuMemHandle,
        flags: u64,
    ) -> i32;
    pub fn cuMemSetAccess(
        ptr: CuDevicePtr,
        size: usize,
        desc: *const CuMemAccessDesc,
        count: usize,
    ) -> i32;
    pub fn cuMemUnmap(ptr: CuDevicePtr, size: usize) -> i32;
    pub fn cuIpcGetMemHandle(handle: *mut CuIpcMemHandle, dptr: CuDevicePtr) -> i32;
    /// `cuIpcOpenMemHandle` (cuda.h defines the name to its `_v2`).
    pub fn cuIpcOpenMemHandle_v2(
        dptr: *mut CuDevicePtr,
        handle: CuIpcMemHandle,
        flags: c_uint,
    ) -> i32;
    pub fn cuIpcCloseMemHandle(dptr: CuDevicePtr) -> i32;
    /// `shareable`: an `int*` for a POSIX file descriptor, a
    /// `CUmemFabricHandle*` for a fabric handle.
    pub fn cuMemExportToShareableHandle(
        shareable: *mut c_void,
        handle: CuMemHandle,
        handle_type: c_int,
        flags: u64,
    ) -> i32;
    /// `os_handle`: the file descriptor itself (cast to a pointer) for a
    /// POSIX file descriptor, a `CUmemFabricHandle*` for a fabric handle.
    pub fn cuMemImportFromShareableHandle(
        handle: *mut CuMemHandle,
        os_handle: *mut c_void,
        handle_type: c_int,
    ) -> i32;

    pub fn cuStreamCreate(stream: *mut CuStream, flags: c_uint) -> i32;
    pub fn cuStreamDestroy_v2(stream: CuStream) -> i32;
    pub fn cuStreamSynchronize(stream: CuStream) -> i32;

    pub fn cuEventCreate(event: *mut CuEvent, flags: c_uint) -> i32;
    pub fn cuEventRecord(event: CuEvent, stream: CuStream) -> i32;
    pub fn cuEventQuery(event: CuEvent) -> i32;
    pub fn cuEventSynchronize(event: CuEvent) -> i32;
    pub fn cuStreamWaitEvent(stream: CuStream, event: CuEvent, flags: u32) -> i32;
    /// `status`: a `CUstreamCaptureStatus` (0 none, 1 active, 2 invalidated).
    pub fn cuStreamIsCapturing(stream: CuStream, status: *mut c_int) -> i32;
    pub fn cuEventDestroy_v2(event: CuEvent) -> i32;
}
