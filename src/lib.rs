//! `cachealloc`: a caching CUDA device allocator.
//!
//! The caching algorithm lives in [`cachealloc_core`] (re-exported here as
//! [`core`]); this crate adds trace files on disk, the CUDA device over
//! `cust` (feature `cuda`), the RAII buffer type for Rust tensor code, and the
//! C ABI that PyTorch loads.

// An eager `ok_or(f())` in the allocator lookup ran a driver call on every
// C ABI allocation and free: arguments that call functions are computed lazily.
#![warn(clippy::or_fun_call)]
#![warn(missing_docs)]
// Every `unsafe` block says why it is sound.
#![deny(clippy::undocumented_unsafe_blocks)]

pub use cachealloc_core as core;
pub use cachealloc_core::{
    AllocError, CachingAllocator, Config, Device, DevicePtr, FragmentationReport, MemoryCap,
    MemoryStats, Released, SimulatedDevice, Snapshot, StreamId,
};

pub mod trace_file;

/// The C ABI (`libcachealloc.so`, feature `cuda`): see the module documentation.
/// Without `cuda` it is compiled for its unit tests only.
#[cfg(any(feature = "cuda", test))]
pub mod capi;

#[cfg(feature = "cuda")]
pub mod cuda;
