//! [`CudaDevice`]: the caching core's [`Device`] over the CUDA driver API.

use super::driver::{self, check, stream_handle, CtxGuard};
use super::{ffi, CudaError};
use cachealloc_core::{Device, DeviceError, DevicePtr, MemInfo, StreamId};
use parking_lot::Mutex;
use std::os::raw::c_char;
use std::ptr;

/// A device of the process, through its **primary context**, so that the
/// pointers it hands out are valid for cust, PyTorch and any runtime-API
/// code of the process (they all use the primary context).
///
/// Segments come from `cuMemAlloc_v2` / `cuMemFree_v2`; events are created
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
        // SAFETY: writes one CUdevice into a valid local; ordinal is in range.
        check(
            unsafe { ffi::cuDeviceGet(&mut dev, ordinal) },
            "cuDeviceGet",
        )?;
        let mut buf = [0 as c_char; 256];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated, into `buf`.
        check(
            unsafe { ffi::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev) },
            "cuDeviceGetName",
        )?;
        let name = buf
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8 as char)
            .collect();
        let mut ctx: ffi::CuContext = ptr::null_mut();
        // SAFETY: writes one context handle into a valid local. The retain is
        // balanced by cuDevicePrimaryCtxRelease_v2 in Drop.
        check(
            unsafe { ffi::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
            "cuDevicePrimaryCtxRetain",
        )?;
        Ok(CudaDevice {
            ordinal,
            dev,
            ctx,
            name,
            events: Mutex::new(Vec::new()),
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

    /// The `CUdevice` handle.
    pub(crate) fn raw_device(&self) -> ffi::CuDevice {
        self.dev
    }

    /// Makes the primary context current for the guard's lifetime.
    pub(crate) fn enter(&self) -> Result<CtxGuard, DeviceError> {
        CtxGuard::enter(self.ctx)
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
        // SAFETY: writes one event handle into a valid local; the caller holds
        // a context guard, so the event belongs to the primary context.
        check(
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
        let _ctx = self.enter()?;
        let ev = self.take_event()?;
        // SAFETY: `ev` is a live event of this context; the stream handle is
        // validated by the driver.
        let rc = unsafe { ffi::cuEventRecord(ev.0, stream_handle(stream)) };
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
        // SAFETY: `event` is a live event created by this device.
        check(
            unsafe { ffi::cuEventSynchronize(event.0) },
            "cuEventSynchronize",
        )
    }

    fn release_event(&self, event: CudaEvent) {
        self.events.lock().push(event);
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        let _ctx = self.enter()?;
        driver::ctx_synchronize()
    }
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
