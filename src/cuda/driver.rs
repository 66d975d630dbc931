//! Thin wrappers over the CUDA driver API: error mapping, the context guard,
//! and the few raw calls that tests, benchmarks and examples need beside the
//! allocator (raw `cuMemAlloc`, the driver's stream-ordered pool, memsets,
//! copies, streams).
//!
//! Every function here works in the calling thread's **current context**.
//! Make the device's primary context current first with
//! [`super::CudaDevice::bind_thread`]; the [`super::CudaDevice`] methods
//! themselves do that on their own.
//!
//! Every driver error becomes [`DeviceError::Driver`] with the CUresult name
//! (`CUDA_ERROR_…`) and the call; `CUDA_ERROR_OUT_OF_MEMORY` becomes
//! [`DeviceError::OutOfMemory`].

use super::{ffi, CudaDevice};
use cachealloc_core::{DeviceError, DevicePtr, MemInfo, StreamId};
use std::ffi::CStr;
use std::os::raw::{c_char, c_void};
use std::ptr;
use std::sync::RwLock;

/// The driver's name for a CUresult (`CUDA_ERROR_ILLEGAL_ADDRESS`), or
/// `CUresult(N)` when the driver does not know it either.
pub fn error_name(code: i32) -> String {
    let mut s: *const c_char = ptr::null();
    // SAFETY: cuGetErrorName only writes a pointer to a static string into `s`
    // (or leaves it and returns CUDA_ERROR_INVALID_VALUE for unknown codes);
    // it needs no initialised driver and no context.
    let rc = unsafe { ffi::cuGetErrorName(code, &mut s) };
    if rc == ffi::CUDA_SUCCESS && !s.is_null() {
        // SAFETY: on success `s` points to a NUL-terminated string with static
        // lifetime owned by the driver.
        let name = unsafe { CStr::from_ptr(s) };
        return name.to_string_lossy().into_owned();
    }
    format!("CUresult({code})")
}

/// Maps a CUresult to `Ok` or to the typed error.
pub fn check(code: i32, call: &'static str) -> Result<(), DeviceError> {
    match code {
        ffi::CUDA_SUCCESS => Ok(()),
        ffi::CUDA_ERROR_OUT_OF_MEMORY => Err(DeviceError::OutOfMemory),
        _ => Err(DeviceError::Driver {
            name: error_name(code),
            call,
        }),
    }
}

/// Streams that may be handed to the driver besides the special handles:
/// those made by [`Stream::new`] (until dropped) and those registered with
/// [`register_stream`]. CUDA does not promise to detect a handle that is not
/// a live stream (it may crash or corrupt state), so no other integer reaches
/// the driver as a stream.
static LIVE_STREAMS: RwLock<Vec<u64>> = RwLock::new(Vec::new());

/// The special handles every context accepts: 0 (the default stream),
/// `CU_STREAM_LEGACY` (1) and `CU_STREAM_PER_THREAD` (2).
const SPECIAL_STREAMS: u64 = 2;

/// Adds `stream` to the streams the driver may be handed.
///
/// # Safety
/// `stream` is a live `CUstream` (a `cudaStream_t`) and stays live while the
/// allocator or anything here may use it: events are recorded on it and
/// work queued on it until it is unregistered (streams that a program
/// destroys must be unregistered first, with [`unregister_stream`]).
pub unsafe fn register_stream(stream: StreamId) {
    if is_registered_stream(stream) {
        return; // the common case: no write lock
    }
    let mut live = LIVE_STREAMS.write().unwrap_or_else(|e| e.into_inner());
    if !live.contains(&stream.0) {
        live.push(stream.0);
    }
}

thread_local! {
    /// The stream this thread registered last through [`ffi_stream`] (a
    /// repeat skips the registry).
    static LAST_FFI_STREAM: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A `cudaStream_t` received through a C ABI (PyTorch's allocator
/// interfaces), registered as a stream the driver may be handed.
#[inline]
pub(crate) fn ffi_stream(stream: *mut std::ffi::c_void) -> StreamId {
    let id = StreamId(stream as usize as u64);
    if LAST_FFI_STREAM
        .try_with(|l| l.get() == id.0)
        .unwrap_or(false)
    {
        return id;
    }
    // SAFETY: PyTorch passes the `cudaStream_t` a tensor is allocated or
    // used on: a live stream of the current device, kept alive by PyTorch
    // while its tensors and their events may use it (PyTorch's own
    // allocator records its events on the same handles).
    unsafe { register_stream(id) };
    let _ = LAST_FFI_STREAM.try_with(|l| l.set(id.0));
    id
}

/// Removes `stream` from the streams the driver may be handed (calls with it
/// then fail with an error instead of reaching the driver).
pub fn unregister_stream(stream: StreamId) {
    let mut live = LIVE_STREAMS.write().unwrap_or_else(|e| e.into_inner());
    live.retain(|&s| s != stream.0);
}

/// Whether `stream` may be handed to the driver (a special handle or a registered stream).
pub fn is_registered_stream(stream: StreamId) -> bool {
    stream.0 <= SPECIAL_STREAMS
        || LIVE_STREAMS
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&stream.0)
}

/// The `CUstream` of `stream`, or an error if it is neither a special handle
/// nor a registered stream: the only way a [`StreamId`] becomes a handle.
pub(crate) fn stream_handle(stream: StreamId) -> Result<ffi::CuStream, DeviceError> {
    if !is_registered_stream(stream) {
        return Err(unregistered(stream));
    }
    Ok(stream.0 as usize as ffi::CuStream)
}

#[cold]
fn unregistered(stream: StreamId) -> DeviceError {
    DeviceError::Driver {
        name: format!(
            "stream {:#x} is not a live stream known to cachealloc (made by Stream::new or registered)",
            stream.0
        ),
        call: "stream handle check",
    }
}

/// Makes a context current on the calling thread for the guard's lifetime.
///
/// Cheap when it already is (one `cuCtxGetCurrent`). When the thread had no
/// context, ours stays current afterwards (what the runtime API would do
/// lazily anyway); when it had another one, that one is restored on drop, so
/// that a caller working on another device is not switched under its feet.
pub(crate) struct CtxGuard {
    restore: Option<ffi::CuContext>,
}

impl CtxGuard {
    pub(crate) fn enter(ctx: ffi::CuContext) -> Result<CtxGuard, DeviceError> {
        let mut cur: ffi::CuContext = ptr::null_mut();
        // SAFETY: cuCtxGetCurrent writes one handle into `cur`, a valid local.
        check(unsafe { ffi::cuCtxGetCurrent(&mut cur) }, "cuCtxGetCurrent")?;
        if cur == ctx {
            return Ok(CtxGuard { restore: None });
        }
        // SAFETY: `ctx` is a primary context retained by the CudaDevice that
        // owns it for at least as long as this guard lives.
        check(unsafe { ffi::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")?;
        Ok(CtxGuard {
            restore: (!cur.is_null()).then_some(cur),
        })
    }
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if let Some(prev) = self.restore {
            // SAFETY: `prev` was current on this thread when the guard was
            // made; putting it back is what the caller had. An error here
            // (context destroyed meanwhile) leaves ours current, which is safe.
            unsafe { ffi::cuCtxSetCurrent(prev) };
        }
    }
}

/// `cuInit(0)`; idempotent and cheap after the first call.
pub fn init() -> Result<(), DeviceError> {
    // SAFETY: cuInit takes flags by value and has no pointer arguments.
    check(unsafe { ffi::cuInit(0) }, "cuInit")
}

/// Number of CUDA devices (initialises the driver). An error means no usable driver.
pub fn device_count() -> Result<i32, DeviceError> {
    init()?;
    let mut n = 0;
    // SAFETY: writes one int into `n`, a valid local.
    check(unsafe { ffi::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
    Ok(n)
}

/// The driver's CUDA version, e.g. 13000 for CUDA 13.0.
pub fn driver_version() -> Result<i32, DeviceError> {
    let mut v = 0;
    check(
        // SAFETY: writes one int into `v`, a valid local.
        unsafe { ffi::cuDriverGetVersion(&mut v) },
        "cuDriverGetVersion",
    )?;
    Ok(v)
}

/// Free and total memory of the current context's device (`cuMemGetInfo_v2`).
pub fn mem_info() -> Result<MemInfo, DeviceError> {
    let (mut free, mut total) = (0usize, 0usize);
    check(
        // SAFETY: writes two usize values into valid locals.
        unsafe { ffi::cuMemGetInfo_v2(&mut free, &mut total) },
        "cuMemGetInfo_v2",
    )?;
    Ok(MemInfo {
        free: free as u64,
        total: total as u64,
    })
}

/// Raw `cuMemAlloc_v2` (no caching): the baseline in benchmarks and the
/// "other user" that fills the device in the out-of-memory tests.
pub fn mem_alloc(bytes: u64) -> Result<DevicePtr, DeviceError> {
    let mut p: ffi::CuDevicePtr = 0;
    check(
        // SAFETY: writes one device pointer into `p`, a valid local.
        unsafe { ffi::cuMemAlloc_v2(&mut p, bytes as usize) },
        "cuMemAlloc_v2",
    )?;
    Ok(DevicePtr(p))
}

/// Raw `cuMemFree_v2`.
///
/// # Safety
/// `ptr` came from [`mem_alloc`] and is freed once; no queued work still uses it.
pub unsafe fn mem_free(ptr: DevicePtr) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees ptr is a live cuMemAlloc allocation.
    check(unsafe { ffi::cuMemFree_v2(ptr.0) }, "cuMemFree_v2")
}

/// `cuMemAllocAsync` from the device's current pool on `stream`.
pub fn mem_alloc_async(bytes: u64, stream: StreamId) -> Result<DevicePtr, DeviceError> {
    let mut p: ffi::CuDevicePtr = 0;
    let h = stream_handle(stream)?;
    check(
        // SAFETY: writes one device pointer into `p`; `h` is a live stream (a
        // special handle, or registered under `register_stream`'s contract).
        unsafe { ffi::cuMemAllocAsync(&mut p, bytes as usize, h) },
        "cuMemAllocAsync",
    )?;
    Ok(DevicePtr(p))
}

/// `cuMemFreeAsync`.
///
/// # Safety
/// `ptr` came from [`mem_alloc_async`] and is freed once.
pub unsafe fn mem_free_async(ptr: DevicePtr, stream: StreamId) -> Result<(), DeviceError> {
    let h = stream_handle(stream)?;
    check(
        // SAFETY: the caller guarantees ptr is a live stream-ordered allocation;
        // `h` is a live stream (see `stream_handle`).
        unsafe { ffi::cuMemFreeAsync(ptr.0, h) },
        "cuMemFreeAsync",
    )
}

/// Sets the release threshold of `ordinal`'s default memory pool (the pool
/// `cuMemAllocAsync` draws from). `u64::MAX` keeps freed memory in the pool
/// instead of trimming it at every synchronisation.
pub fn set_default_pool_release_threshold(ordinal: i32, bytes: u64) -> Result<(), DeviceError> {
    let mut dev: ffi::CuDevice = 0;
    check(
        // SAFETY: writes one CUdevice into a valid local.
        unsafe { ffi::cuDeviceGet(&mut dev, ordinal) },
        "cuDeviceGet",
    )?;
    let mut pool: ffi::CuMemPool = ptr::null_mut();
    check(
        // SAFETY: writes one pool handle into a valid local.
        unsafe { ffi::cuDeviceGetDefaultMemPool(&mut pool, dev) },
        "cuDeviceGetDefaultMemPool",
    )?;
    let mut value: u64 = bytes;
    check(
        // SAFETY: the release-threshold attribute is a cuuint64_t read from `value`.
        unsafe {
            ffi::cuMemPoolSetAttribute(
                pool,
                ffi::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut value as *mut u64).cast::<c_void>(),
            )
        },
        "cuMemPoolSetAttribute",
    )
}

/// Attribute `attribute` (`CU_DEVICE_ATTRIBUTE_*`) of device `ordinal`.
pub(crate) fn device_attribute(
    ordinal: i32,
    attribute: std::os::raw::c_int,
) -> Result<i32, DeviceError> {
    let mut dev: ffi::CuDevice = 0;
    check(
        // SAFETY: writes one CUdevice into a valid local.
        unsafe { ffi::cuDeviceGet(&mut dev, ordinal) },
        "cuDeviceGet",
    )?;
    let mut v = 0;
    check(
        // SAFETY: writes one int into `v`, a valid local; an attribute the
        // driver does not know is CUDA_ERROR_INVALID_VALUE.
        unsafe { ffi::cuDeviceGetAttribute(&mut v, attribute, dev) },
        "cuDeviceGetAttribute",
    )?;
    Ok(v)
}

/// Whether device `ordinal` supports the virtual memory management API
/// (`CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`).
pub fn vmm_supported(ordinal: i32) -> Result<bool, DeviceError> {
    let mut dev: ffi::CuDevice = 0;
    check(
        // SAFETY: writes one CUdevice into a valid local.
        unsafe { ffi::cuDeviceGet(&mut dev, ordinal) },
        "cuDeviceGet",
    )?;
    let mut v = 0;
    check(
        // SAFETY: writes one int into `v`, a valid local; the attribute exists
        // since CUDA 10.2 (older drivers answer CUDA_ERROR_INVALID_VALUE).
        unsafe {
            ffi::cuDeviceGetAttribute(
                &mut v,
                ffi::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                dev,
            )
        },
        "cuDeviceGetAttribute",
    )?;
    Ok(v != 0)
}

/// The allocation properties of pinned device memory on device `ordinal`
/// with the shareable handle types `handle_types` (`CU_MEM_HANDLE_TYPE_*`
/// bits), no compression.
fn device_alloc_prop(ordinal: i32, handle_types: std::os::raw::c_int) -> ffi::CuMemAllocationProp {
    ffi::CuMemAllocationProp {
        type_: ffi::CU_MEM_ALLOCATION_TYPE_PINNED,
        requested_handle_types: handle_types,
        location: ffi::CuMemLocation {
            type_: ffi::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        win32_handle_meta_data: ptr::null_mut(),
        alloc_flags: ffi::CuMemAllocFlags::default(),
    }
}

/// Physical page granularity of device `ordinal` for [`mem_create`]
/// (`cuMemGetAllocationGranularity`): the minimum when `recommended` is
/// false (what sizes and mapping addresses must be multiples of), else the
/// driver's recommendation for performance. 2 MiB for both on H100/H200.
pub fn allocation_granularity(ordinal: i32, recommended: bool) -> Result<u64, DeviceError> {
    let prop = device_alloc_prop(ordinal, ffi::CU_MEM_HANDLE_TYPE_NONE);
    let option = if recommended {
        ffi::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    } else {
        ffi::CU_MEM_ALLOC_GRANULARITY_MINIMUM
    };
    let mut g = 0usize;
    check(
        // SAFETY: `prop` is a fully initialised CUmemAllocationProp with the
        // layout of cuda.h (asserted in ffi.rs); the driver reads it and writes
        // one size_t into `g`.
        unsafe { ffi::cuMemGetAllocationGranularity(&mut g, &prop, option) },
        "cuMemGetAllocationGranularity",
    )?;
    Ok(g as u64)
}

/// Reserves `bytes` of virtual address space aligned to `alignment`
/// (`cuMemAddressReserve`); no memory backs it until [`mem_map`].
pub fn mem_address_reserve(bytes: u64, alignment: u64) -> Result<DevicePtr, DeviceError> {
    mem_address_reserve_at(bytes, alignment, 0)
}

/// [`mem_address_reserve`] asking for the range to start at `hint` (0: no
/// wish); the driver takes the hint only if that range is free, and
/// reserves elsewhere otherwise.
pub fn mem_address_reserve_at(
    bytes: u64,
    alignment: u64,
    hint: u64,
) -> Result<DevicePtr, DeviceError> {
    let mut p: ffi::CuDevicePtr = 0;
    check(
        // SAFETY: writes one device pointer into `p`, a valid local; the
        // requested address is only a hint (nothing is mapped or replaced
        // there by this call), flags must be 0.
        unsafe { ffi::cuMemAddressReserve(&mut p, bytes as usize, alignment as usize, hint, 0) },
        "cuMemAddressReserve",
    )?;
    Ok(DevicePtr(p))
}

/// Frees a virtual range (`cuMemAddressFree`).
///
/// # Safety
/// `[ptr, ptr + bytes)` is exactly a range from [`mem_address_reserve`],
/// freed once, with nothing mapped in it any more.
pub unsafe fn mem_address_free(ptr: DevicePtr, bytes: u64) -> Result<(), DeviceError> {
    check(
        // SAFETY: the caller guarantees the range is ours, whole and unmapped.
        unsafe { ffi::cuMemAddressFree(ptr.0, bytes as usize) },
        "cuMemAddressFree",
    )
}

/// Creates a physical allocation of `bytes` (a multiple of the granularity)
/// on device `ordinal` (`cuMemCreate`, pinned device memory, no shareable
/// handle); returns its handle. `CUDA_ERROR_OUT_OF_MEMORY` is
/// [`DeviceError::OutOfMemory`].
pub fn mem_create(bytes: u64, ordinal: i32) -> Result<u64, DeviceError> {
    mem_create_with(bytes, ordinal, false)
}

/// [`mem_create`], with `shareable` a page another process can import:
/// created with a POSIX file descriptor as its shareable handle type
/// (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`; exported by
/// [`super::ipc::export_fd`]).
pub fn mem_create_with(bytes: u64, ordinal: i32, shareable: bool) -> Result<u64, DeviceError> {
    let types = if shareable {
        ffi::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    } else {
        ffi::CU_MEM_HANDLE_TYPE_NONE
    };
    let prop = device_alloc_prop(ordinal, types);
    let mut h: ffi::CuMemHandle = 0;
    check(
        // SAFETY: `prop` is fully initialised with cuda.h's layout; the driver
        // writes one handle into `h`, a valid local; flags must be 0.
        unsafe { ffi::cuMemCreate(&mut h, bytes as usize, &prop, 0) },
        "cuMemCreate",
    )?;
    Ok(h)
}

/// Releases a physical allocation (`cuMemRelease`). Its memory goes back to
/// the driver once no mapping of it is left.
///
/// # Safety
/// `handle` came from [`mem_create`] and is released once.
pub unsafe fn mem_release(handle: u64) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees a live handle, released once.
    check(unsafe { ffi::cuMemRelease(handle) }, "cuMemRelease")
}

/// Maps the whole of physical allocation `handle` (`bytes` long) at `ptr`
/// (`cuMemMap`) and makes it readable and writable from device `ordinal`
/// (`cuMemSetAccess`). If the access cannot be set, the mapping is undone.
pub fn mem_map(ptr: DevicePtr, handle: u64, bytes: u64, ordinal: i32) -> Result<(), DeviceError> {
    let mut all = MAPPINGS.lock().unwrap_or_else(|e| e.into_inner());
    let peers = all.get(&ordinal).map_or(&[][..], |m| &m.peers[..]);
    let descs: Vec<ffi::CuMemAccessDesc> = std::iter::once(ordinal)
        .chain(peers.iter().copied())
        .map(access_desc)
        .collect();
    check(
        // SAFETY: maps into a reserved range; the driver validates the range,
        // the handle, the size and that nothing is mapped there yet. Mapping
        // makes new memory reachable and invalidates nothing.
        unsafe { ffi::cuMemMap(ptr.0, bytes as usize, 0, handle, 0) },
        "cuMemMap",
    )?;
    // SAFETY: `descs` holds `descs.len()` fully initialised CUmemAccessDesc
    // (the device's own, then its peers'), read by the driver; the range is
    // the one just mapped.
    let rc = unsafe { ffi::cuMemSetAccess(ptr.0, bytes as usize, descs.as_ptr(), descs.len()) };
    if let Err(e) = check(rc, "cuMemSetAccess") {
        // SAFETY: the range was mapped just above and was never accessible,
        // so no work can use it.
        unsafe { ffi::cuMemUnmap(ptr.0, bytes as usize) };
        return Err(e);
    }
    all.entry(ordinal).or_default().ranges.insert(ptr.0, bytes);
    Ok(())
}

/// Read/write access for device `ordinal`.
fn access_desc(ordinal: i32) -> ffi::CuMemAccessDesc {
    ffi::CuMemAccessDesc {
        location: ffi::CuMemLocation {
            type_: ffi::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        flags: ffi::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// A device's page mappings ([`mem_map`]) and the other devices that may
/// access them ([`enable_peer_access`]).
#[derive(Default)]
struct Mappings {
    peers: Vec<i32>,
    /// Mapped ranges: address → bytes.
    ranges: std::collections::BTreeMap<u64, u64>,
}

/// Every device's mappings, by ordinal: a peer enabled later is granted
/// access to the pages mapped before, and every later mapping grants it too.
static MAPPINGS: std::sync::Mutex<std::collections::BTreeMap<i32, Mappings>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// Lets device `peer` read and write the pages of device `ordinal`: those
/// mapped now and every page mapped later (`cuMemSetAccess`), as
/// `cudaDeviceEnablePeerAccess` does for `cuMemAlloc` memory. Idempotent;
/// `peer == ordinal` does nothing. The caller checks that the devices can
/// access each other (`cuDeviceCanAccessPeer`); the driver refuses otherwise.
pub fn enable_peer_access(ordinal: i32, peer: i32) -> Result<(), DeviceError> {
    let mut all = MAPPINGS.lock().unwrap_or_else(|e| e.into_inner());
    let m = all.entry(ordinal).or_default();
    if peer == ordinal || m.peers.contains(&peer) {
        return Ok(());
    }
    let desc = access_desc(peer);
    for (&addr, &bytes) in &m.ranges {
        check(
            // SAFETY: one initialised CUmemAccessDesc; the range is a whole
            // mapping of this device that is still mapped (unmaps remove it
            // under the same lock). Granting access invalidates nothing.
            unsafe { ffi::cuMemSetAccess(addr, bytes as usize, &desc, 1) },
            "cuMemSetAccess",
        )?;
    }
    m.peers.push(peer);
    Ok(())
}

/// Unmaps `[ptr, ptr + bytes)` (`cuMemUnmap`); the physical allocation
/// stays alive until released.
///
/// # Safety
/// The range is exactly one or more whole mappings of [`mem_map`], and no
/// queued or running work still accesses it (unmapping does not wait for
/// the GPU; an access after it faults).
pub unsafe fn mem_unmap(ptr: DevicePtr, bytes: u64) -> Result<(), DeviceError> {
    let mut all = MAPPINGS.lock().unwrap_or_else(|e| e.into_inner());
    check(
        // SAFETY: the caller guarantees whole mappings no work still uses.
        unsafe { ffi::cuMemUnmap(ptr.0, bytes as usize) },
        "cuMemUnmap",
    )?;
    let end = ptr.0.saturating_add(bytes);
    for m in all.values_mut() {
        let gone: Vec<u64> = m.ranges.range(ptr.0..end).map(|(&a, _)| a).collect();
        for a in gone {
            m.ranges.remove(&a);
        }
    }
    Ok(())
}

/// An IPC handle for the allocation containing `ptr` (`cuIpcGetMemHandle`),
/// for another process to open. Works for `cuMemAlloc` memory (plain
/// segments); the driver refuses memory of the virtual memory API
/// (expandable segments).
pub fn ipc_mem_handle(ptr: DevicePtr) -> Result<[u8; 64], DeviceError> {
    let mut h = ffi::CuIpcMemHandle([0; 64]);
    check(
        // SAFETY: the driver writes 64 bytes into `h`, a valid local, or fails.
        unsafe { ffi::cuIpcGetMemHandle(&mut h, ptr.0) },
        "cuIpcGetMemHandle",
    )?;
    Ok(h.0)
}

/// Queues a fill of `words` 32-bit words at `ptr` with `value` on `stream`.
///
/// # Safety
/// `[ptr, ptr + 4·words)` is device memory the caller owns, and no other
/// stream uses it concurrently (the write would race with it).
pub unsafe fn memset_d32_async(
    ptr: DevicePtr,
    value: u32,
    words: usize,
    stream: StreamId,
) -> Result<(), DeviceError> {
    let h = stream_handle(stream)?;
    check(
        // SAFETY: the caller guarantees the range is owned device memory; `h` is
        // a live stream (see `stream_handle`).
        unsafe { ffi::cuMemsetD32Async(ptr.0, value, words, h) },
        "cuMemsetD32Async",
    )
}

/// Queues a fill of `halves` 16-bit values at `ptr` with `value` on `stream`.
///
/// # Safety
/// As [`memset_d32_async`], for `[ptr, ptr + 2·halves)`.
pub unsafe fn memset_d16_async(
    ptr: DevicePtr,
    value: u16,
    halves: usize,
    stream: StreamId,
) -> Result<(), DeviceError> {
    let h = stream_handle(stream)?;
    check(
        // SAFETY: the caller guarantees the range is owned device memory; `h` is
        // a live stream (see `stream_handle`).
        unsafe { ffi::cuMemsetD16Async(ptr.0, value, halves, h) },
        "cuMemsetD16Async",
    )
}

/// Queues a fill of `bytes` bytes at `ptr` with `value` on `stream`.
///
/// # Safety
/// As [`memset_d32_async`], for `[ptr, ptr + bytes)`.
pub unsafe fn memset_d8_async(
    ptr: DevicePtr,
    value: u8,
    bytes: usize,
    stream: StreamId,
) -> Result<(), DeviceError> {
    let h = stream_handle(stream)?;
    check(
        // SAFETY: the caller guarantees the range is owned device memory; `h` is
        // a live stream (see `stream_handle`).
        unsafe { ffi::cuMemsetD8Async(ptr.0, value, bytes, h) },
        "cuMemsetD8Async",
    )
}

/// Queues a copy of `bytes` host bytes at `src` to `dst` on `stream`.
///
/// # Safety
/// `src` is readable for `bytes` bytes and stays valid and unmodified until
/// the copy completed (page-locked host memory is read asynchronously);
/// `dst` is owned device memory of at least `bytes` bytes.
pub unsafe fn memcpy_htod_async(
    dst: DevicePtr,
    src: *const u8,
    bytes: usize,
    stream: StreamId,
) -> Result<(), DeviceError> {
    let h = stream_handle(stream)?;
    check(
        // SAFETY: the caller guarantees both ranges per the contract above; `h`
        // is a live stream (see `stream_handle`).
        unsafe { ffi::cuMemcpyHtoDAsync_v2(dst.0, src.cast::<c_void>(), bytes, h) },
        "cuMemcpyHtoDAsync_v2",
    )
}

/// Queues a copy of `bytes` bytes at device address `src` to host `dst` on `stream`.
///
/// # Safety
/// `dst` is writable for `bytes` bytes, not otherwise accessed until the copy
/// completed, and the bytes written form valid values of whatever type the
/// caller reads them as; `src` is device memory of at least `bytes` bytes.
pub unsafe fn memcpy_dtoh_async(
    dst: *mut u8,
    src: DevicePtr,
    bytes: usize,
    stream: StreamId,
) -> Result<(), DeviceError> {
    let h = stream_handle(stream)?;
    check(
        // SAFETY: the caller guarantees both ranges per the contract above; `h`
        // is a live stream (see `stream_handle`).
        unsafe { ffi::cuMemcpyDtoHAsync_v2(dst.cast::<c_void>(), src.0, bytes, h) },
        "cuMemcpyDtoHAsync_v2",
    )
}

/// Copies `bytes` from `src` to `dst` (device memory, both) and waits for
/// the device to finish it (`cuMemcpyDtoD_v2` does not wait on the host).
///
/// # Safety
/// Both ranges are mapped device memory of at least `bytes` bytes that no
/// queued work touches, and the bytes written at `dst` are not in use.
pub unsafe fn memcpy_dtod(dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<(), DeviceError> {
    check(
        // SAFETY: the caller guarantees both ranges per the contract above.
        unsafe { ffi::cuMemcpyDtoD_v2(dst.0, src.0, bytes) },
        "cuMemcpyDtoD_v2",
    )?;
    ctx_synchronize()
}

/// Reads `words` 32-bit words at `src` on `stream` and waits for them.
///
/// # Safety
/// `src` is device memory of at least `4·words` bytes.
pub unsafe fn read_u32(
    src: DevicePtr,
    words: usize,
    stream: StreamId,
) -> Result<Vec<u32>, DeviceError> {
    let mut v = vec![0u32; words];
    // SAFETY: `v` is a live, exclusively borrowed host buffer of 4·words
    // bytes, every bit pattern is a valid u32, and we synchronise before it
    // is read or dropped.
    unsafe { memcpy_dtoh_async(v.as_mut_ptr().cast::<u8>(), src, words * 4, stream)? };
    stream_synchronize(stream)?;
    Ok(v)
}

/// Blocks until all work queued on `stream` completed.
pub fn stream_synchronize(stream: StreamId) -> Result<(), DeviceError> {
    let h = stream_handle(stream)?;
    check(
        // SAFETY: `h` is a live stream (see `stream_handle`).
        unsafe { ffi::cuStreamSynchronize(h) },
        "cuStreamSynchronize",
    )
}

/// Blocks until all work of the current context completed.
pub fn ctx_synchronize() -> Result<(), DeviceError> {
    // SAFETY: no arguments.
    check(unsafe { ffi::cuCtxSynchronize() }, "cuCtxSynchronize")
}

/// A non-blocking stream (`CU_STREAM_NON_BLOCKING`: no implicit
/// synchronisation with the legacy default stream) on a device's primary
/// context, destroyed on drop.
///
/// The stream holds its own retain of the primary context, so it stays valid
/// (and is destroyed safely) even when the [`CudaDevice`] or allocator it was
/// made with is dropped first.
#[derive(Debug)]
pub struct Stream {
    raw: ffi::CuStream,
    dev: ffi::CuDevice,
}

// SAFETY: a CUstream handle may be used from any thread of the process (the
// driver API is thread-safe); the handle is only passed to driver calls.
unsafe impl Send for Stream {}
// SAFETY: as above; `&Stream` only exposes the handle value and synchronisation.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a non-blocking stream on `device`'s primary context.
    pub fn new(device: &CudaDevice) -> Result<Stream, DeviceError> {
        let _ctx = device.enter()?;
        let dev = device.raw_device();
        let mut ctx: ffi::CuContext = ptr::null_mut();
        check(
            // SAFETY: writes one context handle into a valid local; balanced by
            // the release in Drop (or just below on failure).
            unsafe { ffi::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
            "cuDevicePrimaryCtxRetain",
        )?;
        let mut raw: ffi::CuStream = ptr::null_mut();
        // SAFETY: writes one stream handle into a valid local; the primary
        // context is current (guard above).
        let rc = unsafe { ffi::cuStreamCreate(&mut raw, ffi::CU_STREAM_NON_BLOCKING) };
        if let Err(e) = check(rc, "cuStreamCreate") {
            // SAFETY: balances the retain above.
            unsafe { ffi::cuDevicePrimaryCtxRelease_v2(dev) };
            return Err(e);
        }
        let stream = Stream { raw, dev };
        // SAFETY: the stream was just created and stays live until `Drop`,
        // which unregisters it before destroying it.
        unsafe { register_stream(stream.id()) };
        Ok(stream)
    }

    /// The stream as the allocator names it (the `CUstream` pointer as an integer).
    pub fn id(&self) -> StreamId {
        StreamId(self.raw as usize as u64)
    }

    /// Blocks until the stream's work completed.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        stream_synchronize(self.id())
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        unregister_stream(self.id());
        // SAFETY: `raw` was created by cuStreamCreate and is destroyed once,
        // while our retain keeps its context alive; the driver lets queued
        // work finish before releasing the stream. Then the retain is balanced.
        unsafe {
            ffi::cuStreamDestroy_v2(self.raw);
            ffi::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only special handles and registered streams become handles; no
    /// driver call is made (this runs without a GPU).
    #[test]
    fn only_registered_streams_become_handles() {
        for special in 0..=SPECIAL_STREAMS {
            assert!(stream_handle(StreamId(special)).is_ok());
        }
        let s = StreamId(0x7f00_dead_b000);
        let e = stream_handle(s).unwrap_err();
        assert!(e.to_string().contains("not a live stream"), "{e}");
        // SAFETY: the handle is never given to the driver in this test.
        unsafe { register_stream(s) };
        assert!(stream_handle(s).is_ok());
        unregister_stream(s);
        assert!(stream_handle(s).is_err());
    }
}
