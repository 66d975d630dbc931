//! The device trait: everything the caching algorithm needs from a GPU.
//!
//! The core never calls CUDA. It asks a [`Device`] for segments, memory info
//! and stream events; `SimulatedDevice` implements it for tests and trace
//! replay, `CudaDevice` (root crate, feature `cuda`) on the real driver.

use std::fmt;

/// A device address handed out by the allocator or the device.
///
/// It is a plain number on the host side: the host never dereferences it.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The address as an integer.
    pub const fn addr(self) -> u64 {
        self.0
    }
}

impl fmt::Debug for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// An opaque stream handle (`CUstream` as an integer; 0 is the default stream).
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct StreamId(pub u64);

/// Free and total bytes as the driver reports them (`cuMemGetInfo`).
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub struct MemInfo {
    /// Bytes the driver could still hand out.
    pub free: u64,
    /// Bytes of device memory in all.
    pub total: u64,
}

/// Why a device call failed.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum DeviceError {
    /// The device has no memory left for this request (`CUDA_ERROR_OUT_OF_MEMORY`).
    OutOfMemory,
    /// The operation is not available on this device (e.g. no virtual memory API).
    Unsupported(&'static str),
    /// The address was not handed out by this device, or was already freed.
    InvalidAddress(DevicePtr),
    /// Any other driver error, with the driver's name for it (e.g. `CUDA_ERROR_LAUNCH_FAILED`).
    Driver {
        /// The CUresult name.
        name: String,
        /// The call that failed.
        call: &'static str,
    },
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceError::OutOfMemory => write!(f, "device out of memory"),
            DeviceError::Unsupported(what) => write!(f, "not supported by this device: {what}"),
            DeviceError::InvalidAddress(p) => {
                write!(f, "address {p} is not a live device allocation")
            }
            DeviceError::Driver { name, call } => write!(f, "{call} failed: {name}"),
        }
    }
}

impl std::error::Error for DeviceError {}

/// What the caching allocator needs from a device.
///
/// Methods take `&self`: implementations are handles (the simulated device
/// is shared with the test that drives it; the CUDA device is a context).
/// The allocator calls them while holding its own lock, so an implementation
/// needs no locking of its own beyond what its handle requires.
///
/// The virtual-memory methods (`vmm_*`) are optional: the default bodies
/// answer [`DeviceError::Unsupported`], and the allocator then uses plain
/// segments only.
pub trait Device: Send + Sync {
    /// An event recorded on a stream; the allocator keeps it until it completed.
    type Event: Send;

    /// Allocates a segment of `bytes` (a multiple of 512) and returns its address.
    fn allocate(&self, bytes: u64) -> Result<DevicePtr, DeviceError>;
    /// Frees a segment previously returned by [`Device::allocate`].
    fn free(&self, ptr: DevicePtr, bytes: u64) -> Result<(), DeviceError>;
    /// Free and total device memory.
    fn mem_info(&self) -> Result<MemInfo, DeviceError>;
    /// Records an event on `stream` after all work queued there so far.
    fn record_event(&self, stream: StreamId) -> Result<Self::Event, DeviceError>;
    /// Whether the work before `event` has completed (non-blocking).
    fn event_completed(&self, event: &Self::Event) -> Result<bool, DeviceError>;
    /// Blocks until the work before `event` has completed.
    fn wait_event(&self, event: &Self::Event) -> Result<(), DeviceError>;
    /// Makes the work queued on `waiter` from now on wait, on the device,
    /// for the work before `event`; the host goes on. The default waits on
    /// the host instead ([`Device::wait_event`]).
    fn stream_wait_event(&self, waiter: StreamId, event: &Self::Event) -> Result<(), DeviceError> {
        let _ = waiter;
        self.wait_event(event)
    }
    /// Whether `stream` is being captured into a CUDA graph: an event
    /// recorded there would join the graph instead of marking the stream's
    /// work, so the allocator records none there until the capture ends.
    /// The default (and any failure to tell) is `false`.
    fn stream_capturing(&self, stream: StreamId) -> bool {
        let _ = stream;
        false
    }
    /// Gives an event back (a real device pools them).
    fn release_event(&self, event: Self::Event);
    /// Blocks until all work on the device has completed.
    fn synchronize(&self) -> Result<(), DeviceError>;

    /// Physical page granularity of the virtual memory API, or `None` without it.
    fn vmm_granularity(&self) -> Option<u64> {
        None
    }
    /// Reserves `bytes` of virtual address space (no physical memory).
    fn vmm_reserve(&self, _bytes: u64) -> Result<DevicePtr, DeviceError> {
        Err(DeviceError::Unsupported("virtual memory reserve"))
    }
    /// [`Device::vmm_reserve`], at `hint` if that range is free (a plain
    /// allocation there was just freed); elsewhere if not. Keeping the address
    /// keeps the allocator's layout, whose ties go to the lowest address.
    fn vmm_reserve_at(&self, bytes: u64, _hint: DevicePtr) -> Result<DevicePtr, DeviceError> {
        self.vmm_reserve(bytes)
    }
    /// Frees a virtual range reserved by [`Device::vmm_reserve`] (all pages unmapped).
    fn vmm_free_range(&self, _ptr: DevicePtr, _bytes: u64) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("virtual memory free"))
    }
    /// Creates a physical page of `bytes` (a multiple of [`Device::vmm_granularity`]); returns its handle.
    fn vmm_create_page(&self, _bytes: u64) -> Result<u64, DeviceError> {
        Err(DeviceError::Unsupported("physical page create"))
    }
    /// Releases a physical page created by [`Device::vmm_create_page`].
    fn vmm_release_page(&self, _page: u64) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("physical page release"))
    }
    /// Maps `page` (of `bytes`) at `ptr` (inside a reserved range) and makes it accessible.
    fn vmm_map(&self, _ptr: DevicePtr, _page: u64, _bytes: u64) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("map"))
    }
    /// Unmaps the pages mapped in `[ptr, ptr + bytes)`: one page, or several
    /// side by side whose mappings cover the range exactly (as `cuMemUnmap`).
    /// The caller guarantees that no queued work still uses them.
    fn vmm_unmap(&self, _ptr: DevicePtr, _bytes: u64) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("unmap"))
    }
    /// Copies `bytes` of device memory from `src` to `dst` and returns once
    /// the copy is done. The caller guarantees that both ranges are mapped
    /// and that no queued work touches them. Used to move live blocks to
    /// other physical pages under the same addresses.
    fn copy(&self, _dst: DevicePtr, _src: DevicePtr, _bytes: u64) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("device-to-device copy"))
    }
}
