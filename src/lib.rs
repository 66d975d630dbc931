//! `cachealloc`: a caching CUDA device allocator.
//!
//! The caching algorithm lives in [`cachealloc_core`] (re-exported here as
//! [`core`]); this crate adds trace files on disk, the CUDA device over
//! `cust` (feature `cuda`), the RAII buffer type for Rust tensor code, and the
//! C ABI that PyTorch loads.

// An eager `ok_or(f())` in the allocator lookup ran a driver call on every
// C ABI allocation and free: arguments that call functions are computed lazily.
#![warn(clippy::or_fun_call)]

pub use cachealloc_core as core;
pub use cachealloc_core::{
    AllocError, CachingAllocator, Config, Device, DevicePtr, FragmentationReport, MemoryCap,
    MemoryStats, Released, SimulatedDevice, Snapshot, StreamId,
};

pub mod pickle_trace;
pub mod trace_file;

/// The C ABI (`libcachealloc.so`, feature `cuda`): see the module documentation.
/// Without `cuda` it is compiled for its unit tests only.
#[cfg(any(feature = "cuda", test))]
pub mod capi;

/// The C ABI of PyTorch's full allocator interface (feature `cuda`): see the module documentation.
#[cfg(any(feature = "cuda", test))]
pub mod capi_torch;

#[cfg(feature = "cuda")]
pub mod cuda;
