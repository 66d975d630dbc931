//! `cachealloc-core`: the caching algorithm of cachealloc, generic over a device.
//!
//! A [`CachingAllocator`] answers device-memory requests from a cache of
//! blocks carved out of a few large device segments, so that almost no
//! request reaches the driver. It rounds requests to 512 bytes, keeps free
//! blocks in two-level segregated-fit bins per stream and pool (exact best
//! fit in O(1) class lookups), splits and merges blocks inside segments,
//! defers reuse of blocks other streams used until their events complete,
//! returns free segments on [`CachingAllocator::empty_cache`], and flushes
//! and retries before it reports out-of-memory with an explanation.
//!
//! The crate has no `unsafe` and no CUDA: the [`Device`] trait is the only
//! way to the hardware, and [`SimulatedDevice`] implements it for tests and
//! trace replay.
//!
//! ```
//! use cachealloc_core::{CachingAllocator, Config, SimulatedDevice, StreamId};
//! let device = SimulatedDevice::new(1 << 30);
//! let alloc = CachingAllocator::new(device.clone(), Config::default());
//! let p = alloc.malloc(1000, StreamId(0)).unwrap();
//! alloc.free(p).unwrap();
//! let q = alloc.malloc(1000, StreamId(0)).unwrap();
//! assert_eq!(p, q, "served from the cache");
//! // `default` is expandable segments where the device has the virtual
//! // memory API (the simulated device does): pages mapped, no plain segment.
//! assert!(alloc.is_expandable());
//! assert_eq!(device.counters().allocs, 0);
//! alloc.free(q).unwrap();
//! alloc.empty_cache().unwrap();
//! assert_eq!(device.outstanding(), 0);
//! ```
#![forbid(unsafe_code)]
// An eager `ok_or(f())` in a lookup ran a driver call on every C ABI call once.
#![warn(clippy::or_fun_call)]
#![warn(missing_docs)]

mod addrmap;
mod allocator;
mod arena;
mod bins;
mod block;
mod config;
mod device;
mod error;
mod fasthash;
mod ids;
mod pages;
pub mod pytorch_conf;
pub mod replay;
mod report;
mod rounding;
#[cfg(feature = "testing")]
pub mod sample;
mod simulated;
mod sorted_map;
mod stats;
mod supply;
mod thread_slot;
mod trace;

// Note [Public surface]: each public item has one path. The modules are
// private and their public items re-exported here, except `pytorch_conf`,
// `replay`, `sample` (feature `testing`) and `keys` (the configuration key
// table), whose items are used by their module's path. `docs/ARCHITECTURE.md` ("Public surface") has the item count and
// the command that measures it.
pub use allocator::{BlockBacking, CachingAllocator, Released, TraceSink, Usage};
pub use block::{BlockState, PoolKind};
pub use config::{
    keys, parse_size, with_pytorch_conf, Config, ConfigBuilder, ConfigError, MemoryCap,
    MEDIUM_SEGMENT, SMALL_SIZE,
};
pub use device::{Device, DeviceError, DevicePtr, MemInfo, StreamId};
pub use error::{AllocError, OomReport};
pub use report::{
    human_bytes, BlockSnapshot, FragmentationReport, SegmentSnapshot, SegmentUse, Snapshot,
};
pub use rounding::{round_size, Power2Divisions, MAX_REQUEST, MIN_BLOCK, POWER2_INTERVALS};
/// Feature `testing`: the slab size classes, for the lab's slab studies.
#[cfg(feature = "testing")]
pub use rounding::{round_size_plain, slab_class, SLAB_CLASSES, SLAB_MAX};
pub use simulated::{calls as sim_calls, FaultPlan, SimCounters, SimulatedDevice};
pub use stats::{MemoryStats, Stat, StatArray, STAT_GROUPS};
pub use supply::{CapGroup, SegmentSource};
pub use trace::{TraceError, TraceEvent, TraceReader, TraceWriter};
