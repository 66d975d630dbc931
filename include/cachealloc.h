/* cachealloc's C ABI: libcachealloc.so, built with `--features cuda`.
 *
 * Two sets of functions. cachealloc_* is PyTorch's CUDAPluggableAllocator
 * interface and the calls around it (the Python package's ctypes table);
 * cachealloc_torch_* is what the C++ allocator of
 * python/cachealloc_torch/csrc/ calls. Streams are cudaStream_t passed as
 * void*. The rules (errors, strings, NULL) are in the Rust documentation of
 * both modules. */

#ifndef CACHEALLOC_H
#define CACHEALLOC_H

/* Generated from src/capi.rs, src/capi_torch.rs and the files of src/capi_torch/ by cbindgen (cbindgen.toml):
 * do not edit. `CACHEALLOC_UPDATE_ABI=1 cargo test --lib abi_` rewrites it. */

#include <stddef.h>
#include <stdint.h>

// Device ordinals the C ABI accepts (0..MAX_DEVICES).
#define CACHEALLOC_MAX_DEVICES 64

// Offset of a statistic's current value.
#define CACHEALLOC_STAT_CURRENT 0

// Offset of a statistic's peak.
#define CACHEALLOC_STAT_PEAK 1

// Offset of a statistic's total allocated (accumulated).
#define CACHEALLOC_STAT_ALLOCATED 2

// Offset of a statistic's total freed (accumulated).
#define CACHEALLOC_STAT_FREED 3

// Slots per statistic: current, peak, allocated, freed.
#define CACHEALLOC_STAT_FIELDS 4

// Statistic of a stat array for all pools together (PyTorch's `StatType::AGGREGATE`).
#define CACHEALLOC_STAT_AGGREGATE 0

// Statistic of a stat array for the small pool (`StatType::SMALL_POOL`).
#define CACHEALLOC_STAT_SMALL_POOL 1

// Statistic of a stat array for the large pool (`StatType::LARGE_POOL`).
#define CACHEALLOC_STAT_LARGE_POOL 2

// Statistics per stat array (aggregate, small pool, large pool).
#define CACHEALLOC_STAT_GROUPS 3

// Slots per stat array.
#define CACHEALLOC_STAT_ARRAY_LEN 12

// Where the stat array `allocation` starts.
#define CACHEALLOC_STATS_ALLOCATION 0

// Where the stat array `segment` starts.
#define CACHEALLOC_STATS_SEGMENT 12

// Where the stat array `active` starts.
#define CACHEALLOC_STATS_ACTIVE 24

// Where the stat array `inactive_split` starts.
#define CACHEALLOC_STATS_INACTIVE_SPLIT 36

// Where the stat array `allocated_bytes` starts.
#define CACHEALLOC_STATS_ALLOCATED_BYTES 48

// Where the stat array `reserved_bytes` starts.
#define CACHEALLOC_STATS_RESERVED_BYTES 60

// Where the stat array `active_bytes` starts.
#define CACHEALLOC_STATS_ACTIVE_BYTES 72

// Where the stat array `inactive_split_bytes` starts.
#define CACHEALLOC_STATS_INACTIVE_SPLIT_BYTES 84

// Where the stat array `requested_bytes` starts.
#define CACHEALLOC_STATS_REQUESTED_BYTES 96

// Number of stat arrays.
#define CACHEALLOC_STAT_ARRAYS 9

// Where the statistic `oversize_allocations` starts (one statistic, no pools).
#define CACHEALLOC_STATS_OVERSIZE_ALLOCATIONS 108

// Where the statistic `oversize_segments` starts (one statistic, no pools).
#define CACHEALLOC_STATS_OVERSIZE_SEGMENTS 112

// The counter `num_alloc_retries` (accumulated).
#define CACHEALLOC_STATS_NUM_ALLOC_RETRIES 116

// The counter `num_ooms` (accumulated).
#define CACHEALLOC_STATS_NUM_OOMS 117

// The counter `num_sync_all_streams` (accumulated).
#define CACHEALLOC_STATS_NUM_SYNC_ALL_STREAMS 118

// The counter `num_device_alloc` (accumulated).
#define CACHEALLOC_STATS_NUM_DEVICE_ALLOC 119

// The counter `num_device_free` (accumulated).
#define CACHEALLOC_STATS_NUM_DEVICE_FREE 120

// `max_split_size` in bytes, -1 when unlimited (a setting, not accumulated; the last slot).
#define CACHEALLOC_STATS_MAX_SPLIT_SIZE 121

// Length of the statistics vector.
#define CACHEALLOC_STATS_LEN 122

// Segment word: the segment's address.
#define CACHEALLOC_SEGMENT_ADDRESS 0

// Segment word: its total size.
#define CACHEALLOC_SEGMENT_TOTAL_SIZE 1

// Segment word: bytes of its blocks handed out.
#define CACHEALLOC_SEGMENT_ALLOCATED_SIZE 2

// Segment word: bytes requested by its blocks handed out.
#define CACHEALLOC_SEGMENT_REQUESTED_SIZE 3

// Segment word: its stream.
#define CACHEALLOC_SEGMENT_STREAM 4

// Segment word: 1 when it belongs to the large (or huge) pool, 0 small.
#define CACHEALLOC_SEGMENT_IS_LARGE 5

// Segment word: the number of its blocks (their words follow).
#define CACHEALLOC_SEGMENT_BLOCKS 6

// Segment word: bytes of it backed by memory (expandable segments map part).
#define CACHEALLOC_SEGMENT_MAPPED_SIZE 7

// Words per segment header.
#define CACHEALLOC_SEGMENT_WORDS 8

// Block word: the block's address.
#define CACHEALLOC_BLOCK_ADDRESS 0

// Block word: its size.
#define CACHEALLOC_BLOCK_SIZE 1

// Block word: the size requested for it (0 when free).
#define CACHEALLOC_BLOCK_REQUESTED_SIZE 2

// Block word: its state, a `CACHEALLOC_BLOCK_STATE_*`.
#define CACHEALLOC_BLOCK_STATE 3

// Words per block.
#define CACHEALLOC_BLOCK_WORDS 4

// Block state: free (in the bins or a thread cache).
#define CACHEALLOC_BLOCK_STATE_INACTIVE 0

// Block state: handed out to a caller.
#define CACHEALLOC_BLOCK_STATE_ALLOCATED 1

// Block state: freed by the caller, waiting for other streams' events.
#define CACHEALLOC_BLOCK_STATE_PENDING_FREE 2

// IPC statistic: handles of other processes open on the device now.
#define CACHEALLOC_IPC_STATS_OPEN 0

// IPC statistic: users of those handles (tensors' storages here).
#define CACHEALLOC_IPC_STATS_USERS 1

// IPC statistic: handles opened so far (all devices).
#define CACHEALLOC_IPC_STATS_OPENED 2

// IPC statistic: handles closed so far (all devices).
#define CACHEALLOC_IPC_STATS_CLOSED 3

// IPC statistic: blocks of the device's allocator shared and not freed (pinned).
#define CACHEALLOC_IPC_STATS_PINNED_BLOCKS 4

// IPC statistic: their bytes.
#define CACHEALLOC_IPC_STATS_PINNED_BYTES 5

// IPC statistic: pages of the device exported as file descriptors, kept open.
#define CACHEALLOC_IPC_STATS_EXPORTED_PAGES 6

// IPC statistic: 1 when the device's pages of expandable segments are
// created shareable, 0 when not (their blocks cannot be shared), -1 when the
// device has no allocator yet or no virtual memory API.
#define CACHEALLOC_IPC_STATS_PAGES_SHAREABLE 7

// Length of the IPC statistics vector.
#define CACHEALLOC_IPC_STATS_LEN 8

// A segment source's allocation function: a segment of `size` bytes on
// `device` for `stream` (a `cudaStream_t`), or NULL when it has none (out
// of memory, or any failure). `ctx` is the context given with it. It must
// not unwind (a C++ implementation catches every exception).
typedef void *(*CacheallocSegmentAlloc)(void *ctx, size_t size, int device, void *stream);

// A segment source's free function: gives back `ptr`, a segment of `size`
// bytes its allocation function returned for `device` and `stream`; 0 on
// success, anything else on failure (the segment is then kept). It must
// not unwind.
typedef int (*CacheallocSegmentFree)(void *ctx, void *ptr, size_t size, int device, void *stream);

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// Allocates `size` bytes on `device` for use on `stream` (PyTorch's `alloc_fn`).
// NULL for size 0 (no error) and on failure (see the module documentation).
void *cachealloc_alloc(ptrdiff_t size, int device, void *stream);

// Returns `ptr` to the cache (PyTorch's `free_fn`). Misuse is ignored with the last error set.
void cachealloc_free(void *ptr, ptrdiff_t size, int device, void *_stream);

// PyTorch's init hook: called with the number of devices when CUDA initialises.
void cachealloc_init(int device_count);

// PyTorch's reset hook (`torch.cuda.empty_cache()`): empties the cache of every device in use.
void cachealloc_reset(void);

// PyTorch's memory-fraction hook (`torch.cuda.set_per_process_memory_fraction`).
void cachealloc_set_memory_fraction(double fraction, int device);

// PyTorch's record-stream hook (`tensor.record_stream(s)`).
void cachealloc_record_stream(void *ptr, void *stream);

// Empties the cache of `device`; bytes released, or -1.
int64_t cachealloc_empty_cache(int device);

// Resets the peak statistics of `device`; 0, or -1.
int cachealloc_reset_peak_stats(int device);

// `memory_stats()` of `device` as JSON (PyTorch's key names); free with `cachealloc_string_free`.
char *cachealloc_stats_json(int device);

// The fragmentation report of `device` as text; free with `cachealloc_string_free`.
char *cachealloc_fragmentation(int device);

// The fragmentation figures of `device` as JSON; free with `cachealloc_string_free`.
char *cachealloc_fragmentation_json(int device);

// Every segment and block of `device` as JSON; free with `cachealloc_string_free`.
char *cachealloc_snapshot_json(int device);

// Configuration, notices, cap and device name of `device` as JSON; free with `cachealloc_string_free`.
char *cachealloc_info_json(int device);

// Starts recording `device` into the trace file at `path` (UTF-8); 0, or -1.
//
// # Safety
// `path` is NULL or a NUL-terminated string.
int cachealloc_record_trace_start(int device, const char *path);

// Stops recording `device`; events written, or -1.
int64_t cachealloc_record_trace_stop(int device);

// The calling thread's last error (a copy; free with `cachealloc_string_free`), or NULL.
char *cachealloc_last_error(void);

// Clears the calling thread's last error.
void cachealloc_clear_error(void);

// Errors recorded so far by all threads.
uint64_t cachealloc_error_count(void);

// Frees a string returned by this library. NULL is ignored.
//
// # Safety
// `s` is NULL or a string returned by a `cachealloc_*` function, freed once.
void cachealloc_string_free(char *s);

// Installs the out-of-memory handler (NULL removes it); see the module
// documentation. (The type is [`OomHandler`], spelled out for the header.)
void cachealloc_set_oom_handler(void (*handler)(const char*, const char*, uint32_t, const char*));

// The process-wide allocator of `device` (created on first use), or NULL.
void *cachealloc_torch_device(int device);

// A new private pool allocator on `device` (own segments; same
// configuration, without thread caches, slabs or expandable segments,
// so that nothing records stream events behind a CUDA graph capture,
// and with PyTorch's 20 MiB medium segments: a pool's peak starts at
// zero with the capture, so segments sized from it would be 2 MiB for
// all it holds), or NULL. It never gives segments back on its own (no release before
// growing, no garbage collection, no release on out-of-memory): a captured graph keeps using the pool's free blocks, so only
// `empty_cache` or dropping the pool, once nobody uses it, releases them.
// Its segments count against the device's memory fraction (the cap of
// `cachealloc_torch_device`'s allocator), and the device allocator's
// room shrinks by them (Note [Shared cap] in `cachealloc_core::supply`).
void *cachealloc_torch_pool_new(int device);

// Drops a pool allocator after releasing its segments: 0; -1 (nothing
// done) when `h` is not a live pool handle or blocks are still allocated.
int cachealloc_torch_pool_drop(void *h);

// Allocates `size` bytes for `stream`; NULL for size 0 (kind 0) and on
// failure (kind 1 out of memory, 2 other error; last error set).
//
// # Safety
// `h` is NULL or a live handle (`cachealloc_torch_device`, or
// `cachealloc_torch_pool_new` not yet dropped); `kind` is NULL or points at a writable int.
void *cachealloc_torch_alloc(const void *h, size_t size, void *stream, int *kind);

// Frees `ptr`: 0; -2 when this allocator does not own it; -1 on other
// misuse. On success `*size` (when `size` is not NULL) is the size that
// was requested (for the profiler's memory events).
//
// # Safety
// `h` is NULL or a live handle (`cachealloc_torch_device`, or
// `cachealloc_torch_pool_new` not yet dropped); `size` is NULL or points at a writable u64.
int cachealloc_torch_free(const void *h, void *ptr, uint64_t *size);

// Marks `ptr` as used on `stream` too: 0; -2 when not this allocator's; -1 otherwise.
//
// # Safety
// `h` is NULL or a live handle (`cachealloc_torch_device`, or
// `cachealloc_torch_pool_new` not yet dropped).
int cachealloc_torch_record_stream(const void *h, void *ptr, void *stream);

// Writes the [`stats_vector`] into `out` (`n` ≥ `CACHEALLOC_STATS_LEN`): 0, or -1.
//
// # Safety
// `h` is NULL or a live handle (`cachealloc_torch_device`, or
// `cachealloc_torch_pool_new` not yet dropped); `out` points at `n` writable `int64_t`.
int cachealloc_torch_stats(const void *h, int64_t *out, size_t n);

// Resets the peaks of `h`: 0, or -1.
//
// # Safety
// `h` is NULL or a live handle (`cachealloc_torch_device`, or
// `cachealloc_torch_pool_new` not yet dropped).
int cachealloc_torch_reset_peak(const void *h);

// Releases every entirely free segment of `h`: bytes released, or -1.
//
// # Safety
// `h` is NULL or a live handle (`cachealloc_torch_device`, or
// `cachealloc_torch_pool_new` not yet dropped).
int64_t cachealloc_torch_empty_cache(const void *h);

// The largest cached free block of `h` in bytes, or -1.
//
// # Safety
// `h` is NULL or a live handle (`cachealloc_torch_device`, or
// `cachealloc_torch_pool_new` not yet dropped).
int64_t cachealloc_torch_largest_free(const void *h);

// The largest block `h` could hand out now, device memory included, or -1.
//
// # Safety
// `h` is NULL or a live handle (`cachealloc_torch_device`, or
// `cachealloc_torch_pool_new` not yet dropped).
int64_t cachealloc_torch_cache_info(const void *h);

// Caps the reserved memory of `h` at `fraction` of the device: 0, or -1.
//
// # Safety
// `h` is NULL or a live handle (`cachealloc_torch_device`, or
// `cachealloc_torch_pool_new` not yet dropped).
int cachealloc_torch_set_fraction(const void *h, double fraction);

// Writes the [`snapshot_words`] of `h` into `out` when they fit in
// `cap` words; returns the number of words (larger than `cap`: nothing
// written, call again with more room), or -1.
//
// # Safety
// `h` is NULL or a live handle (`cachealloc_torch_device`, or
// `cachealloc_torch_pool_new` not yet dropped); `out` points at `cap` writable words (or is NULL with `cap` 0).
int64_t cachealloc_torch_snapshot(const void *h,
                                  uint64_t *out,
                                  size_t cap);

// Sets `h`'s blocks back to the layout of `words[..n]` (its own
// snapshot words, taken earlier; nothing may be allocated now): the
// number of addresses allocated again, written to `out[..cap]`; -1 on
// error (nothing changed; last error set).
//
// # Safety
// `h` is NULL or a live handle (`cachealloc_torch_device`, or
// `cachealloc_torch_pool_new` not yet dropped); `words` points at `n` readable words and `out` at
// `cap` writable ones (each may be NULL when its count is 0).
int64_t cachealloc_torch_restore(const void *h,
                                 const uint64_t *words,
                                 size_t n,
                                 uint64_t *out,
                                 size_t cap);

// 1 when `h` uses expandable (page-backed) segments, 0 when plain, -1 on error.
//
// # Safety
// `h` is NULL or a live handle (`cachealloc_torch_device`, or
// `cachealloc_torch_pool_new` not yet dropped).
int cachealloc_torch_is_expandable(const void *h);

// Lets device `peer` read and write the expandable-segment pages of
// `device` (every allocator of it, pages mapped now and later), for
// PyTorch's `enablePeerAccess`; plain segments need only
// `cudaDeviceEnablePeerAccess`. 0, or -1 with the last error set.
int cachealloc_torch_enable_peer_access(int device, int peer);

// Applies PyTorch's allocator settings string `conf` (UTF-8) to `h` while
// it runs ([`apply_settings`]): -1 on error (PyTorch's message in the last
// error; nothing changed); otherwise the length in bytes of the notice
// about settings that stay as the allocator started (0: none), written
// NUL-terminated and truncated to `cap` bytes into `notice`. `*fraction`
// (when `fraction` is not NULL) is the memory fraction the string set,
// or -1 when it set none.
//
// # Safety
// `h` is NULL or a live handle (`cachealloc_torch_device`, or
// `cachealloc_torch_pool_new` not yet dropped); `conf` is NULL or a
// NUL-terminated string; `fraction` is NULL or writable; `notice` points
// at `cap` writable bytes (or is NULL with `cap` 0).
int64_t cachealloc_torch_apply_settings(const void *h,
                                        const char *conf,
                                        double *fraction,
                                        char *notice,
                                        size_t cap);

// Copies the calling thread's last error (NUL-terminated, truncated to
// `cap` bytes) into `buf`; returns its full length in bytes.
//
// # Safety
// `buf` points at `cap` writable bytes (or is NULL with `cap` 0).
size_t cachealloc_torch_last_error(char *buf, size_t cap);

// Shares the block at `ptr` of allocator `h` (PyTorch's
// `shareIpcHandle`): writes its handle (Note [IPC handles]) to `out`
// when it fits in `cap` bytes, and the block's offset from what the
// handle names to `*offset`; returns the handle's length (larger than
// `cap`: nothing written, call again with room). -2 when `h` did not
// hand `ptr` out (no error set: the caller asks each allocator in
// turn); -1 on any other error (the last error says why: a freed block,
// a pointer inside a block, pages that are not shareable, ...). A block
// of an expandable segment stays pinned until freed (Note [Shared
// blocks are pinned]).
//
// # Safety
// `h` is NULL or a live allocator handle (`cachealloc_torch_device`, or
// `cachealloc_torch_pool_new` not yet dropped); `out` points at `cap`
// writable bytes (or is NULL with `cap` 0); `offset` is NULL or writable.
int64_t cachealloc_torch_ipc_share(const void *h,
                                   void *ptr,
                                   uint8_t *out,
                                   size_t cap,
                                   int64_t *offset);

// Opens a handle another process shared (PyTorch's `getIpcDevPtr`) on
// `device`: the address here of what it names (add the offset the
// sender gave), or NULL with the last error set (a malformed handle, a
// sender that exited, a kernel that forbids taking its descriptors,
// ...). A handle already open here gives the same address, counted:
// every open is matched by one `cachealloc_torch_ipc_close`.
//
// # Safety
// `handle` points at `len` readable bytes.
void *cachealloc_torch_ipc_open(int device, const uint8_t *handle, size_t len);

// One user of the handle opened at `ptr` on `device` is done; the last
// one unmaps it. 0, or -1 with the last error set (no handle open
// there, or the driver refused to unmap).
int cachealloc_torch_ipc_close(int device, void *ptr);

// Writes the `CACHEALLOC_IPC_STATS_LEN` IPC statistics of `device`
// (`CACHEALLOC_IPC_STATS_*`) into `out` (`n` ≥ that): 0, or -1.
//
// # Safety
// `out` points at `n` writable `int64_t`.
int cachealloc_torch_ipc_stats(int device, int64_t *out, size_t n);

// A new private pool allocator on `device` whose plain segments come
// from `alloc` and go back through `free`, called with `ctx` (PyTorch's
// `MemPool(allocator=...)`), or NULL (last error set; also when `alloc`
// or `free` is NULL). Otherwise as `cachealloc_torch_pool_new`; drop it
// with `cachealloc_torch_pool_drop`, which gives every cached segment
// back through `free`.
//
// # Safety
// `alloc` and `free` follow the contracts of their types and may be
// called with `ctx` from any thread (one call at a time) until the pool
// is dropped; they must not call into this pool.
void *cachealloc_torch_pool_new_sourced(int device,
                                        CacheallocSegmentAlloc alloc,
                                        CacheallocSegmentFree free,
                                        void *ctx);

// Makes the allocator `h` hand its blocks out whole, never split
// (`no_split` non-zero; PyTorch's `MemPool(no_split=True)`), or split
// them again (0): 0, or -1.
//
// # Safety
// `h` is NULL or a live handle (`cachealloc_torch_device`, or a pool
// handle not yet dropped).
int cachealloc_torch_pool_set_no_split(const void *h, int no_split);

// `size` bytes for `stream` from the blocks `h` has cached, without
// asking for a segment or releasing one (a `MemPool(use_on_oom=True)`
// lending its memory to an allocation that ran out). NULL with `*kind`
// 1 when no cached block fits, or 2 on misuse (last error set); `*kind`
// 0 with the address. The block is freed with `cachealloc_torch_free`
// on `h`.
//
// # Safety
// `h` is NULL or a live handle; `kind` is NULL or points at a writable int.
void *cachealloc_torch_alloc_cached(const void *h, size_t size, void *stream, int *kind);

// Hands back the block at `ptr` that a free held behind a CUDA graph
// capture: it joins its pool's free blocks at once, with no guarding
// event (the caller has checked in the graph being captured that its
// last uses come before anything the block's stream does next).
// Returns 1 when such a block was there, 0 when not (nothing changes),
// -1 on a NULL handle or a panic (the last error says which).
//
// # Safety
// `h` is NULL or a live handle (`cachealloc_torch_device`, or
// `cachealloc_torch_pool_new` not yet dropped).
int cachealloc_torch_reclaim(const void *h, void *ptr);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* CACHEALLOC_H */
