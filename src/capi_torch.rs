//! The C ABI behind PyTorch's full allocator interface.
//!
//! `python/cachealloc_torch/csrc/allocator.cpp` subclasses PyTorch's
//! `c10::cuda::CUDACachingAllocator::CUDAAllocator` and calls these functions
//! for every decision. They work on allocator *handles*: the process-wide
//! allocator of a device ([`crate::cuda::allocator`], the one the plain C ABI
//! in [`crate::capi`] uses too) or a private pool's own allocator (one per
//! `torch.cuda.MemPool` / CUDA graph pool, with its own segments). C
//! declarations (`ssize_t`, `size_t` from `<sys/types.h>`):
//!
//! ```c
//! void*   cachealloc_torch_device(int device);        // the device's allocator, or NULL
//! void*   cachealloc_torch_pool_new(int device);      // a private pool's allocator, or NULL
//! int     cachealloc_torch_pool_drop(void* h);        // 0; -1 if h is no pool or still in use
//! void*   cachealloc_torch_alloc(void* h, size_t size, void* stream, int* kind);
//!                                                     // kind: 0 ok, 1 out of memory, 2 other error
//! int     cachealloc_torch_free(void* h, void* ptr, uint64_t* size);
//!                                                     // 0, -1 (error), -2 (not this allocator's);
//!                                                     // *size (if not NULL): the size requested
//! int     cachealloc_torch_record_stream(void* h, void* ptr, void* stream);  // as free
//! int     cachealloc_torch_stats(void* h, int64_t* out, size_t n);  // n >= CACHEALLOC_TORCH_STATS
//! int     cachealloc_torch_reset_peak(void* h);
//! int64_t cachealloc_torch_empty_cache(void* h);      // bytes released, or -1
//! int64_t cachealloc_torch_largest_free(void* h);     // largest cached free block, or -1
//! int64_t cachealloc_torch_cache_info(void* h);       // largest block obtainable now, device
//!                                                     // memory within the cap included, or -1
//! int     cachealloc_torch_set_fraction(void* h, double fraction);
//! int64_t cachealloc_torch_snapshot(void* h, uint64_t* out, size_t cap);  // words needed, or -1
//! int64_t cachealloc_torch_restore(void* h, const uint64_t* words, size_t n,
//!                                  uint64_t* out, size_t cap);
//!                                                     // back to a snapshot's layout: addresses
//!                                                     // allocated (written to out), or -1
//! int     cachealloc_torch_is_expandable(void* h);   // 1 page-backed segments, 0 plain, -1 error
//! int     cachealloc_torch_enable_peer_access(int device, int peer);
//!                                                     // 0; -1 on error: `peer` may use the
//!                                                     // pages of `device`, now and later
//! size_t  cachealloc_torch_last_error(char* buf, size_t cap);  // this thread's last error
//! ```
//!
//! The layouts of the statistics vector and of the snapshot words are
//! `stats_vector` and `snapshot_words`. Every function catches panics;
//! errors are return values plus the calling thread's last error.

use cachealloc_core::{
    AllocError, BlockState, CachingAllocator, Config, Device, DevicePtr, MemoryStats, PoolKind,
    Snapshot, StreamId,
};

/// Length of the statistics vector ([`stats_vector`]).
pub const STATS_LEN: usize = 9 * 3 * 4 + 2 * 4 + 6;

/// Words per segment header in [`snapshot_words`].
pub const SEGMENT_WORDS: usize = 8;
/// Words per block in [`snapshot_words`].
pub const BLOCK_WORDS: usize = 4;

/// The statistics as PyTorch's `DeviceStats` lays them out: the nine stat
/// arrays (allocation, segment, active, inactive_split, allocated_bytes,
/// reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes),
/// each as aggregate / small pool / large pool, each stat as current, peak,
/// allocated, freed; then oversize_allocations and oversize_segments (four
/// each); then num_alloc_retries, num_ooms, num_sync_all_streams,
/// num_device_alloc, num_device_free, max_split_size (-1: unlimited).
pub fn stats_vector(s: &MemoryStats) -> [i64; STATS_LEN] {
    let v = |x: u64| i64::try_from(x).unwrap_or(i64::MAX);
    let mut out = [0i64; STATS_LEN];
    let mut i = 0;
    let mut push = |x: i64| {
        out[i] = x;
        i += 1;
    };
    for (_, arr) in s.arrays() {
        for st in arr.stats() {
            for x in [st.current, st.peak, st.allocated, st.freed] {
                push(v(x));
            }
        }
    }
    for st in [s.oversize_allocations, s.oversize_segments] {
        for x in [st.current, st.peak, st.allocated, st.freed] {
            push(v(x));
        }
    }
    push(v(s.num_alloc_retries));
    push(v(s.num_ooms));
    push(v(s.num_sync_all_streams));
    push(v(s.num_device_alloc));
    push(v(s.num_device_free));
    push(if s.max_split_size == u64::MAX {
        -1
    } else {
        v(s.max_split_size)
    });
    out
}

/// Block states in [`snapshot_words`].
pub mod block_state {
    /// Free (in the bins or a thread cache).
    pub const INACTIVE: u64 = 0;
    /// Handed out to a caller.
    pub const ALLOCATED: u64 = 1;
    /// Freed by the caller, waiting for other streams' events.
    pub const PENDING_FREE: u64 = 2;
}

/// A snapshot as plain words: per segment [`SEGMENT_WORDS`] words (address,
/// total size, allocated size, requested size, stream, 1 if large pool,
/// block count, mapped size), followed by [`BLOCK_WORDS`] words per block
/// (address, size, requested size, state as in [`block_state`]).
pub fn snapshot_words(snap: &Snapshot) -> Vec<u64> {
    let n: usize = snap
        .segments
        .iter()
        .map(|s| SEGMENT_WORDS + BLOCK_WORDS * s.blocks.len())
        .sum();
    let mut out = Vec::with_capacity(n);
    for s in &snap.segments {
        out.extend_from_slice(&[
            s.address.0,
            s.total_size,
            s.allocated_size,
            s.requested_size,
            s.stream.0,
            u64::from(s.pool != PoolKind::Small),
            s.blocks.len() as u64,
            s.mapped_size,
        ]);
        for b in &s.blocks {
            let state = match b.state {
                BlockState::Free | BlockState::Parked | BlockState::Aliased => {
                    block_state::INACTIVE
                }
                BlockState::Allocated => block_state::ALLOCATED,
                BlockState::AwaitingEvents => block_state::PENDING_FREE,
            };
            out.extend_from_slice(&[b.address.0, b.size, b.requested_size, state]);
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
        let Some((head, tail)) = rest.split_at_checked(SEGMENT_WORDS) else {
            return Err(format!("{} words left: not a segment header", rest.len()));
        };
        let n = usize::try_from(head[6]).map_err(|_| "block count out of range")?;
        let Some((body, tail)) = n
            .checked_mul(BLOCK_WORDS)
            .and_then(|len| tail.split_at_checked(len))
        else {
            return Err(format!(
                "segment at {:#x}: {n} blocks announced, fewer given",
                head[0]
            ));
        };
        let mut blocks = Vec::with_capacity(n);
        for b in body.chunks_exact(BLOCK_WORDS) {
            let state = match b[3] {
                block_state::INACTIVE => BlockState::Free,
                block_state::ALLOCATED => BlockState::Allocated,
                block_state::PENDING_FREE => BlockState::AwaitingEvents,
                other => return Err(format!("block at {:#x}: state {other}", b[0])),
            };
            blocks.push(cachealloc_core::BlockSnapshot {
                address: DevicePtr(b[0]),
                size: b[1],
                requested_size: b[2],
                state,
                stream_uses: Vec::new(),
            });
        }
        segments.push(cachealloc_core::SegmentSnapshot {
            address: DevicePtr(head[0]),
            total_size: head[1],
            allocated_size: head[2],
            requested_size: head[3],
            stream: StreamId(head[4]),
            pool: if head[5] == 0 {
                PoolKind::Small
            } else {
                PoolKind::Large
            },
            blocks,
            mapped_size: head[7],
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

#[cfg(feature = "cuda")]
pub use exports::*;

/// The configuration of a private pool's allocator, from the device's
/// `config` (see `cachealloc_torch_pool_new`): no thread caches, slabs,
/// expandable segments or holes borrowed from another stream's segments
/// (nothing records stream events behind a capture, and a block the graph
/// freed stays where its stream left it), nothing given back on its own (no
/// garbage collection, no release on out-of-memory).
pub fn pool_config(mut config: Config) -> Config {
    config.thread_cache = 0;
    config.slab_max = 0;
    config.expandable_segments = false;
    config.borrow_holes = false;
    config.garbage_collection_threshold = None;
    config.oom_flush = false;
    config
}

#[cfg(feature = "cuda")]
mod exports {
    //! The exported functions over [`crate::cuda`]'s allocators.

    use super::*;
    use crate::cuda::CudaDevice;
    use parking_lot::Mutex;
    use std::ffi::{c_char, c_int, c_void};
    use std::panic::{catch_unwind, AssertUnwindSafe};

    type Alloc = CachingAllocator<CudaDevice>;

    /// Addresses of the pool allocators alive (handles `pool_drop` accepts).
    static POOLS: Mutex<Vec<usize>> = Mutex::new(Vec::new());

    /// Runs `f`, turning a panic into `fallback` with the last error set.
    fn guard<T>(fallback: T, f: impl FnOnce() -> T) -> T {
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
    unsafe fn handle<'a>(h: *const c_void) -> Option<&'a Alloc> {
        if h.is_null() {
            set_error("cachealloc: NULL allocator handle");
            return None;
        }
        // SAFETY: per the contract `h` points at a live `CachingAllocator<CudaDevice>`.
        Some(unsafe { &*(h as *const Alloc) })
    }

    /// The process-wide allocator of `device` (created on first use), or NULL.
    #[no_mangle]
    pub extern "C" fn cachealloc_torch_device(device: c_int) -> *const c_void {
        guard(std::ptr::null(), || match crate::cuda::allocator(device) {
            Ok(a) => a as *const Alloc as *const c_void,
            Err(e) => {
                set_error(&format!("cachealloc: device {device} unusable: {e}"));
                std::ptr::null()
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
    #[no_mangle]
    pub extern "C" fn cachealloc_torch_pool_new(device: c_int) -> *mut c_void {
        guard(std::ptr::null_mut(), || {
            let made = crate::cuda::config_from_env().and_then(|config| {
                Ok(CachingAllocator::new(
                    CudaDevice::new(device)?,
                    pool_config(config),
                ))
            });
            match made {
                Ok(a) => {
                    let p = Box::into_raw(Box::new(a));
                    POOLS.lock().push(p as usize);
                    p as *mut c_void
                }
                Err(e) => {
                    set_error(&format!("cachealloc: private pool on device {device}: {e}"));
                    std::ptr::null_mut()
                }
            }
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
    /// `h` as in `handle`; `kind` is NULL or points at a writable int.
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
    /// `h` as in `handle`; `size` is NULL or points at a writable u64.
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
    /// `h` as in `handle`.
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

    /// Writes the [`stats_vector`] into `out` (`n` ≥ [`STATS_LEN`]): 0, or -1.
    ///
    /// # Safety
    /// `h` as in `handle`; `out` points at `n` writable `int64_t`.
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
            if out.is_null() || n < STATS_LEN {
                set_error(&format!("cachealloc: stats needs {STATS_LEN} slots"));
                return -1;
            }
            let v = stats_vector(&a.stats());
            // SAFETY: `out` has room for `n` ≥ STATS_LEN values per the contract.
            unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), out, STATS_LEN) };
            0
        })
    }

    /// Resets the peaks of `h`: 0, or -1.
    ///
    /// # Safety
    /// `h` as in `handle`.
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
    /// `h` as in `handle`.
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
    /// `h` as in `handle`.
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
    /// `h` as in `handle`.
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
    /// `h` as in `handle`.
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
    /// `h` as in `handle`; `out` points at `cap` writable words (or is NULL with `cap` 0).
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
    /// `h` as in `handle`; `words` points at `n` readable words and `out` at
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
    /// `h` as in `handle`.
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

    /// Copies the calling thread's last error (NUL-terminated, truncated to
    /// `cap` bytes) into `buf`; returns its full length in bytes.
    ///
    /// # Safety
    /// `buf` points at `cap` writable bytes (or is NULL with `cap` 0).
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_last_error(buf: *mut c_char, cap: usize) -> usize {
        guard(0, || {
            let msg = last_error();
            if !buf.is_null() && cap > 0 {
                let n = msg.len().min(cap - 1);
                // SAFETY: `buf` has `cap` bytes; n + 1 ≤ cap are written.
                unsafe {
                    std::ptr::copy_nonoverlapping(msg.as_ptr(), buf as *mut u8, n);
                    *buf.add(n) = 0;
                }
            }
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
            (c.thread_cache, c.slab_max, c.expandable_segments),
            (0, 0, false)
        );
        assert!(!c.oom_flush && !c.borrow_holes);
        assert!(c.garbage_collection_threshold.is_none());
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

    #[test]
    fn stats_vector_follows_pytorchs_layout() {
        let a = alloc_1g();
        let p = a.malloc(3 << 20, StreamId(0)).unwrap();
        let q = a.malloc(1000, StreamId(0)).unwrap();
        let s = a.stats();
        let v = stats_vector(&s);
        let entries: std::collections::HashMap<String, i64> = s.entries().into_iter().collect();
        // Index of (array, group, field) as the C++ side reads it.
        let names = [
            "allocation",
            "segment",
            "active",
            "inactive_split",
            "allocated_bytes",
            "reserved_bytes",
            "active_bytes",
            "inactive_split_bytes",
            "requested_bytes",
        ];
        for (ai, name) in names.iter().enumerate() {
            for (gi, group) in ["all", "small_pool", "large_pool"].iter().enumerate() {
                for (fi, field) in ["current", "peak", "allocated", "freed"].iter().enumerate() {
                    assert_eq!(
                        v[ai * 12 + gi * 4 + fi],
                        entries[&format!("{name}.{group}.{field}")],
                        "{name}.{group}.{field}"
                    );
                }
            }
        }
        assert_eq!(v[108], entries["oversize_allocations.current"]);
        assert_eq!(v[112], entries["oversize_segments.current"]);
        assert_eq!(v[116], entries["num_alloc_retries"]);
        assert_eq!(v[117], entries["num_ooms"]);
        assert_eq!(v[119], entries["num_device_alloc"]);
        assert_eq!(v[121], -1, "unlimited max_split_size is -1");
        assert_eq!(v[0], 2, "two allocations live");
        assert_eq!(v[4], 1, "one small");
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
            let (addr, total, nblocks) = (w[i], w[i + 1], w[i + 6] as usize);
            assert_eq!(w[i + 4], 7, "stream");
            let mut sum = 0;
            for b in 0..nblocks {
                let j = i + SEGMENT_WORDS + b * BLOCK_WORDS;
                assert!(w[j] >= addr && w[j] + w[j + 1] <= addr + total);
                sum += w[j + 1];
                if w[j + 3] == block_state::ALLOCATED {
                    seen.push((w[j], w[j + 2], w[i + 5]));
                }
            }
            assert_eq!(sum, total, "blocks tile the segment");
            i += SEGMENT_WORDS + nblocks * BLOCK_WORDS;
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
        bad[SEGMENT_WORDS + 3] = 9;
        assert!(snapshot_from_words(&bad).is_err());
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
