#pragma once

// cachealloc as PyTorch's CUDA allocator, through PyTorch's whole C++
// interface (c10::cuda::CUDACachingAllocator::CUDAAllocator): the class and
// what its parts share. Each part is a file of its own:
//
//   allocator.cpp  allocation and free, the caching switch, memory fraction,
//                  record_stream; helpers; install() and the Python module
//   stats.cpp      statistics (PyTorch's DeviceStats from the core's vectors)
//   snapshot.cpp   snapshots and the allocation history
//   pools.cpp      private pools (CUDA graphs, MemPool) and their checkpoints
//   ipc.cpp        CUDA IPC (torch.multiprocessing) and peer access
//   settings.cpp   PyTorch's allocator settings at run time
//                  (torch.cuda.memory._set_allocator_settings)
//
// Every decision is the Rust core's (libcachealloc.so, C ABI in
// src/capi_torch.rs); it routes requests to the right core allocator
// (the device's, or a private pool's for CUDA graphs and MemPool), converts
// statistics and snapshots to PyTorch's structures, keeps the allocation
// history that torch.cuda.memory._record_memory_history asks for, and raises
// torch.OutOfMemoryError. It derives from PyTorch's CUDAPluggableAllocator
// only to inherit the members it does not need to change (memcpyAsync,
// copy_data, enable); every memory decision is overridden here.
//
// Built just in time by cachealloc_torch.enable() with
// torch.utils.cpp_extension.load against the user's torch (every csrc/*.cpp,
// with include/ and csrc/ on the include path).

// Only c10's and the pluggable allocator's headers: each part is compiled on
// its own, and torch/extension.h (pybind11, the whole ATen API) is for
// allocator.cpp alone, which defines the Python module.
#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cuda_runtime_api.h>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include <algorithm>
#include <array>
#include <atomic>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

// The C ABI of libcachealloc.so and its layout constants, generated from
// the Rust source (include/cachealloc.h; _build_extension passes its folder).
#include <cachealloc.h>

namespace cachealloc {

namespace CCA = c10::cuda::CUDACachingAllocator;
namespace CDA = c10::CachingDeviceAllocator;
using c10::MempoolId_t;

constexpr int kMaxDevices = CACHEALLOC_MAX_DEVICES;
// The statistics vector and the snapshot words: Note [The statistics
// vector] and Note [The snapshot words] in src/capi_torch.rs.
constexpr size_t kStatsLen = CACHEALLOC_STATS_LEN;
constexpr size_t kSegmentWords = CACHEALLOC_SEGMENT_WORDS;
constexpr size_t kBlockWords = CACHEALLOC_BLOCK_WORDS;
// max_split_size is a setting, not a sum: the one slot not added up over a
// device's allocators, and the last (the loops of stats.cpp and pools.cpp
// rely on that).
static_assert(CACHEALLOC_STATS_MAX_SPLIT_SIZE + 1 == CACHEALLOC_STATS_LEN,
              "max_split_size is the last slot of the statistics vector");
constexpr MempoolId_t kNoPool = {0, 0};

// Numbers in messages are formatted with snprintf, never through
// std::ostream: an extension built by a newer g++ than PyTorch's crashed in
// the stream's numeric facets (c10::str and c10's format_size use them).
std::string num(long long v);

std::string num_f(double v);

std::string hex(const void* p);

std::string pool_name(MempoolId_t id);

// PyTorch's format_size, through snprintf.
std::string format_size(uint64_t size);

std::string last_error();

// Makes this thread's CUDA calls legal while another stream is being
// captured (PyTorch does the same around cudaMalloc): the capture mode of
// the thread is relaxed for the guard's life. Only used while a capture or
// pool routing is under way.
struct RelaxedCapture {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  bool on;
  explicit RelaxedCapture(bool on_) : on(on_) {
    if (on) {
      cudaThreadExchangeStreamCaptureMode(&mode);
    }
  }
  ~RelaxedCapture() {
    if (on) {
      cudaThreadExchangeStreamCaptureMode(&mode);
    }
  }
};

// MemPool(allocator=...): the CUDAAllocator a pool's segments come from,
// called by the segment source functions of pools.cpp (the core asks them
// for every segment of the pool and gives every segment back to them).
// The pool owns it: the Python MemPool and allocator objects may be gone
// before the pool's last block is freed.
struct SegmentSource {
  std::shared_ptr<CCA::CUDAAllocator> allocator;
  c10::DeviceIndex device;
};

// A private pool: its own core allocator (own segments), used while a
// route to it is active (graph capture, use_mem_pool), freed when its use
// count is 0 and nothing allocated from it is alive.
struct Pool {
  c10::DeviceIndex device;
  MempoolId_t id;
  void* handle;
  int use_count = 0;
  std::unordered_set<void*> live;
  // MemPool(use_on_oom=True): while the pool is in use, its cached blocks
  // may serve the device's allocations that ran out of memory.
  bool use_on_oom = false;
  // MemPool(allocator=...): where its segments come from; null for the
  // device's memory.
  std::unique_ptr<SegmentSource> source;
};

// Rethrows, once, the exception a MemPool's allocator threw inside a
// segment source call on this thread (the call returned failure to the
// core instead: nothing unwinds through the Rust library). pools.cpp.
void rethrow_source_error();

// Forgets a pending segment source exception (before a call into the core).
void clear_source_error();

// CACHEALLOC_TORCH_DEBUG=1: trace the out-of-memory path and private-pool
// events (routes, pool allocations and frees, drops) on stderr.
bool debug_on();

void debug(const char* what);

// debug() with printf-style formatting; formats nothing when tracing is off.
template <typename... Args>
void debugf(const char* fmt, Args... args) {
  if (debug_on()) {
    std::fprintf(stderr, "cachealloc debug: ");
    std::fprintf(stderr, fmt, args...);
    std::fprintf(stderr, "\n");
    std::fflush(stderr);
  }
}

struct Route {
  MempoolId_t id;
  std::function<bool(cudaStream_t)> filter;
  Pool* pool;
};

void raw_delete_fn(void* ptr);

// Runs PyTorch's free-memory callbacks (CudaIPCCollect among them: blocks of
// tensors shared with other processes and released by them since are freed);
// whether any freed memory (ipc.cpp).
bool run_free_memory_callbacks();

// PyTorch's limit: a request of 1 EB or more is refused before any work.
constexpr size_t kOneExaByte = 1152921504606846976ULL;

// With the allocator disabled (torch.cuda.caching_allocator_enable(False)),
// PyTorch's allocator hands out plain cudaMalloc memory freed by cudaFree;
// so does this one. Such memory is outside cachealloc's statistics.
void* uncached_alloc(c10::DeviceIndex dev, size_t size);

void uncached_delete_fn(void* ptr);

class CacheallocAllocator final
    : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  CacheallocAllocator()
      : torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator(
            [](size_t, int, cudaStream_t) -> void* { return nullptr; },
            [](void*, size_t, int, cudaStream_t) {}) {
    for (auto& h : main_) {
      h.store(nullptr);
    }
    for (auto& n : nroutes_) {
      n.store(0);
    }
    fractions_.fill(1.0);
  }


  // ---- allocation and free, caching switch, fraction, record_stream (allocator.cpp) ----
  void* main_handle(c10::DeviceIndex dev);
  Pool* route(c10::DeviceIndex dev, cudaStream_t stream);
  void* alloc_on(c10::DeviceIndex dev, size_t size, cudaStream_t stream);
  void* oom_fallback(c10::DeviceIndex dev, size_t size, cudaStream_t stream);
  void track(Pool* p, void* ptr);
  void untrack(Pool* p, void* ptr);
  void* alloc_pool(Pool* p, c10::DeviceIndex dev, size_t size,
                   cudaStream_t stream);
  void report_to_profiler(c10::DeviceIndex dev, void* ptr, int64_t delta);
  void fail(c10::DeviceIndex dev, size_t size, int kind);
  void free_ptr(void* ptr);
  c10::DataPtr allocate(size_t size) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void* raw_uncached(size_t nbytes);
  void* raw_alloc(size_t nbytes) override;
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override;
  void raw_delete(void* ptr) override;
  void enable(bool value) override;
  bool isEnabled() const override;
  void init(int device_count) override;
  bool initialized() override;
  double getMemoryFraction(c10::DeviceIndex device) override;
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override;
  void recordStream(const c10::DataPtr& ptr,
                    c10::cuda::CUDAStream stream) override;

  // ---- statistics (stats.cpp) ---------------------------------------------
  std::vector<void*> handles_of(c10::DeviceIndex dev);
  std::array<int64_t, kStatsLen> raw_stats(c10::DeviceIndex dev);
  static bool accumulated(size_t i);
  CDA::DeviceStats getDeviceStats(c10::DeviceIndex dev) override;
  void resetAccumulatedStats(c10::DeviceIndex dev) override;
  void resetPeakStats(c10::DeviceIndex dev) override;
  void cacheInfo(c10::DeviceIndex dev, size_t* largestBlock) override;

  // ---- snapshots and history (snapshot.cpp) -------------------------------
  static std::vector<uint64_t> words_of(void* h);
  void add_segments(std::vector<CDA::SegmentInfo>& out, void* h,
                    c10::DeviceIndex dev, MempoolId_t owner, bool expandable);
  std::vector<CDA::SegmentInfo> segments_of(MempoolId_t mempool_id);
  CCA::SnapshotInfo snapshot(MempoolId_t mempool_id,
                             bool include_traces = true) override;
  void* getBaseAllocation(void* ptr, size_t* size) override;
  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, CCA::RecordContext when,
                     bool clearHistory,
                     const std::vector<std::string>& skip_actions) override;
  bool isHistoryEnabled() override;
  void push_trace(CDA::TraceEntry e);
  // `h`: the allocator that served the request, whose segment changes
  // (Note [Segment events]) come before the entry; nullptr for none.
  void record(CDA::TraceEntry::Action action, c10::DeviceIndex dev, void* ptr,
              size_t size, cudaStream_t stream, MempoolId_t pool,
              bool keep_context, void* h = nullptr);
  void record_free(c10::DeviceIndex dev, void* ptr, MempoolId_t pool,
                   size_t size, void* h = nullptr);
  // Note [Segment events]
  struct SegView {
    uint64_t calls = 0;  // the allocator's device calls when last looked at
    std::map<uint64_t, std::pair<uint64_t, void*>> segs;  // address: size, stream
  };
  void segment_changes(void* h, c10::DeviceIndex dev, MempoolId_t pool,
                       const std::shared_ptr<c10::GatheredContext>& ctx,
                       std::vector<CDA::TraceEntry>& out);
  void push_segment_changes(void* h, c10::DeviceIndex dev, MempoolId_t pool,
                            bool with_context);
  void forget_segments(void* h, c10::DeviceIndex dev, MempoolId_t pool);
  void push_entries(std::vector<CDA::TraceEntry>& entries);
  // Memory-viz metadata (snapshot.cpp): record_function annotations,
  // torch.compile's region markers and the user's metadata string, as
  // PyTorch's allocator keeps them (Note [History metadata]).
  void recordAnnotation(
      const std::vector<std::pair<std::string, std::string>>& md) override;
  void pushCompileContext(std::string& md) override;
  void popCompileContext() override;
  void setUserMetadata(const std::string& metadata) override;
  std::string getUserMetadata() override;
  CCA::AllocatorConfigInfo config_info(uint64_t devs);
  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override;
  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker) override;

  // ---- private pools: CUDA graphs, MemPool; checkpoints (pools.cpp) -------
  using PoolKey = std::pair<int, MempoolId_t>;
  static PoolKey key(c10::DeviceIndex dev, MempoolId_t id) {
    return PoolKey(static_cast<int>(dev), id);
  }
  Pool* find_pool(c10::DeviceIndex dev, MempoolId_t id);
  Pool* incref(c10::DeviceIndex dev, MempoolId_t id,
               std::shared_ptr<CCA::CUDAAllocator> allocator = nullptr);
  void maybe_drop(Pool* p);
  bool drop_unused_pools();
  void beginAllocateToPool(c10::DeviceIndex dev, MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override;
  void endAllocateToPool(c10::DeviceIndex dev, MempoolId_t id) override;
  void releasePool(c10::DeviceIndex dev, MempoolId_t id) override;
  void createOrIncrefPool(
      c10::DeviceIndex dev, MempoolId_t id,
      std::shared_ptr<CCA::CUDAAllocator> allocator) override;
  void setUseOnOOM(c10::DeviceIndex dev, MempoolId_t id,
                   bool use_on_oom) override;
  void setNoSplit(c10::DeviceIndex dev, MempoolId_t id) override;
  int getPoolUseCount(c10::DeviceIndex dev, MempoolId_t id) override;
  bool checkPoolLiveAllocations(
      c10::DeviceIndex dev, MempoolId_t id,
      const std::unordered_set<void*>& expected) override;
  void emptyCache(MempoolId_t mempool_id = {0, 0}) override;
  // graph_capture_record_stream_reuse: Note [Reuse during a capture]
  // (pools_mutex_ held for each).
  static bool reuse_on();
  void reuse_note_alloc(Pool* p, void* ptr, cudaStream_t stream);
  void reuse_note_use(void* ptr, cudaStream_t stream);
  void reuse_note_free(Pool* p, void* ptr);
  void reuse_reclaim(cudaStream_t stream);
  void reuse_forget(Pool* p);
  // A private pool's layout (its snapshot words) at a point CUDA graph
  // trees may come back to.
  struct PoolState : CCA::AllocatorState {
    c10::DeviceIndex device;
    MempoolId_t id;
    std::vector<uint64_t> words;
  };
  std::shared_ptr<CCA::AllocatorState> getCheckpointState(
      c10::DeviceIndex dev, MempoolId_t id) override;
  CCA::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex dev, std::shared_ptr<CCA::AllocatorState> as) override;

  // ---- CUDA IPC; peer access (ipc.cpp) -------------------------------------
  std::shared_ptr<void> getIpcDevPtr(std::string) override;
  CCA::ShareableHandle shareIpcHandle(void*) override;
  void enablePeerAccess(c10::DeviceIndex dev,
                        c10::DeviceIndex dev_to_access) override;

  // ---- run-time settings: _set_allocator_settings (settings.cpp) ---------
  void apply_settings(const std::string& conf);
  void apply_settings_to(c10::DeviceIndex dev, void* h, const std::string& conf,
                         std::string* notice);

  std::string name() override {
    return "cachealloc";
  }

 private:
  std::array<std::atomic<void*>, kMaxDevices> main_;
  std::atomic<uint64_t> devices_in_use_{0};
  std::array<double, kMaxDevices> fractions_;
  std::mutex init_mutex_;
  // Run-time settings strings, in order, for the devices used later
  // (init_mutex_).
  std::vector<std::string> settings_;
  int device_count_ = 0;
  std::atomic<bool> enabled_{true};
  std::mutex uncached_mutex_;
  std::unordered_set<void*> uncached_;
  std::atomic<size_t> n_uncached_{0};

  std::mutex pools_mutex_;
  std::map<PoolKey, std::unique_ptr<Pool>> pools_;
  std::array<std::vector<Route>, kMaxDevices> routes_;
  std::array<std::atomic<int>, kMaxDevices> nroutes_;
  std::atomic<int> captures_{0};
  std::unordered_map<void*, Pool*> pool_of_;
  std::atomic<int64_t> pool_live_{0};
  // Note [Reuse during a capture] (pools_mutex_).
  struct CaptureReuse {
    struct Block {
      Pool* pool;
      cudaStream_t stream;  // where it was allocated
      std::vector<cudaStream_t> uses;  // record_stream during the capture
    };
    struct Held {
      Pool* pool;
      cudaStream_t stream;
      std::vector<cudaGraphNode_t> markers;  // the last uses, in the graph
    };
    std::unordered_map<void*, Block> blocks;
    std::unordered_map<void*, Held> held;
    // Nodes known to precede a stream's current terminal nodes, per
    // (capture id, stream): each walk starts where the last one stopped.
    std::map<std::pair<unsigned long long, cudaStream_t>,
             std::unordered_set<cudaGraphNode_t>>
        visited;
  };
  CaptureReuse reuse_;

  std::mutex stats_mutex_;
  std::array<std::array<int64_t, kStatsLen>, kMaxDevices> base_{};
  std::array<std::array<int64_t, kStatsLen>, kMaxDevices> retired_{};

  std::mutex observers_mutex_;
  std::vector<CCA::OutOfMemoryObserver> observers_;

  std::mutex history_mutex_;
  std::atomic<bool> history_on_{false};
  CCA::CreateContextFn recorder_ = nullptr;
  CCA::RecordContext when_ = CCA::RecordContext::NEVER;
  size_t max_entries_ = 1;
  std::unordered_set<int> skip_;
  std::array<std::vector<CDA::TraceEntry>, kMaxDevices> traces_;
  std::array<size_t, kMaxDevices> ring_next_{};
  std::unordered_map<void*, std::shared_ptr<c10::GatheredContext>> contexts_;
  // Note [Segment events]: the segments each allocator had when last
  // looked at, while history is on (seg_mutex_; taken after pools_mutex_,
  // before history_mutex_).
  std::mutex seg_mutex_;
  std::unordered_map<void*, SegView> seg_views_;
  // record_function annotations while history is on: a ring of
  // max_entries_, as PyTorch's (history_mutex_).
  std::vector<CDA::AnnotationEntry> annotations_;
  size_t annotations_next_ = 0;
  // Converts the entries' TSC times to microseconds since the epoch in
  // snapshots (PyTorch's time_us).
  c10::ApproximateClockToUnixTimeConverter clock_converter_;
};

// The installed allocator. Never destroyed: tensors may be freed during
// interpreter shutdown.
std::shared_ptr<CacheallocAllocator>& instance();

// Makes torch.cuda.memory._set_allocator_settings reach the installed
// allocator (settings.cpp).
void register_settings_hook();

}  // namespace cachealloc
