//! The C ABI behind PyTorch's full allocator interface.
//!
//! The C++ allocator of `python/cachealloc_torch/csrc/` subclasses PyTorch's
//! `c10::cuda::CUDACachingAllocator::CUDAAllocator` and calls these functions
//! for every decision. They work on allocator *handles*: the process-wide
//! allocator of a device ([`crate::cuda::allocator`], the one the plain C ABI
//! in [`crate::capi`] uses too) or a private pool's own allocator (one per
//! `torch.cuda.MemPool` / CUDA graph pool, with its own segments).
//!
//! Their C declarations, and the layout constants below, are in
//! `include/cachealloc.h`, generated from this file and `capi.rs` by
//! cbindgen (`cbindgen.toml`); the C++ allocator includes it, and a test
//! fails when it is stale (`src/abi_tests.rs`).
//!
//! Note [The statistics vector]: `cachealloc_torch_stats` writes
//! `CACHEALLOC_STATS_LEN` values in the order of PyTorch's `DeviceStats`:
//! the nine stat arrays (allocation, segment, active, inactive_split,
//! allocated_bytes, reserved_bytes, active_bytes, inactive_split_bytes,
//! requested_bytes), each `CACHEALLOC_STAT_ARRAY_LEN` slots: the
//! aggregate, the small pool and the large pool (PyTorch's `StatType`
//! order), each `CACHEALLOC_STAT_FIELDS` slots: current, peak,
//! allocated, freed. Then oversize_allocations and oversize_segments (one
//! statistic each), then the counters num_alloc_retries, num_ooms,
//! num_sync_all_streams, num_device_alloc, num_device_free, and last
//! max_split_size (-1: unlimited). Every position has a named constant
//! (`CACHEALLOC_STATS_*` for where a statistic starts, `CACHEALLOC_STAT_*`
//! for the offsets inside one); the C++ allocator and the Python package
//! (`_abi.py`, generated from the header) use the names, never the numbers.
//! `stat_names` gives the `memory_stats()` key of every slot.
//!
//! Note [The snapshot words]: `cachealloc_torch_snapshot` writes, per
//! segment, `CACHEALLOC_SEGMENT_WORDS` words (offsets
//! `CACHEALLOC_SEGMENT_*`), followed by `CACHEALLOC_BLOCK_WORDS` words
//! per block (offsets `CACHEALLOC_BLOCK_*`, state one of
//! `CACHEALLOC_BLOCK_STATE_*`).
//!
//! Every function catches panics; errors are return values plus the calling
//! thread's last error.

use cachealloc_core::{
    AllocError, BlockState, CachingAllocator, Config, Device, DevicePtr, MemoryStats, PoolKind,
    Snapshot, StreamId,
};

// ---- The statistics vector: Note [The statistics vector] ----------------

/// Offset of a statistic's current value.
pub const CACHEALLOC_STAT_CURRENT: usize = 0;
/// Offset of a statistic's peak.
pub const CACHEALLOC_STAT_PEAK: usize = 1;
/// Offset of a statistic's total allocated (accumulated).
pub const CACHEALLOC_STAT_ALLOCATED: usize = 2;
/// Offset of a statistic's total freed (accumulated).
pub const CACHEALLOC_STAT_FREED: usize = 3;
/// Slots per statistic: current, peak, allocated, freed.
pub const CACHEALLOC_STAT_FIELDS: usize = 4;

/// Statistic of a stat array for all pools together (PyTorch's `StatType::AGGREGATE`).
pub const CACHEALLOC_STAT_AGGREGATE: usize = 0;
/// Statistic of a stat array for the small pool (`StatType::SMALL_POOL`).
pub const CACHEALLOC_STAT_SMALL_POOL: usize = 1;
/// Statistic of a stat array for the large pool (`StatType::LARGE_POOL`).
pub const CACHEALLOC_STAT_LARGE_POOL: usize = 2;
/// Statistics per stat array (aggregate, small pool, large pool).
pub const CACHEALLOC_STAT_GROUPS: usize = 3;
/// Slots per stat array.
pub const CACHEALLOC_STAT_ARRAY_LEN: usize = 12;

/// Where the stat array `allocation` starts.
pub const CACHEALLOC_STATS_ALLOCATION: usize = 0;
/// Where the stat array `segment` starts.
pub const CACHEALLOC_STATS_SEGMENT: usize = 12;
/// Where the stat array `active` starts.
pub const CACHEALLOC_STATS_ACTIVE: usize = 24;
/// Where the stat array `inactive_split` starts.
pub const CACHEALLOC_STATS_INACTIVE_SPLIT: usize = 36;
/// Where the stat array `allocated_bytes` starts.
pub const CACHEALLOC_STATS_ALLOCATED_BYTES: usize = 48;
/// Where the stat array `reserved_bytes` starts.
pub const CACHEALLOC_STATS_RESERVED_BYTES: usize = 60;
/// Where the stat array `active_bytes` starts.
pub const CACHEALLOC_STATS_ACTIVE_BYTES: usize = 72;
/// Where the stat array `inactive_split_bytes` starts.
pub const CACHEALLOC_STATS_INACTIVE_SPLIT_BYTES: usize = 84;
/// Where the stat array `requested_bytes` starts.
pub const CACHEALLOC_STATS_REQUESTED_BYTES: usize = 96;
/// Number of stat arrays.
pub const CACHEALLOC_STAT_ARRAYS: usize = 9;
/// Where the statistic `oversize_allocations` starts (one statistic, no pools).
pub const CACHEALLOC_STATS_OVERSIZE_ALLOCATIONS: usize = 108;
/// Where the statistic `oversize_segments` starts (one statistic, no pools).
pub const CACHEALLOC_STATS_OVERSIZE_SEGMENTS: usize = 112;
/// The counter `num_alloc_retries` (accumulated).
pub const CACHEALLOC_STATS_NUM_ALLOC_RETRIES: usize = 116;
/// The counter `num_ooms` (accumulated).
pub const CACHEALLOC_STATS_NUM_OOMS: usize = 117;
/// The counter `num_sync_all_streams` (accumulated).
pub const CACHEALLOC_STATS_NUM_SYNC_ALL_STREAMS: usize = 118;
/// The counter `num_device_alloc` (accumulated).
pub const CACHEALLOC_STATS_NUM_DEVICE_ALLOC: usize = 119;
/// The counter `num_device_free` (accumulated).
pub const CACHEALLOC_STATS_NUM_DEVICE_FREE: usize = 120;
/// `max_split_size` in bytes, -1 when unlimited (a setting, not accumulated; the last slot).
pub const CACHEALLOC_STATS_MAX_SPLIT_SIZE: usize = 121;
/// Length of the statistics vector.
pub const CACHEALLOC_STATS_LEN: usize = 122;

/// The stat arrays with the slot where each starts, in the vector's order.
pub const STAT_ARRAY_STARTS: [(&str, usize); CACHEALLOC_STAT_ARRAYS] = [
    ("allocation", CACHEALLOC_STATS_ALLOCATION),
    ("segment", CACHEALLOC_STATS_SEGMENT),
    ("active", CACHEALLOC_STATS_ACTIVE),
    ("inactive_split", CACHEALLOC_STATS_INACTIVE_SPLIT),
    ("allocated_bytes", CACHEALLOC_STATS_ALLOCATED_BYTES),
    ("reserved_bytes", CACHEALLOC_STATS_RESERVED_BYTES),
    ("active_bytes", CACHEALLOC_STATS_ACTIVE_BYTES),
    (
        "inactive_split_bytes",
        CACHEALLOC_STATS_INACTIVE_SPLIT_BYTES,
    ),
    ("requested_bytes", CACHEALLOC_STATS_REQUESTED_BYTES),
];

/// The single statistics (no pools) with the slot where each starts.
pub const STAT_SINGLE_STARTS: [(&str, usize); 2] = [
    (
        "oversize_allocations",
        CACHEALLOC_STATS_OVERSIZE_ALLOCATIONS,
    ),
    ("oversize_segments", CACHEALLOC_STATS_OVERSIZE_SEGMENTS),
];

/// The counters (one slot each) with their slots.
pub const STAT_COUNTERS: [(&str, usize); 6] = [
    ("num_alloc_retries", CACHEALLOC_STATS_NUM_ALLOC_RETRIES),
    ("num_ooms", CACHEALLOC_STATS_NUM_OOMS),
    (
        "num_sync_all_streams",
        CACHEALLOC_STATS_NUM_SYNC_ALL_STREAMS,
    ),
    ("num_device_alloc", CACHEALLOC_STATS_NUM_DEVICE_ALLOC),
    ("num_device_free", CACHEALLOC_STATS_NUM_DEVICE_FREE),
    ("max_split_size", CACHEALLOC_STATS_MAX_SPLIT_SIZE),
];

/// The names of a statistic's fields, at their offsets.
const FIELD_NAMES: [&str; CACHEALLOC_STAT_FIELDS] = ["current", "peak", "allocated", "freed"];
/// The names of a stat array's statistics, at their offsets.
const GROUP_NAMES: [&str; CACHEALLOC_STAT_GROUPS] = ["all", "small_pool", "large_pool"];

/// The `torch.cuda.memory_stats()` key of every slot of the statistics
/// vector (`allocation.all.current`, …, `max_split_size`).
pub fn stat_names() -> Vec<String> {
    let mut names = vec![String::new(); CACHEALLOC_STATS_LEN];
    for (array, start) in STAT_ARRAY_STARTS {
        for (g, group) in GROUP_NAMES.iter().enumerate() {
            for (f, field) in FIELD_NAMES.iter().enumerate() {
                names[start + g * CACHEALLOC_STAT_FIELDS + f] = format!("{array}.{group}.{field}");
            }
        }
    }
    for (stat, start) in STAT_SINGLE_STARTS {
        for (f, field) in FIELD_NAMES.iter().enumerate() {
            names[start + f] = format!("{stat}.{field}");
        }
    }
    for (counter, slot) in STAT_COUNTERS {
        names[slot] = counter.to_string();
    }
    names
}

/// The statistics as PyTorch's `DeviceStats` lays them out: Note [The
/// statistics vector].
pub fn stats_vector(s: &MemoryStats) -> [i64; CACHEALLOC_STATS_LEN] {
    let v = |x: u64| i64::try_from(x).unwrap_or(i64::MAX);
    let mut out = [0i64; CACHEALLOC_STATS_LEN];
    let mut put = |start: usize, st: &cachealloc_core::Stat| {
        out[start + CACHEALLOC_STAT_CURRENT] = v(st.current);
        out[start + CACHEALLOC_STAT_PEAK] = v(st.peak);
        out[start + CACHEALLOC_STAT_ALLOCATED] = v(st.allocated);
        out[start + CACHEALLOC_STAT_FREED] = v(st.freed);
    };
    for ((name, arr), (layout_name, start)) in s.arrays().into_iter().zip(STAT_ARRAY_STARTS) {
        debug_assert_eq!(name, layout_name);
        for (g, st) in arr.stats().iter().enumerate() {
            put(start + g * CACHEALLOC_STAT_FIELDS, st);
        }
    }
    put(
        CACHEALLOC_STATS_OVERSIZE_ALLOCATIONS,
        &s.oversize_allocations,
    );
    put(CACHEALLOC_STATS_OVERSIZE_SEGMENTS, &s.oversize_segments);
    out[CACHEALLOC_STATS_NUM_ALLOC_RETRIES] = v(s.num_alloc_retries);
    out[CACHEALLOC_STATS_NUM_OOMS] = v(s.num_ooms);
    out[CACHEALLOC_STATS_NUM_SYNC_ALL_STREAMS] = v(s.num_sync_all_streams);
    out[CACHEALLOC_STATS_NUM_DEVICE_ALLOC] = v(s.num_device_alloc);
    out[CACHEALLOC_STATS_NUM_DEVICE_FREE] = v(s.num_device_free);
    out[CACHEALLOC_STATS_MAX_SPLIT_SIZE] = if s.max_split_size == u64::MAX {
        -1
    } else {
        v(s.max_split_size)
    };
    out
}

// ---- The snapshot words: Note [The snapshot words] ----------------------

/// Segment word: the segment's address.
pub const CACHEALLOC_SEGMENT_ADDRESS: usize = 0;
/// Segment word: its total size.
pub const CACHEALLOC_SEGMENT_TOTAL_SIZE: usize = 1;
/// Segment word: bytes of its blocks handed out.
pub const CACHEALLOC_SEGMENT_ALLOCATED_SIZE: usize = 2;
/// Segment word: bytes requested by its blocks handed out.
pub const CACHEALLOC_SEGMENT_REQUESTED_SIZE: usize = 3;
/// Segment word: its stream.
pub const CACHEALLOC_SEGMENT_STREAM: usize = 4;
/// Segment word: 1 when it belongs to the large (or huge) pool, 0 small.
pub const CACHEALLOC_SEGMENT_IS_LARGE: usize = 5;
/// Segment word: the number of its blocks (their words follow).
pub const CACHEALLOC_SEGMENT_BLOCKS: usize = 6;
/// Segment word: bytes of it backed by memory (expandable segments map part).
pub const CACHEALLOC_SEGMENT_MAPPED_SIZE: usize = 7;
/// Words per segment header.
pub const CACHEALLOC_SEGMENT_WORDS: usize = 8;

/// Block word: the block's address.
pub const CACHEALLOC_BLOCK_ADDRESS: usize = 0;
/// Block word: its size.
pub const CACHEALLOC_BLOCK_SIZE: usize = 1;
/// Block word: the size requested for it (0 when free).
pub const CACHEALLOC_BLOCK_REQUESTED_SIZE: usize = 2;
/// Block word: its state, a `CACHEALLOC_BLOCK_STATE_*`.
pub const CACHEALLOC_BLOCK_STATE: usize = 3;
/// Words per block.
pub const CACHEALLOC_BLOCK_WORDS: usize = 4;

/// Block state: free (in the bins or a thread cache).
pub const CACHEALLOC_BLOCK_STATE_INACTIVE: u64 = 0;
/// Block state: handed out to a caller.
pub const CACHEALLOC_BLOCK_STATE_ALLOCATED: u64 = 1;
/// Block state: freed by the caller, waiting for other streams' events.
pub const CACHEALLOC_BLOCK_STATE_PENDING_FREE: u64 = 2;

/// A snapshot as plain words: Note [The snapshot words].
pub fn snapshot_words(snap: &Snapshot) -> Vec<u64> {
    let n: usize = snap
        .segments
        .iter()
        .map(|s| CACHEALLOC_SEGMENT_WORDS + CACHEALLOC_BLOCK_WORDS * s.blocks.len())
        .sum();
    let mut out = Vec::with_capacity(n);
    for s in &snap.segments {
        let mut head = [0u64; CACHEALLOC_SEGMENT_WORDS];
        head[CACHEALLOC_SEGMENT_ADDRESS] = s.address.0;
        head[CACHEALLOC_SEGMENT_TOTAL_SIZE] = s.total_size;
        head[CACHEALLOC_SEGMENT_ALLOCATED_SIZE] = s.allocated_size;
        head[CACHEALLOC_SEGMENT_REQUESTED_SIZE] = s.requested_size;
        head[CACHEALLOC_SEGMENT_STREAM] = s.stream.0;
        head[CACHEALLOC_SEGMENT_IS_LARGE] = u64::from(s.pool != PoolKind::Small);
        head[CACHEALLOC_SEGMENT_BLOCKS] = s.blocks.len() as u64;
        head[CACHEALLOC_SEGMENT_MAPPED_SIZE] = s.mapped_size;
        out.extend_from_slice(&head);
        for b in &s.blocks {
            let mut words = [0u64; CACHEALLOC_BLOCK_WORDS];
            words[CACHEALLOC_BLOCK_ADDRESS] = b.address.0;
            words[CACHEALLOC_BLOCK_SIZE] = b.size;
            words[CACHEALLOC_BLOCK_REQUESTED_SIZE] = b.requested_size;
            words[CACHEALLOC_BLOCK_STATE] = match b.state {
                BlockState::Free | BlockState::Parked | BlockState::Aliased => {
                    CACHEALLOC_BLOCK_STATE_INACTIVE
                }
                BlockState::Allocated => CACHEALLOC_BLOCK_STATE_ALLOCATED,
                BlockState::AwaitingEvents => CACHEALLOC_BLOCK_STATE_PENDING_FREE,
            };
            out.extend_from_slice(&words);
        }
    }
    out
}

/// The snapshot that [`snapshot_words`] wrote, as far as a layout needs it
/// (addresses, sizes, requested sizes and states; the pool word tells only
/// small from large).
pub fn snapshot_from_words(words: &[u64]) -> Result<Snapshot, String> {
    let mut segments = Vec::new();
    let mut rest = words;
    while !rest.is_empty() {
        let Some((head, tail)) = rest.split_at_checked(CACHEALLOC_SEGMENT_WORDS) else {
            return Err(format!("{} words left: not a segment header", rest.len()));
        };
        let address = head[CACHEALLOC_SEGMENT_ADDRESS];
        let n = usize::try_from(head[CACHEALLOC_SEGMENT_BLOCKS])
            .map_err(|_| "block count out of range")?;
        let Some((body, tail)) = n
            .checked_mul(CACHEALLOC_BLOCK_WORDS)
            .and_then(|len| tail.split_at_checked(len))
        else {
            return Err(format!(
                "segment at {address:#x}: {n} blocks announced, fewer given"
            ));
        };
        let mut blocks = Vec::with_capacity(n);
        for b in body.chunks_exact(CACHEALLOC_BLOCK_WORDS) {
            let state = match b[CACHEALLOC_BLOCK_STATE] {
                CACHEALLOC_BLOCK_STATE_INACTIVE => BlockState::Free,
                CACHEALLOC_BLOCK_STATE_ALLOCATED => BlockState::Allocated,
                CACHEALLOC_BLOCK_STATE_PENDING_FREE => BlockState::AwaitingEvents,
                other => {
                    return Err(format!(
                        "block at {:#x}: state {other}",
                        b[CACHEALLOC_BLOCK_ADDRESS]
                    ))
                }
            };
            blocks.push(cachealloc_core::BlockSnapshot {
                address: DevicePtr(b[CACHEALLOC_BLOCK_ADDRESS]),
                size: b[CACHEALLOC_BLOCK_SIZE],
                requested_size: b[CACHEALLOC_BLOCK_REQUESTED_SIZE],
                state,
                stream_uses: Vec::new(),
            });
        }
        segments.push(cachealloc_core::SegmentSnapshot {
            address: DevicePtr(address),
            total_size: head[CACHEALLOC_SEGMENT_TOTAL_SIZE],
            allocated_size: head[CACHEALLOC_SEGMENT_ALLOCATED_SIZE],
            requested_size: head[CACHEALLOC_SEGMENT_REQUESTED_SIZE],
            stream: StreamId(head[CACHEALLOC_SEGMENT_STREAM]),
            pool: if head[CACHEALLOC_SEGMENT_IS_LARGE] == 0 {
                PoolKind::Small
            } else {
                PoolKind::Large
            },
            blocks,
            mapped_size: head[CACHEALLOC_SEGMENT_MAPPED_SIZE],
        });
        rest = tail;
    }
    Ok(Snapshot { segments })
}

/// Restores `a` to the layout of `words` ([`snapshot_words`] of it, taken
/// earlier): the addresses allocated again, at most `cap` of them (more is
/// an error, before anything changes).
pub fn restore<D: Device>(
    a: &CachingAllocator<D>,
    words: &[u64],
    cap: usize,
) -> Result<Vec<u64>, String> {
    let layout = snapshot_from_words(words)?;
    let n = layout
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state != BlockState::Free)
        .count();
    if n > cap {
        return Err(format!(
            "cachealloc: restore needs room for {n} addresses, {cap} given"
        ));
    }
    a.restore_layout(&layout)
        .map(|v| v.into_iter().map(|p| p.0).collect())
        .map_err(|e| format!("cachealloc: {e}"))
}

/// What an allocation through a handle gave.
#[derive(Debug, PartialEq, Eq)]
pub enum AllocOutcome {
    /// The address.
    Ok(u64),
    /// Out of memory (the message explains the memory state).
    OutOfMemory(String),
    /// Any other failure.
    Error(String),
}

impl AllocOutcome {
    /// The C code of the outcome: 0 ok, 1 out of memory, 2 other error.
    pub fn code(&self) -> i32 {
        match self {
            AllocOutcome::Ok(_) => 0,
            AllocOutcome::OutOfMemory(_) => 1,
            AllocOutcome::Error(_) => 2,
        }
    }
}

/// Allocates through `a`; size 0 gives address 0.
pub fn alloc<D: Device>(a: &CachingAllocator<D>, size: u64, stream: u64) -> AllocOutcome {
    if size == 0 {
        return AllocOutcome::Ok(0);
    }
    match a.malloc(size, StreamId(stream)) {
        Ok(p) => AllocOutcome::Ok(p.0),
        Err(e @ AllocError::OutOfMemory(_)) => AllocOutcome::OutOfMemory(e.to_string()),
        Err(e @ AllocError::Device(cachealloc_core::DeviceError::OutOfMemory)) => {
            AllocOutcome::OutOfMemory(e.to_string())
        }
        // Larger than any device: out of memory to PyTorch ("Tried to
        // allocate 800000000.00 GiB"), as its own allocator reports it.
        Err(e @ AllocError::SizeTooLarge(_)) => AllocOutcome::OutOfMemory(e.to_string()),
        Err(e) => AllocOutcome::Error(e.to_string()),
    }
}

/// Frees through `a`, returning the size that was requested; errors: -2
/// when `a` does not own `ptr`, -1 another.
pub fn free<D: Device>(a: &CachingAllocator<D>, ptr: u64) -> Result<u64, (i32, String)> {
    match a.free_sized(DevicePtr(ptr)) {
        Ok(size) => Ok(size),
        Err(e @ AllocError::UnknownPointer(_)) => Err((-2, e.to_string())),
        Err(e) => Err((-1, e.to_string())),
    }
}

/// The largest cached free block of `a` in bytes.
pub fn largest_free<D: Device>(a: &CachingAllocator<D>) -> u64 {
    a.fragmentation().largest_free_block
}

/// The largest block `a` could hand out now, the device's free memory
/// (within the cap) included: what PyTorch's `cacheInfo` answers to a zero
/// guess.
pub fn cache_info<D: Device>(a: &CachingAllocator<D>) -> Result<u64, String> {
    a.cache_info().map_err(|e| e.to_string())
}

/// Whether a pool allocator can be dropped: nothing allocated from it.
pub fn pool_idle<D: Device>(a: &CachingAllocator<D>) -> bool {
    a.usage().allocated == 0
}

/// Records an error of this ABI: the calling thread's last error, counted in
/// `cachealloc_error_count` like the plain ABI's.
fn set_error(msg: &str) {
    crate::capi::record_message(msg);
}

/// The calling thread's last error of either C ABI ("" when none).
pub fn last_error() -> String {
    crate::capi::last_error().unwrap_or_default()
}

/// What a run-time settings string (`torch.cuda.memory._set_allocator_settings`)
/// did to `a`: Note [Run-time settings] in `cachealloc_core::pytorch_conf`.
#[derive(Debug, PartialEq)]
pub struct SettingsApplied {
    /// The notice for the user about settings that stay as the allocator
    /// started (empty when every setting took effect).
    pub notice: String,
    /// The memory fraction now in force, when the string set one.
    pub fraction: Option<f64>,
}

/// Applies a PyTorch settings string to a running allocator: what is safe
/// to change changes, the rest is named in the notice. An invalid string
/// (PyTorch's message) changes nothing.
pub fn apply_settings<D: Device>(
    a: &CachingAllocator<D>,
    conf: &str,
) -> Result<SettingsApplied, String> {
    use cachealloc_core::pytorch_conf::PytorchConf;
    let parsed = PytorchConf::parse(conf).map_err(|e| format!("cachealloc: {e}"))?;
    let changes = parsed.runtime_changes(&a.config(), a.is_expandable());
    if let Some(t) = changes.garbage_collection_threshold {
        a.set_garbage_collection_threshold(Some(t))
            .map_err(|e| format!("cachealloc: {e}"))?;
    }
    if let Some(b) = changes.max_non_split_rounding {
        a.set_max_non_split_rounding(b)
            .map_err(|e| format!("cachealloc: {e}"))?;
    }
    if let Some(f) = changes.per_process_memory_fraction {
        a.set_memory_cap(Some(cachealloc_core::MemoryCap::Fraction(f)))
            .map_err(|e| format!("cachealloc: {e}"))?;
    }
    Ok(SettingsApplied {
        notice: changes.notice(),
        fraction: changes.per_process_memory_fraction,
    })
}

pub mod ipc;

#[cfg(feature = "cuda")]
pub use exports::*;

pub mod mempool;
mod reclaim;
#[cfg(feature = "cuda")]
pub use reclaim::*;

/// The configuration of a private pool's allocator, from the device's
/// `config` (see `cachealloc_torch_pool_new`): no thread caches, slabs,
/// expandable segments or holes borrowed from another stream's segments
/// (nothing records stream events behind a capture, and a block the graph
/// freed stays where its stream left it), nothing given back on its own (no
/// garbage collection, no release on out-of-memory).
pub fn pool_config(config: Config) -> Config {
    config
        .into_builder()
        .thread_cache(0)
        .slab_max(0)
        .expandable_segments(false)
        .borrow_holes(false)
        .garbage_collection_threshold(None)
        .set("oom_flush", "False")
        // The device's cap (its memory fraction) applies through the cap
        // group the pool joins (Note [Shared cap] in `cachealloc_core::supply`).
        .memory_cap(None)
        .build()
        // Each value is its key's "off", inside the key table's bounds, and
        // no slabs meet every limit between keys: `build` cannot refuse it.
        .expect("a private pool's settings are valid for every configuration")
}

#[cfg(feature = "cuda")]
mod exports {
    //! The exported functions over [`crate::cuda`]'s allocators.

    use super::*;
    use crate::cuda::CudaDevice;
    use parking_lot::Mutex;
    use std::ffi::{c_char, c_int, c_void};
    use std::panic::{catch_unwind, AssertUnwindSafe};

    pub(super) type Alloc = CachingAllocator<CudaDevice>;

    /// Addresses of the pool allocators alive (handles `pool_drop` accepts).
    pub(super) static POOLS: Mutex<Vec<usize>> = Mutex::new(Vec::new());

    /// Runs `f`, turning a panic into `fallback` with the last error set.
    pub(super) fn guard<T>(fallback: T, f: impl FnOnce() -> T) -> T {
        catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
            let msg = crate::capi::panic_text(p);
            set_error(&format!("cachealloc: internal error (panic): {msg}"));
            fallback
        })
    }

    /// The allocator behind a handle, or `None` for NULL.
    ///
    /// # Safety
    /// `h` is NULL, a handle from `cachealloc_torch_device`, or a pool handle
    /// from `cachealloc_torch_pool_new` not yet dropped.
    pub(super) unsafe fn handle<'a>(h: *const c_void) -> Option<&'a Alloc> {
        if h.is_null() {
            set_error("cachealloc: NULL allocator handle");
            return None;
        }
        // SAFETY: per the contract `h` points at a live `CachingAllocator<CudaDevice>`.
        Some(unsafe { &*(h as *const Alloc) })
    }

    /// The process-wide allocator of `device` (created on first use), or NULL.
    #[no_mangle]
    pub extern "C" fn cachealloc_torch_device(device: c_int) -> *mut c_void {
        // (A `*mut` for C's plain `void*`; no caller writes through it.)
        guard(std::ptr::null_mut(), || {
            match crate::cuda::allocator(device) {
                Ok(a) => a as *const Alloc as *mut c_void,
                Err(e) => {
                    set_error(&format!("cachealloc: device {device} unusable: {e}"));
                    std::ptr::null_mut()
                }
            }
        })
    }

    /// A new private pool allocator on `device` (own segments; same
    /// configuration, without thread caches, slabs or expandable segments,
    /// so that nothing records stream events behind a CUDA graph capture,
    /// and with PyTorch's 20 MiB medium segments: a pool's peak starts at
    /// zero with the capture, so segments sized from it would be 2 MiB for
    /// all it holds), or NULL. It never gives segments back on its own (no release before
    /// growing, no garbage collection, no release on out-of-memory): a captured graph keeps using the pool's free blocks, so only
    /// `empty_cache` or dropping the pool, once nobody uses it, releases them.
    /// Its segments count against the device's memory fraction (the cap of
    /// `cachealloc_torch_device`'s allocator), and the device allocator's
    /// room shrinks by them (Note [Shared cap] in `cachealloc_core::supply`).
    #[no_mangle]
    pub extern "C" fn cachealloc_torch_pool_new(device: c_int) -> *mut c_void {
        guard(std::ptr::null_mut(), || {
            super::mempool::pool_on(device, None)
        })
    }

    /// Drops a pool allocator after releasing its segments: 0; -1 (nothing
    /// done) when `h` is not a live pool handle or blocks are still allocated.
    #[no_mangle]
    pub extern "C" fn cachealloc_torch_pool_drop(h: *mut c_void) -> c_int {
        guard(-1, || {
            let mut pools = POOLS.lock();
            let Some(i) = pools.iter().position(|&p| p == h as usize) else {
                set_error("cachealloc: pool_drop of a handle that is no live pool");
                return -1;
            };
            // SAFETY: `h` is in POOLS, so it came from `Box::into_raw` in
            // `cachealloc_torch_pool_new` and was not dropped yet.
            let a = unsafe { &*(h as *const Alloc) };
            if !pool_idle(a) {
                set_error("cachealloc: pool_drop of a pool with live allocations");
                return -1;
            }
            if let Err(e) = a.empty_cache() {
                set_error(&format!("cachealloc: pool_drop: {e}"));
                return -1;
            }
            pools.swap_remove(i);
            // SAFETY: as above; removed from POOLS, so dropped exactly once.
            drop(unsafe { Box::from_raw(h as *mut Alloc) });
            0
        })
    }

    /// Allocates `size` bytes for `stream`; NULL for size 0 (kind 0) and on
    /// failure (kind 1 out of memory, 2 other error; last error set).
    ///
    /// # Safety
    /// `h` is NULL or a live handle (`cachealloc_torch_device`, or
    /// `cachealloc_torch_pool_new` not yet dropped); `kind` is NULL or points at a writable int.
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_alloc(
        h: *const c_void,
        size: usize,
        stream: *mut c_void,
        kind: *mut c_int,
    ) -> *mut c_void {
        let (ptr, code) = guard((0, 2), || {
            // SAFETY: forwarded contract.
            let Some(a) = (unsafe { handle(h) }) else {
                return (0, 2);
            };
            let out = alloc(a, size as u64, crate::cuda::driver::ffi_stream(stream).0);
            let code = out.code();
            match out {
                AllocOutcome::Ok(p) => (p, 0),
                AllocOutcome::OutOfMemory(m) | AllocOutcome::Error(m) => {
                    set_error(&m);
                    (0, code)
                }
            }
        });
        if !kind.is_null() {
            // SAFETY: non-null and writable per the contract.
            unsafe { *kind = code };
        }
        ptr as usize as *mut c_void
    }

    /// Frees `ptr`: 0; -2 when this allocator does not own it; -1 on other
    /// misuse. On success `*size` (when `size` is not NULL) is the size that
    /// was requested (for the profiler's memory events).
    ///
    /// # Safety
    /// `h` is NULL or a live handle (`cachealloc_torch_device`, or
    /// `cachealloc_torch_pool_new` not yet dropped); `size` is NULL or points at a writable u64.
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_free(
        h: *const c_void,
        ptr: *mut c_void,
        size: *mut u64,
    ) -> c_int {
        guard(-1, || {
            // SAFETY: forwarded contract.
            let Some(a) = (unsafe { handle(h) }) else {
                return -1;
            };
            match free(a, ptr as usize as u64) {
                Ok(n) => {
                    if !size.is_null() {
                        // SAFETY: non-null and writable per the contract.
                        unsafe { *size = n };
                    }
                    0
                }
                // -2 is a lookup miss while the caller tries each
                // device's allocator, not an error.
                Err((-2, _)) => -2,
                Err((code, m)) => {
                    set_error(&m);
                    code
                }
            }
        })
    }

    /// Marks `ptr` as used on `stream` too: 0; -2 when not this allocator's; -1 otherwise.
    ///
    /// # Safety
    /// `h` is NULL or a live handle (`cachealloc_torch_device`, or
    /// `cachealloc_torch_pool_new` not yet dropped).
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_record_stream(
        h: *const c_void,
        ptr: *mut c_void,
        stream: *mut c_void,
    ) -> c_int {
        guard(-1, || {
            // SAFETY: forwarded contract.
            let Some(a) = (unsafe { handle(h) }) else {
                return -1;
            };
            match a.record_stream(
                DevicePtr(ptr as usize as u64),
                crate::cuda::driver::ffi_stream(stream),
            ) {
                Ok(()) => 0,
                Err(e @ AllocError::UnknownPointer(_)) => {
                    set_error(&e.to_string());
                    -2
                }
                Err(e) => {
                    set_error(&e.to_string());
                    -1
                }
            }
        })
    }

    /// Writes the [`stats_vector`] into `out` (`n` ≥ `CACHEALLOC_STATS_LEN`): 0, or -1.
    ///
    /// # Safety
    /// `h` is NULL or a live handle (`cachealloc_torch_device`, or
    /// `cachealloc_torch_pool_new` not yet dropped); `out` points at `n` writable `int64_t`.
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_stats(
        h: *const c_void,
        out: *mut i64,
        n: usize,
    ) -> c_int {
        guard(-1, || {
            // SAFETY: forwarded contract.
            let Some(a) = (unsafe { handle(h) }) else {
                return -1;
            };
            if out.is_null() || n < CACHEALLOC_STATS_LEN {
                set_error(&format!(
                    "cachealloc: stats needs {CACHEALLOC_STATS_LEN} slots"
                ));
                return -1;
            }
            let v = stats_vector(&a.stats());
            // SAFETY: `out` has room for `n` ≥ CACHEALLOC_STATS_LEN values per the contract.
            unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), out, CACHEALLOC_STATS_LEN) };
            0
        })
    }

    /// Resets the peaks of `h`: 0, or -1.
    ///
    /// # Safety
    /// `h` is NULL or a live handle (`cachealloc_torch_device`, or
    /// `cachealloc_torch_pool_new` not yet dropped).
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_reset_peak(h: *const c_void) -> c_int {
        guard(-1, || {
            // SAFETY: forwarded contract.
            let Some(a) = (unsafe { handle(h) }) else {
                return -1;
            };
            a.reset_peak_stats();
            0
        })
    }

    /// Releases every entirely free segment of `h`: bytes released, or -1.
    ///
    /// # Safety
    /// `h` is NULL or a live handle (`cachealloc_torch_device`, or
    /// `cachealloc_torch_pool_new` not yet dropped).
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_empty_cache(h: *const c_void) -> i64 {
        guard(-1, || {
            // SAFETY: forwarded contract.
            let Some(a) = (unsafe { handle(h) }) else {
                return -1;
            };
            match a.empty_cache() {
                Ok(r) => i64::try_from(r.bytes).unwrap_or(i64::MAX),
                Err(e) => {
                    set_error(&e.to_string());
                    -1
                }
            }
        })
    }

    /// The largest cached free block of `h` in bytes, or -1.
    ///
    /// # Safety
    /// `h` is NULL or a live handle (`cachealloc_torch_device`, or
    /// `cachealloc_torch_pool_new` not yet dropped).
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_largest_free(h: *const c_void) -> i64 {
        guard(-1, || {
            // SAFETY: forwarded contract.
            let Some(a) = (unsafe { handle(h) }) else {
                return -1;
            };
            i64::try_from(largest_free(a)).unwrap_or(i64::MAX)
        })
    }

    /// The largest block `h` could hand out now, device memory included, or -1.
    ///
    /// # Safety
    /// `h` is NULL or a live handle (`cachealloc_torch_device`, or
    /// `cachealloc_torch_pool_new` not yet dropped).
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_cache_info(h: *const c_void) -> i64 {
        guard(-1, || {
            // SAFETY: forwarded contract.
            let Some(a) = (unsafe { handle(h) }) else {
                return -1;
            };
            match cache_info(a) {
                Ok(n) => i64::try_from(n).unwrap_or(i64::MAX),
                Err(e) => {
                    set_error(&e);
                    -1
                }
            }
        })
    }

    /// Caps the reserved memory of `h` at `fraction` of the device: 0, or -1.
    ///
    /// # Safety
    /// `h` is NULL or a live handle (`cachealloc_torch_device`, or
    /// `cachealloc_torch_pool_new` not yet dropped).
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_set_fraction(
        h: *const c_void,
        fraction: f64,
    ) -> c_int {
        guard(-1, || {
            // SAFETY: forwarded contract.
            let Some(a) = (unsafe { handle(h) }) else {
                return -1;
            };
            if !(0.0..=1.0).contains(&fraction) {
                set_error(&format!(
                    "cachealloc: memory fraction {fraction} is not in [0, 1]"
                ));
                return -1;
            }
            match a.set_memory_cap(Some(cachealloc_core::MemoryCap::Fraction(fraction))) {
                Ok(()) => 0,
                Err(e) => {
                    set_error(&e.to_string());
                    -1
                }
            }
        })
    }

    /// Writes the [`snapshot_words`] of `h` into `out` when they fit in
    /// `cap` words; returns the number of words (larger than `cap`: nothing
    /// written, call again with more room), or -1.
    ///
    /// # Safety
    /// `h` is NULL or a live handle (`cachealloc_torch_device`, or
    /// `cachealloc_torch_pool_new` not yet dropped); `out` points at `cap` writable words (or is NULL with `cap` 0).
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_snapshot(
        h: *const c_void,
        out: *mut u64,
        cap: usize,
    ) -> i64 {
        guard(-1, || {
            // SAFETY: forwarded contract.
            let Some(a) = (unsafe { handle(h) }) else {
                return -1;
            };
            let words = snapshot_words(&a.snapshot());
            if words.len() <= cap && !out.is_null() {
                // SAFETY: `out` has room for `cap` ≥ len words per the contract.
                unsafe { std::ptr::copy_nonoverlapping(words.as_ptr(), out, words.len()) };
            }
            i64::try_from(words.len()).unwrap_or(i64::MAX)
        })
    }

    /// Sets `h`'s blocks back to the layout of `words[..n]` (its own
    /// snapshot words, taken earlier; nothing may be allocated now): the
    /// number of addresses allocated again, written to `out[..cap]`; -1 on
    /// error (nothing changed; last error set).
    ///
    /// # Safety
    /// `h` is NULL or a live handle (`cachealloc_torch_device`, or
    /// `cachealloc_torch_pool_new` not yet dropped); `words` points at `n` readable words and `out` at
    /// `cap` writable ones (each may be NULL when its count is 0).
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_restore(
        h: *const c_void,
        words: *const u64,
        n: usize,
        out: *mut u64,
        cap: usize,
    ) -> i64 {
        guard(-1, || {
            // SAFETY: forwarded contract.
            let Some(a) = (unsafe { handle(h) }) else {
                return -1;
            };
            let words: &[u64] = if n == 0 || words.is_null() {
                &[]
            } else {
                // SAFETY: `words` has `n` readable words per the contract.
                unsafe { std::slice::from_raw_parts(words, n) }
            };
            let cap = if out.is_null() { 0 } else { cap };
            match restore(a, words, cap) {
                Ok(addrs) => {
                    if !addrs.is_empty() {
                        // SAFETY: `restore` returned at most `cap` addresses
                        // (so `out` is not NULL) and `out` has room for `cap`
                        // words per the contract.
                        unsafe { std::ptr::copy_nonoverlapping(addrs.as_ptr(), out, addrs.len()) };
                    }
                    i64::try_from(addrs.len()).unwrap_or(i64::MAX)
                }
                Err(m) => {
                    set_error(&m);
                    -1
                }
            }
        })
    }

    /// 1 when `h` uses expandable (page-backed) segments, 0 when plain, -1 on error.
    ///
    /// # Safety
    /// `h` is NULL or a live handle (`cachealloc_torch_device`, or
    /// `cachealloc_torch_pool_new` not yet dropped).
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_is_expandable(h: *const c_void) -> c_int {
        guard(-1, || {
            // SAFETY: forwarded contract.
            let Some(a) = (unsafe { handle(h) }) else {
                return -1;
            };
            c_int::from(a.is_expandable())
        })
    }

    /// Lets device `peer` read and write the expandable-segment pages of
    /// `device` (every allocator of it, pages mapped now and later), for
    /// PyTorch's `enablePeerAccess`; plain segments need only
    /// `cudaDeviceEnablePeerAccess`. 0, or -1 with the last error set.
    #[no_mangle]
    pub extern "C" fn cachealloc_torch_enable_peer_access(device: c_int, peer: c_int) -> c_int {
        guard(-1, || {
            // The registry of mappings is by device, so no allocator needs
            // to exist yet (one made later grants the peer at every map).
            match crate::cuda::driver::enable_peer_access(device, peer) {
                Ok(()) => 0,
                Err(e) => {
                    set_error(&format!(
                        "cachealloc: peer access of device {peer} to device {device}'s pages: {e}"
                    ));
                    -1
                }
            }
        })
    }

    /// Applies PyTorch's allocator settings string `conf` (UTF-8) to `h` while
    /// it runs ([`apply_settings`]): -1 on error (PyTorch's message in the last
    /// error; nothing changed); otherwise the length in bytes of the notice
    /// about settings that stay as the allocator started (0: none), written
    /// NUL-terminated and truncated to `cap` bytes into `notice`. `*fraction`
    /// (when `fraction` is not NULL) is the memory fraction the string set,
    /// or -1 when it set none.
    ///
    /// # Safety
    /// `h` is NULL or a live handle (`cachealloc_torch_device`, or
    /// `cachealloc_torch_pool_new` not yet dropped); `conf` is NULL or a
    /// NUL-terminated string; `fraction` is NULL or writable; `notice` points
    /// at `cap` writable bytes (or is NULL with `cap` 0).
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_apply_settings(
        h: *const c_void,
        conf: *const c_char,
        fraction: *mut f64,
        notice: *mut c_char,
        cap: usize,
    ) -> i64 {
        guard(-1, || {
            // SAFETY: forwarded contract.
            let Some(a) = (unsafe { handle(h) }) else {
                return -1;
            };
            if conf.is_null() {
                set_error("cachealloc: apply_settings of a NULL string");
                return -1;
            }
            // SAFETY: non-null and NUL-terminated per the contract.
            let conf = unsafe { std::ffi::CStr::from_ptr(conf) }.to_string_lossy();
            match apply_settings(a, &conf) {
                Ok(done) => {
                    if !fraction.is_null() {
                        // SAFETY: non-null and writable per the contract.
                        unsafe { *fraction = done.fraction.unwrap_or(-1.0) };
                    }
                    // SAFETY: `notice` has `cap` writable bytes per the contract.
                    unsafe { copy_c_string(&done.notice, notice, cap) };
                    i64::try_from(done.notice.len()).unwrap_or(i64::MAX)
                }
                Err(m) => {
                    set_error(&m);
                    -1
                }
            }
        })
    }

    /// Copies `msg` NUL-terminated, truncated to `cap` bytes, into `buf`
    /// (nothing when `buf` is NULL or `cap` is 0).
    ///
    /// # Safety
    /// `buf` points at `cap` writable bytes, or is NULL.
    unsafe fn copy_c_string(msg: &str, buf: *mut c_char, cap: usize) {
        if !buf.is_null() && cap > 0 {
            let n = msg.len().min(cap - 1);
            // SAFETY: `buf` has `cap` bytes; n + 1 ≤ cap are written.
            unsafe {
                std::ptr::copy_nonoverlapping(msg.as_ptr(), buf as *mut u8, n);
                *buf.add(n) = 0;
            }
        }
    }

    /// Copies the calling thread's last error (NUL-terminated, truncated to
    /// `cap` bytes) into `buf`; returns its full length in bytes.
    ///
    /// # Safety
    /// `buf` points at `cap` writable bytes (or is NULL with `cap` 0).
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_last_error(buf: *mut c_char, cap: usize) -> usize {
        guard(0, || {
            let msg = last_error();
            // SAFETY: `buf` has `cap` writable bytes per the contract.
            unsafe { copy_c_string(&msg, buf, cap) };
            msg.len()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachealloc_core::{MemoryCap, SimulatedDevice};

    fn alloc_1g() -> CachingAllocator<SimulatedDevice> {
        CachingAllocator::new(SimulatedDevice::new(1 << 30), Config::segments())
    }

    #[test]
    fn a_private_pool_keeps_pytorchs_segment_sizes_and_its_segments() {
        let c = pool_config(Config::default());
        assert_eq!(
            (c.thread_cache(), c.slab_max(), c.expandable_segments()),
            (0, 0, false)
        );
        assert_eq!(c.get("oom_flush").unwrap().as_deref(), Some("False"));
        assert!(!c.borrow_holes());
        assert!(c.garbage_collection_threshold().is_none());
        // A fresh pool's first medium request takes a 20 MiB segment, as
        // PyTorch's graph pools do (`default` alone would make it 4 MiB).
        let dev = SimulatedDevice::new(1 << 30);
        let a = CachingAllocator::new(dev.clone(), c);
        a.malloc(3 << 20, StreamId(0)).unwrap();
        assert_eq!(dev.segments()[0].1, 20 << 20);
        // A free huge segment serves a request under half its size: a
        // captured graph may still use the segment, so it is not given back.
        let big = a.malloc(600 << 20, StreamId(0)).unwrap();
        a.free(big).unwrap();
        let p = a.malloc(280 << 20, StreamId(0)).unwrap();
        assert_eq!(p, big);
        assert_eq!(dev.segments().len(), 2);
    }

    /// The named slots tile the vector: each slot has one name, the stat
    /// arrays follow each other, and `max_split_size` (the one slot that is
    /// not summed over allocators on the C++ side) is the last.
    #[test]
    fn stat_layout_names_every_slot_once() {
        assert_eq!(
            CACHEALLOC_STAT_ARRAY_LEN,
            CACHEALLOC_STAT_GROUPS * CACHEALLOC_STAT_FIELDS
        );
        for (i, (_, start)) in STAT_ARRAY_STARTS.iter().enumerate() {
            assert_eq!(*start, i * CACHEALLOC_STAT_ARRAY_LEN);
        }
        assert_eq!(
            CACHEALLOC_STATS_OVERSIZE_ALLOCATIONS,
            CACHEALLOC_STAT_ARRAYS * CACHEALLOC_STAT_ARRAY_LEN
        );
        assert_eq!(CACHEALLOC_STATS_MAX_SPLIT_SIZE + 1, CACHEALLOC_STATS_LEN);
        let names = stat_names();
        assert_eq!(names.len(), CACHEALLOC_STATS_LEN);
        let unique: std::collections::HashSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "a slot named twice");
        assert!(names.iter().all(|n| !n.is_empty()), "a slot without a name");
        assert_eq!(names[CACHEALLOC_STATS_LEN - 1], "max_split_size");
        assert_eq!(
            names[CACHEALLOC_STATS_RESERVED_BYTES
                + CACHEALLOC_STAT_LARGE_POOL * CACHEALLOC_STAT_FIELDS
                + CACHEALLOC_STAT_PEAK],
            "reserved_bytes.large_pool.peak"
        );
    }

    #[test]
    fn stats_vector_follows_pytorchs_layout() {
        let a = alloc_1g();
        let p = a.malloc(3 << 20, StreamId(0)).unwrap();
        let q = a.malloc(1000, StreamId(0)).unwrap();
        a.free(q).unwrap();
        let q = a.malloc(1000, StreamId(0)).unwrap();
        let s = a.stats();
        let v = stats_vector(&s);
        let entries: std::collections::HashMap<String, i64> = s.entries().into_iter().collect();
        // Every slot holds the `memory_stats()` value of its name.
        for (i, name) in stat_names().iter().enumerate() {
            assert_eq!(v[i], entries[name], "slot {i} ({name})");
        }
        assert_eq!(
            v[CACHEALLOC_STATS_MAX_SPLIT_SIZE], -1,
            "unlimited max_split_size is -1"
        );
        let slot = |start: usize, group: usize, field: usize| {
            v[start + group * CACHEALLOC_STAT_FIELDS + field]
        };
        assert_eq!(
            slot(
                CACHEALLOC_STATS_ALLOCATION,
                CACHEALLOC_STAT_AGGREGATE,
                CACHEALLOC_STAT_CURRENT
            ),
            2,
            "two allocations live"
        );
        assert_eq!(
            slot(
                CACHEALLOC_STATS_ALLOCATION,
                CACHEALLOC_STAT_SMALL_POOL,
                CACHEALLOC_STAT_CURRENT
            ),
            1,
            "one small"
        );
        assert_eq!(
            slot(
                CACHEALLOC_STATS_ALLOCATION,
                CACHEALLOC_STAT_SMALL_POOL,
                CACHEALLOC_STAT_FREED
            ),
            1,
            "one small freed"
        );
        assert_eq!(
            slot(
                CACHEALLOC_STATS_ALLOCATION,
                CACHEALLOC_STAT_AGGREGATE,
                CACHEALLOC_STAT_ALLOCATED
            ),
            3
        );
        assert_eq!(v[CACHEALLOC_STATS_NUM_DEVICE_ALLOC], 2, "two segments");
        a.free(p).unwrap();
        a.free(q).unwrap();
    }

    #[test]
    fn snapshot_words_walk_segments_and_blocks() {
        let a = alloc_1g();
        let p = a.malloc(3 << 20, StreamId(7)).unwrap();
        let q = a.malloc(1000, StreamId(7)).unwrap();
        let snap = a.snapshot();
        let w = snapshot_words(&snap);
        let mut i = 0;
        let mut seen = Vec::new();
        let mut segments = 0;
        while i < w.len() {
            let seg = &w[i..i + CACHEALLOC_SEGMENT_WORDS];
            let (addr, total) = (
                seg[CACHEALLOC_SEGMENT_ADDRESS],
                seg[CACHEALLOC_SEGMENT_TOTAL_SIZE],
            );
            let nblocks = seg[CACHEALLOC_SEGMENT_BLOCKS] as usize;
            assert_eq!(seg[CACHEALLOC_SEGMENT_STREAM], 7, "stream");
            let mut sum = 0;
            for b in 0..nblocks {
                let j = i + CACHEALLOC_SEGMENT_WORDS + b * CACHEALLOC_BLOCK_WORDS;
                let blk = &w[j..j + CACHEALLOC_BLOCK_WORDS];
                let (baddr, bsize) = (blk[CACHEALLOC_BLOCK_ADDRESS], blk[CACHEALLOC_BLOCK_SIZE]);
                assert!(baddr >= addr && baddr + bsize <= addr + total);
                sum += bsize;
                if blk[CACHEALLOC_BLOCK_STATE] == CACHEALLOC_BLOCK_STATE_ALLOCATED {
                    seen.push((
                        baddr,
                        blk[CACHEALLOC_BLOCK_REQUESTED_SIZE],
                        seg[CACHEALLOC_SEGMENT_IS_LARGE],
                    ));
                }
            }
            assert_eq!(sum, total, "blocks tile the segment");
            i += CACHEALLOC_SEGMENT_WORDS + nblocks * CACHEALLOC_BLOCK_WORDS;
            segments += 1;
        }
        assert_eq!(i, w.len());
        assert_eq!(segments, snap.segments.len());
        seen.sort();
        let mut want = vec![(p.0, 3 << 20, 1), (q.0, 1000, 0)];
        want.sort();
        assert_eq!(seen, want);
    }

    #[test]
    fn cache_info_offers_the_device_not_only_the_cache() {
        let a = alloc_1g();
        assert_eq!(
            cache_info(&a).unwrap(),
            1 << 30,
            "nothing cached: the device"
        );
        let AllocOutcome::Ok(p) = alloc(&a, 300 << 20, 0) else {
            panic!("300 MiB fits")
        };
        free(&a, p).unwrap();
        // 300 MiB cached, 724 MiB still on the device: the larger.
        assert_eq!(largest_free(&a), 300 << 20);
        assert_eq!(cache_info(&a).unwrap(), 724 << 20);
        a.set_memory_cap(Some(MemoryCap::Bytes(512 << 20))).unwrap();
        assert_eq!(cache_info(&a).unwrap(), 300 << 20, "the cap leaves 212 MiB");
    }

    #[test]
    fn alloc_outcomes_and_frees() {
        let a = alloc_1g();
        assert_eq!(alloc(&a, 0, 0), AllocOutcome::Ok(0));
        a.set_memory_cap(Some(MemoryCap::Fraction(0.25))).unwrap();
        let oom = alloc(&a, 512 << 20, 0);
        assert_eq!(oom.code(), 1);
        assert!(matches!(&oom, AllocOutcome::OutOfMemory(m) if m.contains("out of memory")));
        // A request larger than any device is an out-of-memory too.
        assert_eq!(alloc(&a, u64::MAX / 2, 0).code(), 1);
        let AllocOutcome::Ok(p) = alloc(&a, 1 << 20, 0) else {
            panic!("1 MiB fits")
        };
        assert!(!pool_idle(&a));
        assert_eq!(free(&a, 0xdead_0000).unwrap_err().0, -2);
        assert_eq!(free(&a, p).unwrap(), 1 << 20, "the size requested");
        assert_eq!(free(&a, p).unwrap_err().0, -1, "double free");
        assert!(pool_idle(&a));
        assert!(largest_free(&a) >= 1 << 20);
    }

    #[test]
    fn restore_goes_back_to_a_layout_given_as_snapshot_words() {
        let a = alloc_1g();
        let x = a.malloc(3 << 20, StreamId(0)).unwrap();
        let y = a.malloc(1000, StreamId(0)).unwrap();
        let z = a.malloc(5 << 20, StreamId(0)).unwrap();
        a.free(y).unwrap();
        let words = snapshot_words(&a.snapshot());
        assert_eq!(snapshot_words(&snapshot_from_words(&words).unwrap()), words);
        // Refused while allocated, and with too little room for the addresses.
        assert!(restore(&a, &words, 8).is_err());
        a.free(x).unwrap();
        a.free(z).unwrap();
        assert!(restore(&a, &words, 1).unwrap_err().contains("room for 2"));
        let mut got = restore(&a, &words, 8).unwrap();
        got.sort();
        assert_eq!(got, vec![x.0.min(z.0), x.0.max(z.0)]);
        // The same blocks in use at the same places (a block parked in a
        // thread cache then is part of the free space now).
        let used = |w: &[u64]| -> Vec<(u64, u64, u64)> {
            let s = snapshot_from_words(w).unwrap();
            s.segments
                .iter()
                .flat_map(|s| &s.blocks)
                .filter(|b| b.state != BlockState::Free)
                .map(|b| (b.address.0, b.size, b.requested_size))
                .collect()
        };
        assert_eq!(used(&snapshot_words(&a.snapshot())), used(&words));
        a.check_invariants().unwrap();
        // Truncated or garbled words are refused.
        assert!(snapshot_from_words(&words[..words.len() - 1]).is_err());
        let mut bad = words.clone();
        bad[CACHEALLOC_SEGMENT_WORDS + CACHEALLOC_BLOCK_STATE] = 9;
        assert!(snapshot_from_words(&bad).is_err());
    }

    /// Note [Run-time settings]: what may change does, the rest is named,
    /// and a refused string changes nothing.
    #[test]
    fn run_time_settings_apply_what_is_safe() {
        let a = alloc_1g();
        let before = a.config();
        let done = apply_settings(
            &a,
            "garbage_collection_threshold:0.5,max_non_split_rounding_mb:64,\
             per_process_memory_fraction:0.5,pinned_use_cuda_host_register:True",
        )
        .unwrap();
        assert_eq!(
            done,
            SettingsApplied {
                notice: String::new(),
                fraction: Some(0.5)
            }
        );
        let c = a.config();
        assert_eq!(c.garbage_collection_threshold(), Some(0.5));
        assert_eq!(c.max_non_split_rounding(), 64 << 20);
        assert_eq!(a.memory_cap(), Some(512 << 20), "half of 1 GiB");
        // The new cap is in force: 600 MiB no longer fits.
        assert_eq!(alloc(&a, 600 << 20, 0).code(), 1);
        let done = apply_settings(&a, "max_split_size_mb:64,expandable_segments:True").unwrap();
        assert!(
            done.notice.contains("max_split_size_mb stays unlimited"),
            "{}",
            done.notice
        );
        assert!(
            done.notice.contains("expandable_segments stays False"),
            "{}",
            done.notice
        );
        assert_eq!(done.fraction, None);
        assert_eq!(a.config().max_split_size(), before.max_split_size());
        let e =
            apply_settings(&a, "garbage_collection_threshold:0.2,max_split_size_mb:1").unwrap_err();
        assert!(e.contains("max_split_size_mb too small"), "{e}");
        assert_eq!(
            a.config().garbage_collection_threshold(),
            Some(0.5),
            "a refused string changes nothing"
        );
        a.check_invariants().unwrap();
    }

    #[test]
    fn last_error_is_per_thread() {
        let before = crate::capi::error_count();
        set_error("x");
        assert!(
            crate::capi::error_count() > before,
            "counted with the plain ABI's errors"
        );
        assert_eq!(last_error(), "x");
        std::thread::spawn(|| assert_eq!(last_error(), ""))
            .join()
            .unwrap();
    }
}
