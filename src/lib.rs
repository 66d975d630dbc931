//! `cachealloc`: a caching CUDA device allocator.
//!
//! Device memory is taken from the driver in segments and handed out in
//! blocks; freed blocks stay cached for the next request of their stream, so
//! steady-state allocation makes no driver call. The policy is PyTorch's
//! (size classes, block splitting, `record_stream`, `empty_cache`,
//! `max_split_size_mb`, expandable segments) with less fragmentation, an
//! out-of-memory error that says where the memory is, and PyTorch's
//! statistics. The algorithm lives in [`cachealloc_core`] (re-exported here as
//! [`core`]); this crate adds the CUDA device, buffer types for Rust tensor
//! code, the C ABI that PyTorch loads, trace files and the command-line tool.
//!
//! # Features
//!
//! | feature | default | what |
//! |---|---|---|
//! | `cli` | yes | the `cachealloc` command-line tool (clap, plots, JSON output) |
//! | `cuda` | | the allocator on real GPUs over `cust`, `CachedBuffer`, the C ABI |
//! | `cudarc` | | `CachedSlice`: buffers for code built on `cudarc` |
//! | `half` | | `half::f16` / `half::bf16` elements of `CachedSlice` |
//!
//! A library user needs no CLI:
//! `cachealloc = { version = "0.1", default-features = false, features = ["cuda"] }`
//! (add `"cudarc"` for cudarc). Without `cuda`, the allocator runs on a
//! simulated device: policy studies and tests need no GPU.
//!
//! # Ways in
//!
//! ## Rust on the simulated device
//!
//! ```
//! use cachealloc::{CachingAllocator, Config, SimulatedDevice, StreamId};
//! let alloc = CachingAllocator::new(SimulatedDevice::new(16 << 30), Config::default());
//! let p = alloc.malloc(1 << 20, StreamId(0))?;
//! alloc.free(p)?;
//! assert_eq!(alloc.stats().allocated_bytes.all().current, 0);
//! # Ok::<(), cachealloc::AllocError>(())
//! ```
//!
//! ## Rust via `cust` (feature `cuda`)
//!
//! One allocator per device, on its primary context (so pointers are valid
//! for cust, cudarc, PyTorch and runtime-API code alike), configured from
//! `CACHEALLOC_CONF`; `CachedBuffer` gives its
//! memory back to the cache on drop.
//!
#![cfg_attr(feature = "cuda", doc = "```no_run")]
#![cfg_attr(not(feature = "cuda"), doc = "```ignore")]
//! use cachealloc::cuda::{self, driver::Stream, CachedBuffer};
//! let alloc = cuda::allocator(0)?;
//! alloc.device().bind_thread()?;
//! let stream = Stream::new(alloc.device())?;
//! let mut buf = CachedBuffer::<f32>::zeroed(alloc, 1 << 20, stream.id())?;
//! buf.copy_from_host(&vec![1.0; 1 << 20])?;
//! let ptr = buf.as_device_ptr(); // a cust DevicePointer<f32> for kernel launches
//! drop(buf); // back to the cache, reusable at once on `stream`
//! # Ok::<(), cachealloc::cuda::CudaError>(())
//! ```
//!
//! ## Rust via `cudarc` (feature `cudarc`)
//!
//! `CachedSlice` implements cudarc's
//! `DeviceSlice`, `DevicePtr` and `DevicePtrMut` and is a kernel argument, so
//! it goes to cudarc's launch builder, copies and cuBLAS like a `CudaSlice`;
//! `CachedStream` allocates with the names
//! of cudarc's `CudaStream`. Uses on other streams are ordered and recorded
//! for the caller (the `cuda::cudarc` module says how).
//! `examples/cudarc_mlp.rs` trains an MLP this way.
//!
#![cfg_attr(feature = "cudarc", doc = "```no_run")]
#![cfg_attr(not(feature = "cudarc"), doc = "```ignore")]
//! use cachealloc::cuda::cudarc::CachedStream;
//! use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
//!
//! let ctx = CudaContext::new(0)?;
//! let stream = ctx.new_stream()?;
//! let cache = CachedStream::new(&stream)?;
//! let ptx = cudarc::nvrtc::compile_ptx(
//!     r#"extern "C" __global__ void scale(float* x, float a, int n) {
//!         int i = blockIdx.x * blockDim.x + threadIdx.x;
//!         if (i < n) x[i] *= a;
//!     }"#,
//! )?;
//! let scale = ctx.load_module(ptx)?.load_function("scale")?;
//! let mut x = cache.clone_htod(&[1.0f32, 2.0, 3.0])?;
//! let n = x.len() as i32;
//! let mut launch = stream.launch_builder(&scale);
//! launch.arg(&mut x).arg(&2.0f32).arg(&n);
//! // SAFETY: the kernel touches `n` values of `x`.
//! unsafe { launch.launch(LaunchConfig::for_num_elems(3)) }?;
//! assert_eq!(x.to_vec()?, [2.0, 4.0, 6.0]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## PyTorch
//!
//! `libcachealloc.so` (built with `--features cuda`) is loaded through
//! `torch.cuda.memory.CUDAPluggableAllocator` by `python/cachealloc_torch.py`;
//! statistics, snapshots and fragmentation come from that module
//! (`docs/PYTORCH.md`):
//!
//! ```python
//! import cachealloc_torch as ca   # python/cachealloc_torch.py
//! ca.enable()                     # before CUDA is first used; CACHEALLOC_CONF configures it
//! # ... train ...
//! print(ca.memory_summary())
//! ```
//!
//! ## Command line (feature `cli`)
//!
//! Replays allocation traces (recorded from PyTorch or by the C ABI) on a
//! simulated device to compare policies before a run depends on them:
//!
//! ```text
//! cachealloc replay traces/nmt.trace.gz --config pytorch
//! cachealloc compare traces/*.trace.gz
//! cachealloc min-capacity traces/nmt.trace.gz
//! ```

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

pub mod pickle_trace;
pub mod trace_file;

/// The C ABI (`libcachealloc.so`, feature `cuda`): see the module documentation.
/// Without `cuda` it is compiled for its unit tests only.
#[cfg(any(feature = "cuda", test))]
pub mod capi;

/// The C ABI of PyTorch's full allocator interface (feature `cuda`): see the module documentation.
#[cfg(any(feature = "cuda", test))]
pub mod capi_torch;

/// The header and the Python tables checked against the two C ABIs.
#[cfg(test)]
mod abi_tests;

#[cfg(feature = "cuda")]
pub mod cuda;
