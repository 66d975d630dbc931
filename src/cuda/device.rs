//! [`CudaDevice`]: the caching core's [`Device`] over the CUDA driver API.

use super::driver::{self, check, stream_handle, CtxGuard};
use super::{ffi, CudaError};
use cachealloc_core::{Device, DeviceError, DevicePtr, MemInfo, StreamId};
use parking_lot::Mutex;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::raw::c_char;
use std::ptr;
use std::sync::OnceLock;

/// `CUresult` of a query on the legacy default stream while another stream
/// is being captured in global mode.
const CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: i32 = 906;

/// A device of the process, through its **primary context**, so that the
/// pointers it hands out are valid for cust, PyTorch and any runtime-API
/// code of the process (they all use the primary context).
///
/// Segments come from `cuMemAlloc_v2` / `cuMemFree_v2`. Expandable segments
/// use the virtual memory API: `cuMemAddressReserve`/`cuMemAddressFree` for
/// the ranges, `cuMemCreate`/`cuMemRelease` for physical pages (pinned device
/// memory, shareable as a POSIX file descriptor where the device allows it:
/// [`CudaDevice::pages_shareable`]), `cuMemMap` + `cuMemSetAccess` (read/write for
/// this device) and `cuMemUnmap`. Memory of expandable segments cannot be
/// shared with `cudaIpcGetMemHandle`/`cuIpcGetMemHandle` (the driver refuses
/// VMM allocations there): its pages are exported instead
/// ([`CudaDevice::export_page_fd`]). Events are created
/// with `CU_EVENT_DISABLE_TIMING` and pooled (a freed block guarded by other
/// streams costs a `cuEventRecord`, not a `cuEventCreate`). Every method may
/// be called from any thread: it makes the primary context current on the
/// calling thread first (a `cuCtxGetCurrent` when it already is; see
/// [`CudaDevice::bind_thread`]).
pub struct CudaDevice {
    ordinal: i32,
    dev: ffi::CuDevice,
    ctx: ffi::CuContext,
    name: String,
    events: Mutex<Vec<CudaEvent>>,
    /// The VMM page granularity and whether pages are shareable, or why
    /// the VMM API is unusable; asked once.
    vmm: OnceLock<Result<Vmm, String>>,
    /// Pages exported as POSIX file descriptors (page → descriptor), kept
    /// open until the page is released: another process takes its copy of
    /// a descriptor when it opens a block on the page, which may be any
    /// time before the block is freed.
    exported: Mutex<std::collections::HashMap<u64, OwnedFd>>,
}

/// The environment variable that, set to `0`, creates pages of expandable
/// segments without a shareable handle (no CUDA IPC of their blocks; as
/// before this was possible, in case a driver makes shareable pages slower).
pub const VMM_IPC_ENV: &str = "CACHEALLOC_VMM_IPC";

/// What the virtual memory API offers on a device.
#[derive(Clone, Debug)]
struct Vmm {
    granularity: u64,
    /// `Ok` when pages are created shareable as POSIX file descriptors;
    /// else why not (blocks of expandable segments cannot be shared then).
    shareable: Result<(), String>,
}

// SAFETY: the driver API is thread-safe; the context handle is only passed to
// driver calls, and the event free list is behind a mutex.
unsafe impl Send for CudaDevice {}
// SAFETY: as above: `&CudaDevice` methods only make driver calls on handles
// the device owns, and lock the event list to touch it.
unsafe impl Sync for CudaDevice {}

/// A CUDA event (`CUevent`) recorded by [`CudaDevice::record_event`].
///
/// Given back with [`Device::release_event`], it returns to the device's
/// pool. One dropped instead is leaked (a few hundred bytes of driver state).
#[derive(Debug)]
pub struct CudaEvent(ffi::CuEvent);

// SAFETY: a CUevent handle may be used from any thread; this wrapper only
// passes it to driver calls.
unsafe impl Send for CudaEvent {}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Initialises the driver and retains the primary context of device `ordinal`.
    pub fn new(ordinal: i32) -> Result<CudaDevice, CudaError> {
        let count = driver::device_count()?;
        if ordinal < 0 || ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let mut dev: ffi::CuDevice = 0;
        check(
            // SAFETY: writes one CUdevice into a valid local; ordinal is in range.
            unsafe { ffi::cuDeviceGet(&mut dev, ordinal) },
            "cuDeviceGet",
        )?;
        let mut buf = [0 as c_char; 256];
        check(
            // SAFETY: the driver writes at most `len` bytes, NUL-terminated, into `buf`.
            unsafe { ffi::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev) },
            "cuDeviceGetName",
        )?;
        let name = buf
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8 as char)
            .collect();
        let mut ctx: ffi::CuContext = ptr::null_mut();
        check(
            // SAFETY: writes one context handle into a valid local. The retain is
            // balanced by cuDevicePrimaryCtxRelease_v2 in Drop.
            unsafe { ffi::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
            "cuDevicePrimaryCtxRetain",
        )?;
        Ok(CudaDevice {
            ordinal,
            dev,
            ctx,
            name,
            events: Mutex::new(Vec::new()),
            vmm: OnceLock::new(),
            exported: Mutex::new(std::collections::HashMap::new()),
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The device's name as the driver reports it (e.g. `NVIDIA H100 80GB HBM3`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The primary context handle (`CUcontext`) as an integer.
    pub fn context_handle(&self) -> usize {
        self.ctx as usize
    }

    /// Makes the primary context current on the calling thread and leaves it
    /// so (like `cudaSetDevice`). Needed only before calling the functions of
    /// [`super::driver`] directly; the allocator's calls do it themselves.
    pub fn bind_thread(&self) -> Result<(), DeviceError> {
        // SAFETY: `ctx` is the primary context this device retained.
        check(unsafe { ffi::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    /// Lets device `peer` read and write this device's expandable-segment
    /// pages, mapped now and later (`cuMemSetAccess`): what
    /// `cudaDeviceEnablePeerAccess` gives `cuMemAlloc` memory, which pages of
    /// the virtual memory API do not get from it. Idempotent; every
    /// allocator of this device's pages is covered. Fails if the driver
    /// refuses (e.g. devices without a peer link); the peer is then not
    /// recorded, and pages mapped later are not granted to it.
    pub fn enable_peer_access(&self, peer: i32) -> Result<(), DeviceError> {
        let _ctx = self.enter()?;
        driver::enable_peer_access(self.ordinal, peer)
    }

    /// The `CUdevice` handle.
    pub(crate) fn raw_device(&self) -> ffi::CuDevice {
        self.dev
    }

    /// Makes the primary context current for the guard's lifetime.
    pub(crate) fn enter(&self) -> Result<CtxGuard, DeviceError> {
        CtxGuard::enter(self.ctx)
    }

    /// The page granularity of the virtual memory API on this device, or why
    /// that API cannot be used (no VMM support, or a driver error). Asked of
    /// the driver once; [`Device::vmm_granularity`] is its `Ok` value.
    ///
    /// This is `CU_MEM_ALLOC_GRANULARITY_MINIMUM`, not `…_RECOMMENDED`:
    /// the allocator's pages are its unit of recycling (small-pool pages are
    /// exactly one granule), so the finest legal size keeps idle memory
    /// lowest; larger pages for the large pool, where fewer map calls matter,
    /// are chosen by `Config::expandable_page`. On H100/H200 both are 2 MiB
    /// (`benches/gpu_vmm.rs` prints them).
    pub fn vmm_support(&self) -> Result<u64, String> {
        self.vmm_info()
            .as_ref()
            .map(|v| v.granularity)
            .map_err(Clone::clone)
    }

    /// Whether pages of expandable segments are created shareable (as POSIX
    /// file descriptors, `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`), so that
    /// their blocks can be shared with other processes (CUDA IPC); if not,
    /// why. Probed once with the virtual memory API ([`Self::vmm_support`]):
    /// the device attribute, then a trial page created shareable, exported,
    /// mapped and given back. A device or driver that refuses any step gets
    /// plain pages, as before, and only sharing their blocks is refused.
    /// `CACHEALLOC_VMM_IPC=0` turns shareable pages off.
    pub fn pages_shareable(&self) -> Result<(), String> {
        match self.vmm_info() {
            Ok(v) => v.shareable.clone(),
            Err(why) => Err(why.clone()),
        }
    }

    fn vmm_info(&self) -> &Result<Vmm, String> {
        self.vmm.get_or_init(|| {
            let _ctx = self.enter().map_err(|e| e.to_string())?;
            match driver::vmm_supported(self.ordinal) {
                Ok(true) => {}
                Ok(false) => {
                    return Err(
                        "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0".into(),
                    )
                }
                Err(e) => return Err(e.to_string()),
            }
            let g = match driver::allocation_granularity(self.ordinal, false) {
                Ok(g) if g > 0 && g.is_power_of_two() => g,
                Ok(g) => return Err(format!("unusable allocation granularity {g}")),
                Err(e) => return Err(e.to_string()),
            };
            // One trial map: of a shareable page where the device exports
            // them, else (or if that fails) of a plain one.
            let shareable = shareable_pages(self.ordinal).and_then(|()| {
                probe_map(self.ordinal, g, true).map_err(|e| {
                    format!("a trial page created shareable could not be exported or mapped: {e}")
                })
            });
            if shareable.is_err() {
                probe_map(self.ordinal, g, false)
                    .map_err(|e| format!("a trial map failed: {e}"))?;
            }
            Ok(Vmm {
                granularity: g,
                shareable,
            })
        })
    }

    /// A POSIX file descriptor of page `page` (of this device's expandable
    /// segments) for another process to import: exported once, kept open
    /// until the page is released (so every block on the page shares one).
    /// An error where pages are not shareable ([`Self::pages_shareable`]).
    pub fn export_page_fd(&self, page: u64) -> Result<i32, String> {
        self.pages_shareable()
            .map_err(|why| format!("pages of device {} are not shareable: {why}", self.ordinal))?;
        let mut exported = self.exported.lock();
        if let Some(fd) = exported.get(&page) {
            return Ok(fd.as_raw_fd());
        }
        let _ctx = self.enter().map_err(|e| e.to_string())?;
        let fd = super::ipc::export_fd(page).map_err(|e| e.to_string())?;
        let raw = fd.as_raw_fd();
        exported.insert(page, fd);
        Ok(raw)
    }

    /// Pages exported as file descriptors and not released yet (for tests).
    pub fn exported_pages(&self) -> usize {
        self.exported.lock().len()
    }

    /// Events created so far and idle in the pool (for tests).
    pub fn pooled_events(&self) -> usize {
        self.events.lock().len()
    }

    fn take_event(&self) -> Result<CudaEvent, DeviceError> {
        if let Some(e) = self.events.lock().pop() {
            return Ok(e);
        }
        let mut ev: ffi::CuEvent = ptr::null_mut();
        check(
            // SAFETY: writes one event handle into a valid local; the caller holds
            // a context guard, so the event belongs to the primary context.
            unsafe { ffi::cuEventCreate(&mut ev, ffi::CU_EVENT_DISABLE_TIMING) },
            "cuEventCreate",
        )?;
        Ok(CudaEvent(ev))
    }
}

impl Device for CudaDevice {
    type Event = CudaEvent;

    fn allocate(&self, bytes: u64) -> Result<DevicePtr, DeviceError> {
        let _ctx = self.enter()?;
        driver::mem_alloc(bytes)
    }

    fn free(&self, ptr: DevicePtr, _bytes: u64) -> Result<(), DeviceError> {
        let _ctx = self.enter()?;
        // SAFETY: the allocator frees only segments this device allocated, once.
        unsafe { driver::mem_free(ptr) }
    }

    fn mem_info(&self) -> Result<MemInfo, DeviceError> {
        let _ctx = self.enter()?;
        driver::mem_info()
    }

    fn record_event(&self, stream: StreamId) -> Result<CudaEvent, DeviceError> {
        // A stream the allocator was given but nobody registered is refused
        // here, before the driver sees it (the allocator then synchronizes).
        let h = stream_handle(stream)?;
        let _ctx = self.enter()?;
        let ev = self.take_event()?;
        // SAFETY: `ev` is a live event of this context; `h` is a live stream
        // (a special handle, or registered under `register_stream`'s contract).
        let rc = unsafe { ffi::cuEventRecord(ev.0, h) };
        match check(rc, "cuEventRecord") {
            Ok(()) => Ok(ev),
            Err(e) => {
                self.events.lock().push(ev);
                Err(e)
            }
        }
    }

    fn event_completed(&self, event: &CudaEvent) -> Result<bool, DeviceError> {
        let _ctx = self.enter()?;
        // SAFETY: `event` is a live event created by this device.
        match unsafe { ffi::cuEventQuery(event.0) } {
            ffi::CUDA_SUCCESS => Ok(true),
            ffi::CUDA_ERROR_NOT_READY => Ok(false),
            rc => check(rc, "cuEventQuery").map(|()| false),
        }
    }

    fn wait_event(&self, event: &CudaEvent) -> Result<(), DeviceError> {
        let _ctx = self.enter()?;
        check(
            // SAFETY: `event` is a live event created by this device.
            unsafe { ffi::cuEventSynchronize(event.0) },
            "cuEventSynchronize",
        )
    }

    fn stream_wait_event(&self, waiter: StreamId, event: &CudaEvent) -> Result<(), DeviceError> {
        let h = stream_handle(waiter)?;
        let _ctx = self.enter()?;
        check(
            // SAFETY: `event` is a live event created by this device and `h`
            // a live stream (a special handle, or registered under
            // `register_stream`'s contract).
            unsafe { ffi::cuStreamWaitEvent(h, event.0, 0) },
            "cuStreamWaitEvent",
        )
    }

    fn stream_capturing(&self, stream: StreamId) -> bool {
        let Ok(h) = stream_handle(stream) else {
            return false;
        };
        let Ok(_ctx) = self.enter() else {
            return false;
        };
        let mut status: std::os::raw::c_int = 0;
        // SAFETY: `h` is a live stream (a special handle, or registered under
        // `register_stream`'s contract) and `status` a valid out-pointer.
        let rc = unsafe { ffi::cuStreamIsCapturing(h, &mut status) };
        // Active or invalidated: either way still inside the capture. The
        // legacy default stream while another stream is captured in global
        // mode answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: work queued on it
        // would join that capture, so it counts as captured too.
        (rc == 0 && status != 0) || rc == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
    }

    fn release_event(&self, event: CudaEvent) {
        self.events.lock().push(event);
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        let _ctx = self.enter()?;
        driver::ctx_synchronize()
    }

    fn vmm_granularity(&self) -> Option<u64> {
        self.vmm_support().ok()
    }

    fn vmm_reserve(&self, bytes: u64) -> Result<DevicePtr, DeviceError> {
        let g = self
            .vmm_granularity()
            .ok_or(DeviceError::Unsupported("virtual memory reserve"))?;
        let _ctx = self.enter()?;
        driver::mem_address_reserve(bytes, g)
    }

    fn vmm_reserve_at(&self, bytes: u64, hint: DevicePtr) -> Result<DevicePtr, DeviceError> {
        let g = self
            .vmm_granularity()
            .ok_or(DeviceError::Unsupported("virtual memory reserve"))?;
        let _ctx = self.enter()?;
        // A driver that refuses a hint it cannot take, rather than reserving
        // elsewhere, is asked again without one.
        driver::mem_address_reserve_at(bytes, g, hint.0)
            .or_else(|_| driver::mem_address_reserve(bytes, g))
    }

    fn vmm_free_range(&self, ptr: DevicePtr, bytes: u64) -> Result<(), DeviceError> {
        let _ctx = self.enter()?;
        // SAFETY: the allocator frees only ranges this device reserved, whole,
        // once, after unmapping every page in them.
        unsafe { driver::mem_address_free(ptr, bytes) }
    }

    fn vmm_create_page(&self, bytes: u64) -> Result<u64, DeviceError> {
        let shareable = matches!(self.vmm_info(), Ok(v) if v.shareable.is_ok());
        let _ctx = self.enter()?;
        driver::mem_create_with(bytes, self.ordinal, shareable)
    }

    fn vmm_release_page(&self, page: u64) -> Result<(), DeviceError> {
        let _ctx = self.enter()?;
        // SAFETY: the allocator releases only pages this device created, once,
        // and only unmapped ones.
        unsafe { driver::mem_release(page) }?;
        // Its descriptor, if exported, goes with it (closed on drop).
        if let Some(fd) = self.exported.lock().remove(&page) {
            drop(fd);
        }
        Ok(())
    }

    fn vmm_map(&self, ptr: DevicePtr, page: u64, bytes: u64) -> Result<(), DeviceError> {
        let _ctx = self.enter()?;
        driver::mem_map(ptr, page, bytes, self.ordinal)
    }

    fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: u64) -> Result<(), DeviceError> {
        let _ctx = self.enter()?;
        let bytes = usize::try_from(bytes).map_err(|_| DeviceError::Driver {
            name: "CUDA_ERROR_INVALID_VALUE".into(),
            call: "cuMemcpyDtoD_v2",
        })?;
        // SAFETY: the allocator copies only between pages it mapped, after
        // synchronising the device, from live blocks to pages no block uses
        // yet (the trait's contract).
        unsafe { driver::memcpy_dtod(dst, src, bytes) }
    }

    fn vmm_unmap(&self, ptr: DevicePtr, bytes: u64) -> Result<(), DeviceError> {
        let _ctx = self.enter()?;
        // SAFETY: the allocator unmaps whole pages it mapped, and only after
        // the device was synchronised with no block on them in use, so no
        // queued work can still touch them (the trait's contract).
        unsafe { driver::mem_unmap(ptr, bytes) }
    }
}

/// Whether pages may be created shareable: not with `CACHEALLOC_VMM_IPC=0`,
/// nor on a device without POSIX file descriptor handles.
fn shareable_pages(ordinal: i32) -> Result<(), String> {
    if std::env::var_os(VMM_IPC_ENV).is_some_and(|v| v == "0") {
        return Err(format!("{VMM_IPC_ENV}=0"));
    }
    match super::ipc::posix_fd_supported(ordinal) {
        Ok(true) => Ok(()),
        Ok(false) => {
            Err("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0".into())
        }
        Err(e) => Err(e.to_string()),
    }
}

/// Reserves one granule of address space, creates a page (`shareable`: with
/// a POSIX file descriptor handle, which is exported and closed), maps it,
/// makes it accessible and gives everything back: a device or driver that
/// reports the virtual memory API but refuses to use it (some virtualised
/// GPUs) is found here, before `default` would rely on it.
fn probe_map(ordinal: i32, g: u64, shareable: bool) -> Result<(), DeviceError> {
    let range = driver::mem_address_reserve(g, g)?;
    let mapped = driver::mem_create_with(g, ordinal, shareable).and_then(|page| {
        let exported = if shareable {
            super::ipc::export_fd(page).map(drop)
        } else {
            Ok(())
        };
        let mapped = exported
            .and_then(|()| driver::mem_map(range, page, g, ordinal))
            .and_then(|()| {
                // SAFETY: the page was mapped just above and no work was queued on it.
                unsafe { driver::mem_unmap(range, g) }
            });
        // SAFETY: the page was created above, is unmapped, and is released once.
        let released = unsafe { driver::mem_release(page) };
        mapped.and(released)
    });
    // SAFETY: the range was reserved above, whole, and nothing is mapped in it.
    let freed = unsafe { driver::mem_address_free(range, g) };
    mapped.and(freed)
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if let Ok(_ctx) = self.enter() {
            for ev in self.events.get_mut().drain(..) {
                // SAFETY: pooled events are idle (given back after completion)
                // and destroyed once.
                unsafe { ffi::cuEventDestroy_v2(ev.0) };
            }
        }
        // SAFETY: balances the cuDevicePrimaryCtxRetain of `new`.
        unsafe { ffi::cuDevicePrimaryCtxRelease_v2(self.dev) };
    }
}
