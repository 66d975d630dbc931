//! The caching allocator on real GPUs (feature `cuda`).
//!
//! - [`CudaDevice`]: the core's [`Device`](cachealloc_core::Device) over the
//!   CUDA driver API, on the device's primary context.
//! - [`allocator`]: the process-wide allocator of device N, created on first
//!   use with the configuration in `CACHEALLOC_CONF`.
//! - [`CachedBuffer`]: an RAII buffer of `T` for Rust tensor code on `cust`.
//! - [`cudarc`] (feature `cudarc`): `CachedSlice`, a buffer that cudarc's
//!   kernel launches, copies and cuBLAS calls take like a `CudaSlice`.
//! - [`driver`]: thin wrappers over the few raw driver calls that tests,
//!   benchmarks and examples need (raw `cuMemAlloc`, the stream-ordered pool,
//!   streams, memsets, copies).
//!
//! ```no_run
//! use cachealloc::cuda::{self, driver::Stream, CachedBuffer};
//! let alloc = cuda::allocator(0)?;
//! alloc.device().bind_thread()?;
//! let stream = Stream::new(alloc.device())?;
//! let mut buf = CachedBuffer::<f32>::zeroed(alloc, 1 << 20, stream.id())?;
//! buf.copy_from_host(&vec![1.0; 1 << 20])?;
//! drop(buf); // back to the cache, reusable at once on `stream`
//! println!("{}", alloc.fragmentation());
//! # Ok::<(), cachealloc::cuda::CudaError>(())
//! ```
//!
//! The driver functions are declared in this crate with `i32` results (see
//! `ffi.rs` for why); the CUDA library is linked through `cust`.

mod buffer;
#[cfg(feature = "cudarc")]
pub mod cudarc;
mod device;
pub mod driver;
mod ffi;
pub mod ipc;

pub use buffer::CachedBuffer;
pub use device::{CudaDevice, CudaEvent};

use cachealloc_core::pytorch_conf::PytorchConfError;
use cachealloc_core::{AllocError, CachingAllocator, Config, ConfigError, DeviceError};
use std::fmt;
use std::sync::{Mutex, OnceLock};

/// The environment variable holding the allocator configuration
/// (`key:value,…`, optionally starting with a preset name; see [`Config::parse`]).
pub const CONF_ENV: &str = "CACHEALLOC_CONF";

/// Devices the registry can hold: the C ABI's ordinals ([`crate::capi::MAX_DEVICES`]).
const DEVICES: usize = crate::capi::MAX_DEVICES as usize;

/// Why a CUDA-side operation failed.
#[derive(Debug, Clone)]
pub enum CudaError {
    /// A driver call failed (the CUresult name and the call), or the device ran out of memory.
    Device(DeviceError),
    /// The caching allocator refused (out of memory with its report, misuse).
    Alloc(AllocError),
    /// `CACHEALLOC_CONF` does not parse.
    Config {
        /// The variable's value.
        value: String,
        /// What is wrong with it.
        error: ConfigError,
    },
    /// PyTorch's allocator configuration (`PYTORCH_ALLOC_CONF` or
    /// `PYTORCH_CUDA_ALLOC_CONF`) has a value PyTorch refuses.
    PytorchConf {
        /// The variable read.
        var: &'static str,
        /// Its value.
        value: String,
        /// PyTorch's message.
        error: PytorchConfError,
    },
    /// No device with this ordinal.
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: i32,
        /// Devices present.
        count: i32,
    },
    /// A host slice of another length than the buffer.
    LengthMismatch {
        /// Values in the buffer.
        buffer: usize,
        /// Values in the host slice.
        host: usize,
    },
    /// A 32-bit fill of a buffer whose size is not a multiple of 4 bytes.
    NotWordSized {
        /// The buffer's size in bytes.
        bytes: usize,
    },
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaError::Device(e) => write!(f, "CUDA: {e}"),
            CudaError::Alloc(e) => e.fmt(f),
            CudaError::Config { value, error } => {
                write!(
                    f,
                    "{CONF_ENV}={value:?} is not a valid configuration: {error}"
                )
            }
            CudaError::PytorchConf { var, value, error } => {
                write!(f, "{var}={value:?}: {error}")
            }
            CudaError::NoSuchDevice { ordinal, count } => {
                write!(f, "no CUDA device {ordinal} (the driver sees {count})")
            }
            CudaError::LengthMismatch { buffer, host } => write!(
                f,
                "length mismatch: the buffer holds {buffer} values, the host slice {host}"
            ),
            CudaError::NotWordSized { bytes } => {
                write!(
                    f,
                    "a 32-bit fill needs a multiple of 4 bytes, the buffer has {bytes}"
                )
            }
        }
    }
}

impl std::error::Error for CudaError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CudaError::Device(e) => Some(e),
            CudaError::Alloc(e) => Some(e),
            CudaError::Config { error, .. } => Some(error),
            CudaError::PytorchConf { error, .. } => Some(error),
            _ => None,
        }
    }
}

impl From<DeviceError> for CudaError {
    fn from(e: DeviceError) -> Self {
        CudaError::Device(e)
    }
}

impl From<AllocError> for CudaError {
    fn from(e: AllocError) -> Self {
        match e {
            AllocError::Device(d) => CudaError::Device(d),
            other => CudaError::Alloc(other),
        }
    }
}

/// PyTorch's allocator configuration variables, in the order they are read.
pub const PYTORCH_CONF_ENV: [&str; 2] = ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"];

/// PyTorch's allocator configuration: the first of [`PYTORCH_CONF_ENV`]
/// that is set, with its name.
pub fn pytorch_conf_from_env() -> Option<(&'static str, String)> {
    PYTORCH_CONF_ENV
        .iter()
        .find_map(|&var| std::env::var_os(var).map(|v| (var, v.to_string_lossy().into_owned())))
}

/// The configuration from `CACHEALLOC_CONF` (the default policy when unset
/// or empty), with PyTorch's own settings from `PYTORCH_ALLOC_CONF` (or its
/// older name `PYTORCH_CUDA_ALLOC_CONF`) where `CACHEALLOC_CONF` does not
/// set the same key ([`cachealloc_core::pytorch_conf`]). An invalid PyTorch
/// setting is an error with PyTorch's message.
pub fn config_from_env() -> Result<Config, CudaError> {
    let own = std::env::var_os(CONF_ENV).map(|v| v.to_string_lossy().into_owned());
    let config = match &own {
        None => Config::default(),
        Some(value) => Config::parse(value).map_err(|error| CudaError::Config {
            value: value.clone(),
            error,
        })?,
    };
    let pytorch = pytorch_conf_from_env();
    cachealloc_core::with_pytorch_conf(
        config,
        own.as_deref(),
        pytorch.as_ref().map(|(_, v)| v.as_str()),
    )
    .map_err(|error| {
        let (var, value) = pytorch.expect("an error comes from a string");
        CudaError::PytorchConf { var, value, error }
    })
}

static ALLOCATORS: [OnceLock<CachingAllocator<CudaDevice>>; DEVICES] =
    [const { OnceLock::new() }; DEVICES];
static INIT: Mutex<()> = Mutex::new(());

/// The process-wide caching allocator of device `device`.
///
/// Created on first use (on the device's primary context, configured from
/// `CACHEALLOC_CONF`) and kept for the life of the process; later calls cost
/// one atomic load. A failed creation (no driver, no such device, a bad
/// configuration) is reported and not remembered: a later call tries again.
#[inline]
pub fn allocator(device: i32) -> Result<&'static CachingAllocator<CudaDevice>, CudaError> {
    match existing_allocator(device) {
        Some(a) => Ok(a),
        None => create_allocator(device),
    }
}

/// The allocator of `device` if it was created already: one atomic load, no
/// driver call (the C ABI's lookup on every allocation and free).
#[inline]
pub fn existing_allocator(device: i32) -> Option<&'static CachingAllocator<CudaDevice>> {
    allocator_slot(device).and_then(OnceLock::get)
}

/// The registry's slot of `device`, or `None` for an ordinal outside it.
#[inline]
fn allocator_slot(device: i32) -> Option<&'static OnceLock<CachingAllocator<CudaDevice>>> {
    usize::try_from(device).ok().and_then(|i| ALLOCATORS.get(i))
}

/// [`allocator`] when the device's allocator does not exist yet.
#[cold]
#[inline(never)]
fn create_allocator(device: i32) -> Result<&'static CachingAllocator<CudaDevice>, CudaError> {
    // Lazily: the device count is a driver call (when this lookup ran on
    // every C ABI call, it cost ~0.5 µs each).
    let slot = allocator_slot(device).ok_or_else(|| CudaError::NoSuchDevice {
        ordinal: device,
        count: driver::device_count().unwrap_or(0),
    })?;
    // One creation at a time, so that a device is never initialised twice;
    // another thread may have created it since `allocator` looked.
    let _guard = INIT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(a) = slot.get() {
        return Ok(a);
    }
    let config = config_from_env()?;
    let dev = CudaDevice::new(device)?;
    let alloc = CachingAllocator::new(dev, config);
    // E.g. expandable segments requested on a driver without the VMM API:
    // the allocator falls back to plain segments, and says so in its
    // notices (`info_json`). Nothing is printed here: `eprintln!` panics on
    // a closed stderr, and a write that may fail is no way to report; the
    // reason goes to stderr only where the write cannot panic.
    if alloc.config().expandable_segments() && !alloc.is_expandable() {
        if let Err(why) = alloc.device().vmm_support() {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr().lock(),
                "cachealloc (device {device}): virtual memory API unusable: {why}"
            );
        }
    }
    Ok(slot.get_or_init(|| alloc))
}

/// Device 0, for tests, examples and benchmarks that need a GPU: `None`,
/// with the reason printed, when there is no usable CUDA driver or no device,
/// so that they skip instead of failing on machines without a GPU.
pub fn first_device_or_skip() -> Option<CudaDevice> {
    match driver::device_count() {
        Err(e) => {
            println!("skipping: no usable CUDA driver ({e})");
            None
        }
        Ok(0) => {
            println!("skipping: the CUDA driver sees no device");
            None
        }
        Ok(_) => Some(CudaDevice::new(0).expect("device 0")),
    }
}
