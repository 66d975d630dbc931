// cachealloc as PyTorch's CUDA allocator, through PyTorch's whole C++
// interface (c10::cuda::CUDACachingAllocator::CUDAAllocator).
//
// Every decision is the Rust core's (libcachealloc.so, C ABI in
// src/capi_torch.rs); this file routes requests to the right core allocator
// (the device's, or a private pool's for CUDA graphs and MemPool), converts
// statistics and snapshots to PyTorch's structures, keeps the allocation
// history that torch.cuda.memory._record_memory_history asks for, and raises
// torch.OutOfMemoryError. It derives from PyTorch's CUDAPluggableAllocator
// only to inherit the members it does not need to change (memcpyAsync,
// copy_data, enable); every memory decision is overridden here.
//
// Built just in time by cachealloc_torch.enable() with
// torch.utils.cpp_extension.load against the user's torch.

#include <torch/extension.h>

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cuda_runtime_api.h>
#include <execinfo.h>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <unistd.h>

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
// device's allocators, and the last (the loops below rely on that).
static_assert(CACHEALLOC_STATS_MAX_SPLIT_SIZE + 1 == CACHEALLOC_STATS_LEN,
              "max_split_size is the last slot of the statistics vector");
constexpr MempoolId_t kNoPool = {0, 0};

// Numbers in messages are formatted with snprintf, never through
// std::ostream: an extension built by a newer g++ than PyTorch's crashed in
// the stream's numeric facets (c10::str and c10's format_size use them).
std::string num(long long v) {
  return std::to_string(v);
}

std::string num_f(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

std::string hex(const void* p) {
  char b[32];
  std::snprintf(b, sizeof b, "%p", p);
  return b;
}

std::string pool_name(MempoolId_t id) {
  return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}

// PyTorch's format_size, through snprintf.
std::string format_size(uint64_t size) {
  char b[64];
  if (size <= 1024) {
    std::snprintf(b, sizeof b, "%llu bytes", static_cast<unsigned long long>(size));
  } else if (size <= 1048576) {
    std::snprintf(b, sizeof b, "%.2f KiB", static_cast<double>(size) / 1024.0);
  } else if (size <= 1073741824ULL) {
    std::snprintf(b, sizeof b, "%.2f MiB", static_cast<double>(size) / 1048576.0);
  } else {
    std::snprintf(b, sizeof b, "%.2f GiB", static_cast<double>(size) / 1073741824.0);
  }
  return b;
}

std::string last_error() {
  char buf[4096];
  size_t n = cachealloc_torch_last_error(buf, sizeof buf);
  return n == 0 ? std::string("unknown error") : std::string(buf);
}

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

// A private pool: its own core allocator (own segments), used while a
// route to it is active (graph capture, use_mem_pool), freed when its use
// count is 0 and nothing allocated from it is alive.
struct Pool {
  c10::DeviceIndex device;
  MempoolId_t id;
  void* handle;
  int use_count = 0;
  std::unordered_set<void*> live;
  // MemPool(use_on_oom=True): the device's allocations may come from here
  // when the device's own allocator is out of memory.
  bool use_on_oom = false;
};

// CACHEALLOC_TORCH_DEBUG=1: trace the out-of-memory path and private-pool
// events (routes, pool allocations and frees, drops) on stderr.
bool debug_on() {
  static const bool on = [] {
    const char* v = std::getenv("CACHEALLOC_TORCH_DEBUG");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();
  return on;
}

void debug(const char* what) {
  if (debug_on()) {
    std::fprintf(stderr, "cachealloc debug: %s\n", what);
    std::fflush(stderr);
  }
}

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

// PyTorch's limit: a request of 1 EB or more is refused before any work.
constexpr size_t kOneExaByte = 1152921504606846976ULL;

// With the allocator disabled (torch.cuda.caching_allocator_enable(False)),
// PyTorch's allocator hands out plain cudaMalloc memory freed by cudaFree;
// so does this one. Such memory is outside cachealloc's statistics.
void* uncached_alloc(c10::DeviceIndex dev, size_t size) {
  if (size == 0) {
    return nullptr;
  }
  c10::cuda::CUDAGuard guard(dev);
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, size);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ",
                     format_size(size), " (caching allocator disabled)");
  }
  C10_CUDA_CHECK(err);
  return p;
}

void uncached_delete_fn(void* ptr) {
  if (ptr != nullptr) {
    C10_CUDA_CHECK(cudaFree(ptr));
  }
}

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

  // ---- allocation --------------------------------------------------------

  void* main_handle(c10::DeviceIndex dev) {
    TORCH_CHECK(
        dev >= 0 && dev < kMaxDevices, "cachealloc: device " + num(dev) +
        " outside 0.." + num(kMaxDevices));
    void* h = main_[dev].load(std::memory_order_acquire);
    if (C10_LIKELY(h != nullptr)) {
      return h;
    }
    std::lock_guard<std::mutex> g(init_mutex_);
    h = main_[dev].load(std::memory_order_acquire);
    if (h == nullptr) {
      h = cachealloc_torch_device(dev);
      TORCH_CHECK(h != nullptr, last_error());
      if (fractions_[dev] < 1.0) {
        cachealloc_torch_set_fraction(h, fractions_[dev]);
      }
      main_[dev].store(h, std::memory_order_release);
      devices_in_use_.fetch_or(1ull << dev);
    }
    return h;
  }

  // The pool a request on `stream` goes to, or nullptr (the device's).
  Pool* route(c10::DeviceIndex dev, cudaStream_t stream) {
    std::lock_guard<std::mutex> g(pools_mutex_);
    auto& rs = routes_[dev];
    for (auto it = rs.rbegin(); it != rs.rend(); ++it) {
      if (it->filter(stream)) {
        return it->pool;
      }
    }
    return nullptr;
  }

  void* alloc_on(c10::DeviceIndex dev, size_t size, cudaStream_t stream) {
    if (size == 0) {
      return nullptr;
    }
    TORCH_CHECK_WITH(OutOfMemoryError, size < kOneExaByte,
                     "CUDA out of memory. Tried to allocate more than 1EB memory.");
    void* h = main_handle(dev);
    if (C10_UNLIKELY(nroutes_[dev].load(std::memory_order_acquire) > 0)) {
      if (Pool* p = route(dev, stream)) {
        return alloc_pool(p, dev, size, stream);
      }
    }
    int kind = 0;
    void* ptr;
    {
      RelaxedCapture rc(captures_.load(std::memory_order_relaxed) > 0);
      ptr = cachealloc_torch_alloc(h, size, stream, &kind);
    }
    if (C10_UNLIKELY(ptr == nullptr) && kind == 1 && captures_.load() == 0 &&
        drop_unused_pools()) {
      // Out of memory: pools kept after a capture give their memory back first.
      ptr = cachealloc_torch_alloc(h, size, stream, &kind);
    }
    if (C10_UNLIKELY(ptr == nullptr)) {
      if (kind == 1) {
        if (Pool* p = oom_pool(dev)) {
          return alloc_pool(p, dev, size, stream);
        }
      }
      fail(dev, size, kind);
    }
    if (C10_UNLIKELY(history_on_.load(std::memory_order_relaxed))) {
      record(CDA::TraceEntry::ALLOC, dev, ptr, size, stream, kNoPool, true);
    }
    if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
      report_to_profiler(dev, ptr, static_cast<int64_t>(size));
    }
    if (C10_UNLIKELY(captures_.load(std::memory_order_relaxed) > 0)) {
      debugf("device %d alloc %p size %zu stream %p during a pool route",
             (int)dev, ptr, size, (void*)stream);
    }
    return ptr;
  }

  // A pool of the device marked use_on_oom, or nullptr.
  Pool* oom_pool(c10::DeviceIndex dev) {
    std::lock_guard<std::mutex> g(pools_mutex_);
    for (auto& [key, p] : pools_) {
      if (p->device == dev && p->use_on_oom) {
        return p.get();
      }
    }
    return nullptr;
  }

  // Registers `ptr` as a live block of private pool `p`, so that a free
  // finds its pool (the caller holds pools_mutex_).
  void track(Pool* p, void* ptr) {
    p->live.insert(ptr);
    pool_of_[ptr] = p;
    pool_live_.fetch_add(1, std::memory_order_relaxed);
  }

  // Forgets the live block `ptr` of private pool `p` (the caller holds
  // pools_mutex_).
  void untrack(Pool* p, void* ptr) {
    p->live.erase(ptr);
    pool_of_.erase(ptr);
    pool_live_.fetch_sub(1, std::memory_order_relaxed);
  }

  void* alloc_pool(Pool* p, c10::DeviceIndex dev, size_t size,
                   cudaStream_t stream) {
    int kind = 0;
    void* ptr;
    {
      RelaxedCapture rc(true);
      ptr = cachealloc_torch_alloc(p->handle, size, stream, &kind);
    }
    if (ptr == nullptr) {
      fail(dev, size, kind);
    }
    debugf("pool (%llu,%llu) alloc %p size %zu stream %p",
           (unsigned long long)p->id.first, (unsigned long long)p->id.second,
           ptr, size, (void*)stream);
    {
      std::lock_guard<std::mutex> g(pools_mutex_);
      track(p, ptr);
    }
    if (C10_UNLIKELY(history_on_.load(std::memory_order_relaxed))) {
      record(CDA::TraceEntry::ALLOC, dev, ptr, size, stream, p->id, true);
    }
    if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
      report_to_profiler(dev, ptr, static_cast<int64_t>(size));
    }
    return ptr;
  }

  // torch.profiler's memory events (profile_memory=True): the change in
  // bytes with the device's totals after it, as PyTorch's allocator reports.
  void report_to_profiler(c10::DeviceIndex dev, void* ptr, int64_t delta) {
    auto st = getDeviceStats(dev);
    c10::reportMemoryUsageToProfiler(
        ptr, delta, static_cast<size_t>(st.allocated_bytes[0].current),
        static_cast<size_t>(st.reserved_bytes[0].current),
        c10::Device(c10::DeviceType::CUDA, dev));
  }

  void fail(c10::DeviceIndex dev, size_t size, int kind) {
    debug("fail: begin");
    std::string why = last_error();
    debug(why.c_str());
    if (kind != 1) {
      TORCH_CHECK(false, "cachealloc: allocation of " + num(size) +
                  " bytes on device " + num(dev) + " failed: " + why);
    }
    size_t free_b = 0, total_b = 0;
    {
      c10::cuda::CUDAGuard guard(dev);
      if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
        (void)cudaGetLastError();
      }
    }
    debug("fail: stats");
    auto st = getDeviceStats(dev);
    debug("fail: observers");
    int64_t allocated = st.allocated_bytes[0].current;
    int64_t reserved = st.reserved_bytes[0].current;
    {
      std::vector<CCA::OutOfMemoryObserver> obs;
      {
        std::lock_guard<std::mutex> g(observers_mutex_);
        obs = observers_;
      }
      for (auto& o : obs) {
        o(dev, allocated, total_b, free_b);
      }
    }
    if (history_on_.load()) {
      record(CDA::TraceEntry::OOM, dev, reinterpret_cast<void*>(free_b), size,
             nullptr, kNoPool, false);
    }
    debug("fail: throw");
    TORCH_CHECK_WITH(
        OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ",
        format_size(size), ". GPU ", num(dev), " has a total capacity of ",
        format_size(total_b), " of which ", format_size(free_b),
        " is free. Of the allocated memory ", format_size(allocated),
        " is allocated by PyTorch, and ",
        format_size(reserved > allocated ? reserved - allocated : 0),
        " is reserved by PyTorch but unallocated. ", why);
  }

  // Frees `ptr` in the allocator that owns it; a pointer no allocator of
  // ours handed out raises (as PyTorch's allocator does).
  void free_ptr(void* ptr) {
    if (ptr == nullptr) {
      return;
    }
    bool relaxed = captures_.load(std::memory_order_relaxed) > 0;
    if (C10_UNLIKELY(pool_live_.load(std::memory_order_relaxed) > 0)) {
      std::unique_lock<std::mutex> g(pools_mutex_);
      auto it = pool_of_.find(ptr);
      if (it != pool_of_.end()) {
        Pool* p = it->second;
        untrack(p, ptr);
        int rc;
        uint64_t size = 0;
        {
          RelaxedCapture r(true);
          rc = cachealloc_torch_free(p->handle, ptr, &size);
        }
        TORCH_CHECK(rc == 0, "cachealloc: free in private pool: ", last_error());
        debugf("pool (%llu,%llu) free %p (%zu live)",
               (unsigned long long)p->id.first, (unsigned long long)p->id.second,
               ptr, p->live.size());
        // The pool may be dropped here: keep what the history needs first.
        c10::DeviceIndex pdev = p->device;
        MempoolId_t pid = p->id;
        maybe_drop(p);
        g.unlock();
        if (history_on_.load()) {
          record_free(pdev, ptr, pid, size);
        }
        if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
          report_to_profiler(pdev, ptr, -static_cast<int64_t>(size));
        }
        return;
      }
    }
    uint64_t devs = devices_in_use_.load(std::memory_order_relaxed);
    c10::DeviceIndex first = 0;
    if ((devs & (devs - 1)) != 0) {
      first = c10::cuda::current_device();  // several devices: try this one first
    } else if (devs != 0) {
      first = static_cast<c10::DeviceIndex>(__builtin_ctzll(devs));
    }
    for (int i = -1; i < kMaxDevices; ++i) {
      int d = i < 0 ? first : i;
      if (i >= 0 && d == first) {
        continue;
      }
      if (!(devs & (1ull << d))) {
        continue;
      }
      void* h = main_[d].load(std::memory_order_acquire);
      int rc;
      uint64_t size = 0;
      {
        RelaxedCapture r(relaxed);
        rc = cachealloc_torch_free(h, ptr, &size);
      }
      if (rc == 0) {
        if (C10_UNLIKELY(history_on_.load(std::memory_order_relaxed))) {
          record_free(d, ptr, kNoPool, size);
        }
        if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
          report_to_profiler(d, ptr, -static_cast<int64_t>(size));
        }
        if (C10_UNLIKELY(relaxed)) {
          debugf("device %d free %p during a pool route", d, ptr);
        }
        return;
      }
      TORCH_CHECK(rc == -2, "cachealloc: free of " + hex(ptr) + ": " + last_error());
    }
    TORCH_CHECK(false, "cachealloc: free of " + hex(ptr) +
                ", which no cachealloc allocator handed out");
  }

  c10::DataPtr allocate(size_t size) override {
    c10::DeviceIndex dev = c10::cuda::current_device();
    if (C10_UNLIKELY(!enabled_.load(std::memory_order_relaxed))) {
      TORCH_CHECK_WITH(OutOfMemoryError, size < kOneExaByte,
                       "CUDA out of memory. Tried to allocate more than 1EB memory.");
      void* u = uncached_alloc(dev, size);
      return {u, u, &uncached_delete_fn, c10::Device(c10::DeviceType::CUDA, dev)};
    }
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev).stream();
    void* p = alloc_on(dev, size, stream);
    return {p, p, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, dev)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return enabled_.load(std::memory_order_relaxed) ? &raw_delete_fn : &uncached_delete_fn;
  }

  // raw_alloc while disabled: cudaMalloc, remembered so that raw_delete
  // hands it to cudaFree whatever the setting is by then.
  void* raw_uncached(size_t nbytes) {
    void* p = uncached_alloc(c10::cuda::current_device(), nbytes);
    if (p != nullptr) {
      std::lock_guard<std::mutex> g(uncached_mutex_);
      uncached_.insert(p);
      n_uncached_.store(uncached_.size());
    }
    return p;
  }

  void* raw_alloc(size_t nbytes) override {
    if (C10_UNLIKELY(!enabled_.load(std::memory_order_relaxed))) {
      return raw_uncached(nbytes);
    }
    c10::DeviceIndex dev = c10::cuda::current_device();
    return alloc_on(dev, nbytes, c10::cuda::getCurrentCUDAStream(dev).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (C10_UNLIKELY(!enabled_.load(std::memory_order_relaxed))) {
      return raw_uncached(nbytes);
    }
    return alloc_on(c10::cuda::current_device(), nbytes, stream);
  }

  void raw_delete(void* ptr) override {
    if (C10_UNLIKELY(n_uncached_.load(std::memory_order_relaxed) > 0)) {
      bool mine = false;
      {
        std::lock_guard<std::mutex> g(uncached_mutex_);
        mine = uncached_.erase(ptr) > 0;
        n_uncached_.store(uncached_.size());
      }
      if (mine) {
        uncached_delete_fn(ptr);
        return;
      }
    }
    free_ptr(ptr);
  }

  // torch.cuda.caching_allocator_enable
  void enable(bool value) override {
    enabled_.store(value);
  }

  bool isEnabled() const override {
    return enabled_.load();
  }

  void init(int device_count) override {
    device_count_ = device_count;
    initialized_ = true;
  }

  bool initialized() override {
    return initialized_;
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    TORCH_CHECK(device >= 0 && device < kMaxDevices, "cachealloc: bad device");
    return fractions_[device];
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    TORCH_CHECK(device >= 0 && device < kMaxDevices, "cachealloc: bad device");
    TORCH_CHECK(fraction >= 0 && fraction <= 1,
                "cachealloc: memory fraction must be in [0, 1], got " + num_f(fraction));
    void* h = main_handle(device);
    TORCH_CHECK(cachealloc_torch_set_fraction(h, fraction) == 0, last_error());
    fractions_[device] = fraction;
  }

  void recordStream(const c10::DataPtr& ptr,
                    c10::cuda::CUDAStream stream) override {
    if (!ptr.get() || ptr.get_deleter() != &raw_delete_fn) {
      return;  // empty, or not ours (as PyTorch's allocator does)
    }
    void* p = ptr.get();
    RelaxedCapture r(captures_.load(std::memory_order_relaxed) > 0);
    if (pool_live_.load() > 0) {
      std::lock_guard<std::mutex> g(pools_mutex_);
      auto it = pool_of_.find(p);
      if (it != pool_of_.end()) {
        TORCH_CHECK(cachealloc_torch_record_stream(it->second->handle, p,
                                                   stream.stream()) == 0,
                    "cachealloc: record_stream: ", last_error());
        return;
      }
    }
    c10::DeviceIndex dev = ptr.device().index();
    int rc = cachealloc_torch_record_stream(main_handle(dev), p, stream.stream());
    TORCH_CHECK(rc == 0, "cachealloc: record_stream: ", last_error());
  }

  // ---- statistics --------------------------------------------------------

  std::vector<void*> handles_of(c10::DeviceIndex dev) {
    std::vector<void*> hs;
    void* h = main_[dev].load();
    if (h) {
      hs.push_back(h);
    }
    std::lock_guard<std::mutex> g(pools_mutex_);
    for (auto& [key, p] : pools_) {
      if (p->device == dev) {
        hs.push_back(p->handle);
      }
    }
    return hs;
  }

  // Sum of the core's statistics vectors of the device's allocators (the
  // device's own and its pools'), plus what dropped pools had accumulated.
  std::array<int64_t, kStatsLen> raw_stats(c10::DeviceIndex dev) {
    std::array<int64_t, kStatsLen> sum{};
    std::array<int64_t, kStatsLen> v{};
    bool first = true;
    for (void* h : handles_of(dev)) {
      TORCH_CHECK(cachealloc_torch_stats(h, v.data(), kStatsLen) == 0,
                  last_error());
      for (size_t i = 0; i < kStatsLen; ++i) {
        if (i == CACHEALLOC_STATS_MAX_SPLIT_SIZE) {
          if (first) sum[i] = v[i];  // max_split_size: the device's
        } else {
          sum[i] += v[i];
        }
      }
      first = false;
    }
    std::lock_guard<std::mutex> g(stats_mutex_);
    for (size_t i = 0; i + 1 < kStatsLen; ++i) {
      sum[i] += retired_[dev][i];
    }
    return sum;
  }

  static bool accumulated(size_t i) {
    // allocated/freed of every stat, and the counters after the stats.
    return i >= CACHEALLOC_STATS_NUM_ALLOC_RETRIES
               ? i < CACHEALLOC_STATS_MAX_SPLIT_SIZE
               : (i % CACHEALLOC_STAT_FIELDS) == CACHEALLOC_STAT_ALLOCATED ||
                     (i % CACHEALLOC_STAT_FIELDS) == CACHEALLOC_STAT_FREED;
  }

  CDA::DeviceStats getDeviceStats(c10::DeviceIndex dev) override {
    TORCH_CHECK(dev >= 0 && dev < kMaxDevices, "cachealloc: bad device");
    CDA::DeviceStats s;
    auto v = raw_stats(dev);
    {
      std::lock_guard<std::mutex> g(stats_mutex_);
      for (size_t i = 0; i + 1 < kStatsLen; ++i) {
        if (accumulated(i)) {
          v[i] -= base_[dev][i];
        }
      }
    }
    auto fill = [&](c10::CachingAllocator::Stat& st, size_t k) {
      st.current = v[k + CACHEALLOC_STAT_CURRENT];
      st.peak = v[k + CACHEALLOC_STAT_PEAK];
      st.allocated = v[k + CACHEALLOC_STAT_ALLOCATED];
      st.freed = v[k + CACHEALLOC_STAT_FREED];
    };
    const std::array<std::pair<c10::CachingAllocator::StatArray*, size_t>,
                     CACHEALLOC_STAT_ARRAYS>
        arrays = {{{&s.allocation, CACHEALLOC_STATS_ALLOCATION},
                   {&s.segment, CACHEALLOC_STATS_SEGMENT},
                   {&s.active, CACHEALLOC_STATS_ACTIVE},
                   {&s.inactive_split, CACHEALLOC_STATS_INACTIVE_SPLIT},
                   {&s.allocated_bytes, CACHEALLOC_STATS_ALLOCATED_BYTES},
                   {&s.reserved_bytes, CACHEALLOC_STATS_RESERVED_BYTES},
                   {&s.active_bytes, CACHEALLOC_STATS_ACTIVE_BYTES},
                   {&s.inactive_split_bytes, CACHEALLOC_STATS_INACTIVE_SPLIT_BYTES},
                   {&s.requested_bytes, CACHEALLOC_STATS_REQUESTED_BYTES}}};
    // PyTorch's StatType order (AGGREGATE, SMALL_POOL, LARGE_POOL) is the
    // vector's (CACHEALLOC_STAT_AGGREGATE, _SMALL_POOL, _LARGE_POOL).
    static_assert(static_cast<size_t>(c10::CachingAllocator::StatType::SMALL_POOL) ==
                      CACHEALLOC_STAT_SMALL_POOL &&
                  static_cast<size_t>(c10::CachingAllocator::StatType::LARGE_POOL) ==
                      CACHEALLOC_STAT_LARGE_POOL,
                  "PyTorch's StatType order");
    for (const auto& [array, start] : arrays) {
      for (size_t g = 0; g < CACHEALLOC_STAT_GROUPS; ++g) {
        fill((*array)[g], start + g * CACHEALLOC_STAT_FIELDS);
      }
    }
    fill(s.oversize_allocations, CACHEALLOC_STATS_OVERSIZE_ALLOCATIONS);
    fill(s.oversize_segments, CACHEALLOC_STATS_OVERSIZE_SEGMENTS);
    s.num_alloc_retries = v[CACHEALLOC_STATS_NUM_ALLOC_RETRIES];
    s.num_ooms = v[CACHEALLOC_STATS_NUM_OOMS];
    s.num_sync_all_streams = v[CACHEALLOC_STATS_NUM_SYNC_ALL_STREAMS];
    s.num_device_alloc = v[CACHEALLOC_STATS_NUM_DEVICE_ALLOC];
    s.num_device_free = v[CACHEALLOC_STATS_NUM_DEVICE_FREE];
    // -1: unlimited, as PyTorch reports it
    s.max_split_size = v[CACHEALLOC_STATS_MAX_SPLIT_SIZE];
    return s;
  }

  void resetAccumulatedStats(c10::DeviceIndex dev) override {
    TORCH_CHECK(dev >= 0 && dev < kMaxDevices, "cachealloc: bad device");
    auto v = raw_stats(dev);
    std::lock_guard<std::mutex> g(stats_mutex_);
    base_[dev] = v;
  }

  void resetPeakStats(c10::DeviceIndex dev) override {
    TORCH_CHECK(dev >= 0 && dev < kMaxDevices, "cachealloc: bad device");
    for (void* h : handles_of(dev)) {
      cachealloc_torch_reset_peak(h);
    }
  }

  // PyTorch's contract: a zero *largestBlock asks for the largest block a
  // request could get, the device's free memory included (cuDNN's benchmark
  // mode sizes its workspace by it); a nonzero one is a guess to raise.
  void cacheInfo(c10::DeviceIndex dev, size_t* largestBlock) override {
    void* h = main_handle(dev);
    int64_t n = *largestBlock == 0 ? cachealloc_torch_cache_info(h)
                                   : cachealloc_torch_largest_free(h);
    TORCH_CHECK(n >= 0, last_error());
    *largestBlock = std::max(*largestBlock, static_cast<size_t>(n));
  }

  // ---- snapshots ---------------------------------------------------------

  static std::vector<uint64_t> words_of(void* h) {
    std::vector<uint64_t> w(256);
    for (;;) {
      int64_t n = cachealloc_torch_snapshot(h, w.data(), w.size());
      TORCH_CHECK(n >= 0, last_error());
      if (static_cast<size_t>(n) <= w.size()) {
        w.resize(n);
        return w;
      }
      w.resize(n + n / 4 + 64);
    }
  }

  void add_segments(std::vector<CDA::SegmentInfo>& out, void* h,
                    c10::DeviceIndex dev, MempoolId_t owner, bool expandable) {
    auto w = words_of(h);
    std::lock_guard<std::mutex> g(history_mutex_);
    for (size_t i = 0; i + kSegmentWords <= w.size();) {
      CDA::SegmentInfo s;
      s.device = dev;
      s.address = w[i + CACHEALLOC_SEGMENT_ADDRESS];
      s.total_size = w[i + CACHEALLOC_SEGMENT_TOTAL_SIZE];
      s.allocated_size = w[i + CACHEALLOC_SEGMENT_ALLOCATED_SIZE];
      s.requested_size = w[i + CACHEALLOC_SEGMENT_REQUESTED_SIZE];
      s.stream = reinterpret_cast<void*>(w[i + CACHEALLOC_SEGMENT_STREAM]);
      s.is_large = w[i + CACHEALLOC_SEGMENT_IS_LARGE] != 0;
      s.is_expandable = expandable;
      s.owner_private_pool_id = owner;
      size_t nb = w[i + CACHEALLOC_SEGMENT_BLOCKS];
      i += kSegmentWords;
      size_t active = 0;
      for (size_t b = 0; b < nb && i + kBlockWords <= w.size(); ++b, i += kBlockWords) {
        CDA::BlockInfo bi;
        bi.size = w[i + CACHEALLOC_BLOCK_SIZE];
        bi.requested_size = w[i + CACHEALLOC_BLOCK_REQUESTED_SIZE];
        bi.allocated = w[i + CACHEALLOC_BLOCK_STATE] == CACHEALLOC_BLOCK_STATE_ALLOCATED;
        bi.active = w[i + CACHEALLOC_BLOCK_STATE] != CACHEALLOC_BLOCK_STATE_INACTIVE;
        if (bi.active) {
          active += bi.size;
        }
        if (bi.allocated) {
          auto it = contexts_.find(reinterpret_cast<void*>(w[i + CACHEALLOC_BLOCK_ADDRESS]));
          if (it != contexts_.end()) {
            bi.context_when_allocated = it->second;
          }
        }
        s.blocks.push_back(std::move(bi));
      }
      s.active_size = active;
      out.push_back(std::move(s));
    }
  }

  CCA::SnapshotInfo snapshot(MempoolId_t mempool_id,
                             bool include_traces = true) override {
    CCA::SnapshotInfo info{};
    uint64_t devs = devices_in_use_.load();
    for (int d = 0; d < kMaxDevices; ++d) {
      if (!(devs & (1ull << d))) {
        continue;
      }
      void* h = main_[d].load();
      if (mempool_id == kNoPool) {
        add_segments(info.segments, h, d, kNoPool,
                     cachealloc_torch_is_expandable(h) == 1);
      }
      std::vector<std::pair<MempoolId_t, void*>> ps;
      {
        std::lock_guard<std::mutex> g(pools_mutex_);
        for (auto& [key, p] : pools_) {
          if (p->device == d && (mempool_id == kNoPool || p->id == mempool_id)) {
            ps.emplace_back(p->id, p->handle);
          }
        }
      }
      for (auto& [id, ph] : ps) {
        add_segments(info.segments, ph, d, id, false);
      }
    }
    if (include_traces) {
      std::lock_guard<std::mutex> g(history_mutex_);
      int n = std::max(device_count_, 1);
      info.device_traces.resize(n);
      for (int d = 0; d < n && d < kMaxDevices; ++d) {
        auto& ring = traces_[d];
        auto& out = info.device_traces[d];
        size_t start = ring.size() < max_entries_ ? 0 : ring_next_[d];
        for (size_t k = 0; k < ring.size(); ++k) {
          out.push_back(ring[(start + k) % ring.size()]);
        }
      }
    }
    return info;
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    auto addr = reinterpret_cast<uint64_t>(ptr);
    auto snap = snapshot(kNoPool, false);
    for (auto& s : snap.segments) {
      if (addr >= s.address && addr < s.address + s.total_size) {
        if (size) {
          *size = s.total_size;
        }
        return reinterpret_cast<void*>(s.address);
      }
    }
    TORCH_CHECK(false, "cachealloc: getBaseAllocation of " + hex(ptr) +
                ", which no cachealloc segment holds");
    return nullptr;
  }

  // ---- history -----------------------------------------------------------

  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, CCA::RecordContext when,
                     bool clearHistory,
                     const std::vector<std::string>& skip_actions) override {
    std::lock_guard<std::mutex> g(history_mutex_);
    recorder_ = context_recorder;
    when_ = enabled ? when : CCA::RecordContext::NEVER;
    max_entries_ = std::max<size_t>(alloc_trace_max_entries, 1);
    skip_.clear();
    for (auto& a : skip_actions) {
      skip_.insert(static_cast<int>(CDA::parseTraceEntryAction(a)));
    }
    if (clearHistory || !enabled) {
      for (auto& t : traces_) {
        t.clear();
      }
      ring_next_.fill(0);
    }
    if (!enabled) {
      contexts_.clear();
    }
    history_on_.store(enabled);
  }

  bool isHistoryEnabled() override {
    return history_on_.load();
  }

  void push_trace(CDA::TraceEntry e) {
    // history_mutex_ held
    auto& ring = traces_[e.device_];
    if (ring.size() < max_entries_) {
      ring.push_back(std::move(e));
    } else {
      ring[ring_next_[e.device_]] = std::move(e);
      ring_next_[e.device_] = (ring_next_[e.device_] + 1) % max_entries_;
    }
  }

  void record(CDA::TraceEntry::Action action, c10::DeviceIndex dev, void* ptr,
              size_t size, cudaStream_t stream, MempoolId_t pool,
              bool keep_context) {
    CCA::CreateContextFn rec;
    CCA::RecordContext when;
    {
      std::lock_guard<std::mutex> g(history_mutex_);
      rec = recorder_;
      when = when_;
    }
    std::shared_ptr<c10::GatheredContext> ctx;
    if (rec && when != CCA::RecordContext::NEVER &&
        (action == CDA::TraceEntry::ALLOC || action == CDA::TraceEntry::OOM ||
         when == CCA::RecordContext::ALL)) {
      ctx = rec();
    }
    std::lock_guard<std::mutex> g(history_mutex_);
    if (keep_context && ctx) {
      contexts_[ptr] = ctx;
    }
    // As PyTorch's allocator: while history is on every action is traced;
    // `when` decides only whether the entry carries its stack (ALLOC, ALL)
    // or only live blocks do (STATE).
    if (history_on_.load() && !skip_.count(static_cast<int>(action))) {
      push_trace(CDA::TraceEntry(
          action, dev, reinterpret_cast<size_t>(ptr), size, stream, pool,
          c10::getApproximateTime(),
          when_ >= CCA::RecordContext::ALLOC ? ctx : nullptr));
    }
  }

  void record_free(c10::DeviceIndex dev, void* ptr, MempoolId_t pool,
                   size_t size) {
    CCA::CreateContextFn rec;
    CCA::RecordContext when;
    {
      std::lock_guard<std::mutex> g(history_mutex_);
      contexts_.erase(ptr);
      rec = recorder_;
      when = when_;
    }
    std::shared_ptr<c10::GatheredContext> ctx;
    if (rec && when == CCA::RecordContext::ALL) {
      ctx = rec();
    }
    std::lock_guard<std::mutex> g(history_mutex_);
    if (history_on_.load()) {
      for (auto a : {CDA::TraceEntry::FREE_REQUESTED,
                     CDA::TraceEntry::FREE_COMPLETED}) {
        if (!skip_.count(static_cast<int>(a))) {
          push_trace(CDA::TraceEntry(a, dev, reinterpret_cast<size_t>(ptr),
                                     size, nullptr, pool,
                                     c10::getApproximateTime(), ctx));
        }
      }
    }
  }

  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> g(observers_mutex_);
    observers_.push_back(std::move(observer));
  }

  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker) override {
    TORCH_CHECK(false,
                "cachealloc does not support allocator trace trackers "
                "(attachAllocatorTraceTracker); use "
                "torch.cuda.memory._record_memory_history instead");
  }

  // ---- private pools (CUDA graphs, MemPool) ------------------------------

  using PoolKey = std::pair<int, MempoolId_t>;
  static PoolKey key(c10::DeviceIndex dev, MempoolId_t id) {
    return PoolKey(static_cast<int>(dev), id);
  }

  // pools_mutex_ held.
  Pool* find_pool(c10::DeviceIndex dev, MempoolId_t id) {
    auto it = pools_.find(key(dev, id));
    return it == pools_.end() ? nullptr : it->second.get();
  }

  // pools_mutex_ held.
  Pool* incref(c10::DeviceIndex dev, MempoolId_t id) {
    Pool* p = find_pool(dev, id);
    if (p == nullptr) {
      void* h = cachealloc_torch_pool_new(dev);
      TORCH_CHECK(h != nullptr, last_error());
      auto owned = std::make_unique<Pool>();
      owned->device = dev;
      owned->id = id;
      owned->handle = h;
      p = owned.get();
      pools_[key(dev, id)] = std::move(owned);
    }
    p->use_count++;
    return p;
  }

  // pools_mutex_ held. Drops `p` (its segments go back to the driver) when
  // nobody uses it and nothing allocated from it is alive. Not while any
  // capture or pool route is under way: freeing device memory then would
  // invalidate the capture, and a graph being captured may have used the
  // pool's memory (PyTorch's allocator also frees private pools' memory only
  // outside captures). Such pools stay cached until emptyCache, or an
  // out-of-memory outside a capture (drop_unused_pools).
  void maybe_drop(Pool* p) {
    if (p->use_count > 0 || !p->live.empty()) {
      return;
    }
    if (captures_.load() > 0) {
      return;
    }
    for (auto& r : routes_[p->device]) {
      if (r.pool == p) {
        return;
      }
    }
    std::array<int64_t, kStatsLen> v{};
    if (cachealloc_torch_stats(p->handle, v.data(), kStatsLen) != 0) {
      return;
    }
    if (cachealloc_torch_pool_drop(p->handle) != 0) {
      debugf("pool (%llu,%llu) kept: the core still uses it",
             (unsigned long long)p->id.first, (unsigned long long)p->id.second);
      return;  // still in use according to the core: keep it
    }
    debugf("pool (%llu,%llu) dropped", (unsigned long long)p->id.first,
           (unsigned long long)p->id.second);
    {
      std::lock_guard<std::mutex> g(stats_mutex_);
      for (size_t i = 0; i + 1 < kStatsLen; ++i) {
        if (accumulated(i)) {
          retired_[p->device][i] += v[i];
        }
      }
    }
    pools_.erase(key(p->device, p->id));
  }

  // Drops the pools maybe_drop had to keep while a capture was under way;
  // whether any was dropped.
  bool drop_unused_pools() {
    std::lock_guard<std::mutex> g(pools_mutex_);
    std::vector<Pool*> unused;
    for (auto& [k, p] : pools_) {
      if (p->use_count == 0 && p->live.empty()) {
        unused.push_back(p.get());
      }
    }
    size_t before = pools_.size();
    for (Pool* p : unused) {
      maybe_drop(p);
    }
    return pools_.size() < before;
  }

  void beginAllocateToPool(c10::DeviceIndex dev, MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
    main_handle(dev);
    std::lock_guard<std::mutex> g(pools_mutex_);
    Pool* p = incref(dev, id);
    debugf("pool (%llu,%llu) begin route, use count %d",
           (unsigned long long)id.first, (unsigned long long)id.second, p->use_count);
    routes_[dev].push_back({id, std::move(filter), p});
    nroutes_[dev].fetch_add(1);
    captures_.fetch_add(1);
  }

  void endAllocateToPool(c10::DeviceIndex dev, MempoolId_t id) override {
    std::lock_guard<std::mutex> g(pools_mutex_);
    auto& rs = routes_[dev];
    for (auto it = rs.begin(); it != rs.end(); ++it) {
      if (it->id == id) {
        debugf("pool (%llu,%llu) end route", (unsigned long long)id.first,
               (unsigned long long)id.second);
        rs.erase(it);
        nroutes_[dev].fetch_sub(1);
        captures_.fetch_sub(1);
        return;
      }
    }
    TORCH_CHECK(false, "cachealloc: endAllocateToPool for a pool " + pool_name(id) +
                " with no allocation to it under way");
  }

  void releasePool(c10::DeviceIndex dev, MempoolId_t id) override {
    std::lock_guard<std::mutex> g(pools_mutex_);
    Pool* p = find_pool(dev, id);
    TORCH_CHECK(p != nullptr, "cachealloc: releasePool of an unknown pool " + pool_name(id));
    TORCH_CHECK(p->use_count > 0, "cachealloc: releasePool of a pool not in use");
    p->use_count--;
    debugf("pool (%llu,%llu) released, use count %d, %zu live",
           (unsigned long long)id.first, (unsigned long long)id.second,
           p->use_count, p->live.size());
    maybe_drop(p);
  }

  void createOrIncrefPool(
      c10::DeviceIndex dev, MempoolId_t id,
      std::shared_ptr<CCA::CUDAAllocator> allocator) override {
    TORCH_CHECK(allocator == nullptr,
                "cachealloc does not support MemPool(allocator=...): a pool "
                "with its own allocator; use torch.cuda.MemPool() without one");
    main_handle(dev);
    std::lock_guard<std::mutex> g(pools_mutex_);
    Pool* p = incref(dev, id);
    debugf("pool (%llu,%llu) incref, use count %d", (unsigned long long)id.first,
           (unsigned long long)id.second, p->use_count);
  }

  void setUseOnOOM(c10::DeviceIndex dev, MempoolId_t id,
                   bool use_on_oom) override {
    std::lock_guard<std::mutex> g(pools_mutex_);
    Pool* p = find_pool(dev, id);
    TORCH_CHECK(p != nullptr || !use_on_oom,
                "cachealloc: setUseOnOOM of an unknown pool " + pool_name(id));
    if (p != nullptr) {
      p->use_on_oom = use_on_oom;
    }
  }

  void setNoSplit(c10::DeviceIndex, MempoolId_t) override {
    TORCH_CHECK(false,
                "cachealloc does not support MemPool(no_split=True): its "
                "pools split blocks like the device's allocator");
  }

  int getPoolUseCount(c10::DeviceIndex dev, MempoolId_t id) override {
    std::lock_guard<std::mutex> g(pools_mutex_);
    Pool* p = find_pool(dev, id);
    return p ? p->use_count : 0;
  }

  bool checkPoolLiveAllocations(
      c10::DeviceIndex dev, MempoolId_t id,
      const std::unordered_set<void*>& expected) override {
    std::lock_guard<std::mutex> g(pools_mutex_);
    Pool* p = find_pool(dev, id);
    if (p == nullptr) {
      return expected.empty();
    }
    if (p->live.size() != expected.size()) {
      return false;
    }
    for (void* x : p->live) {
      if (!expected.count(x)) {
        return false;
      }
    }
    return true;
  }

  void emptyCache(MempoolId_t mempool_id = {0, 0}) override {
    uint64_t devs = devices_in_use_.load();
    if (mempool_id != kNoPool) {
      // As PyTorch's allocator: a pool still in use (a live graph or
      // MemPool) keeps its cached blocks, which a captured graph may use.
      std::lock_guard<std::mutex> g(pools_mutex_);
      for (int d = 0; d < kMaxDevices; ++d) {
        Pool* p = find_pool(d, mempool_id);
        if (p != nullptr && p->use_count == 0) {
          TORCH_CHECK(cachealloc_torch_empty_cache(p->handle) >= 0, last_error());
          maybe_drop(p);
        }
      }
      return;
    }
    for (int d = 0; d < kMaxDevices; ++d) {
      if (devs & (1ull << d)) {
        TORCH_CHECK(cachealloc_torch_empty_cache(main_[d].load()) >= 0,
                    last_error());
      }
    }
    // Pools no longer used by anyone give their cached segments back too.
    std::lock_guard<std::mutex> g(pools_mutex_);
    std::vector<Pool*> unused;
    for (auto& [key, p] : pools_) {
      if (p->use_count == 0) {
        unused.push_back(p.get());
      }
    }
    for (Pool* p : unused) {
      cachealloc_torch_empty_cache(p->handle);
      maybe_drop(p);
    }
  }

  // ---- what cachealloc does not do: loud failures ------------------------

  std::shared_ptr<void> getIpcDevPtr(std::string) override {
    TORCH_CHECK(false,
                "cachealloc does not support CUDA IPC (opening a CUDA tensor "
                "shared by another process, torch.multiprocessing)");
    return nullptr;
  }

  CCA::ShareableHandle shareIpcHandle(void*) override {
    TORCH_CHECK(false,
                "cachealloc does not support CUDA IPC (sharing a CUDA tensor "
                "with another process, torch.multiprocessing)");
    return {};
  }

  // A private pool's layout (its snapshot words) at a point CUDA graph
  // trees may come back to.
  struct PoolState : CCA::AllocatorState {
    c10::DeviceIndex device;
    MempoolId_t id;
    std::vector<uint64_t> words;
  };

  std::shared_ptr<CCA::AllocatorState> getCheckpointState(
      c10::DeviceIndex dev, MempoolId_t id) override {
    std::lock_guard<std::mutex> g(pools_mutex_);
    Pool* p = find_pool(dev, id);
    TORCH_CHECK(p != nullptr, "cachealloc: getCheckpointState of an unknown pool " +
                pool_name(id));
    auto st = std::make_shared<PoolState>();
    st->device = dev;
    st->id = id;
    st->words = words_of(p->handle);
    return st;
  }

  // Back to a checkpoint: every block the pool has allocated now is freed
  // (ptrs_freed), then the checkpoint's allocated blocks are allocated
  // again at their addresses (dataptrs_allocd), as PyTorch's allocator does.
  CCA::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex dev, std::shared_ptr<CCA::AllocatorState> as) override {
    auto st = std::dynamic_pointer_cast<PoolState>(as);
    TORCH_CHECK(st != nullptr,
                "cachealloc: setCheckpointPoolState of a state cachealloc did not make");
    TORCH_CHECK(st->device == dev, "cachealloc: setCheckpointPoolState: the state is "
                "of device ", num(st->device), ", not ", num(dev));
    std::lock_guard<std::mutex> g(pools_mutex_);
    Pool* p = find_pool(dev, st->id);
    TORCH_CHECK(p != nullptr, "cachealloc: setCheckpointPoolState of a pool no longer "
                "there " + pool_name(st->id));
    CCA::CheckpointDelta delta;
    std::vector<void*> live(p->live.begin(), p->live.end());
    RelaxedCapture r(true);
    for (void* ptr : live) {
      TORCH_CHECK(cachealloc_torch_free(p->handle, ptr, nullptr) == 0,
                  "cachealloc: setCheckpointPoolState: ", last_error());
      untrack(p, ptr);
      delta.ptrs_freed.push_back(ptr);
    }
    std::vector<uint64_t> out(st->words.size() / kBlockWords + 1);
    int64_t n = cachealloc_torch_restore(p->handle, st->words.data(),
                                         st->words.size(), out.data(), out.size());
    TORCH_CHECK(n >= 0, "cachealloc: setCheckpointPoolState: ", last_error());
    for (int64_t i = 0; i < n; ++i) {
      void* ptr = reinterpret_cast<void*>(out[i]);
      track(p, ptr);
      delta.dataptrs_allocd.emplace_back(ptr, ptr, &raw_delete_fn,
                                         c10::Device(c10::DeviceType::CUDA, dev));
    }
    debugf("pool (%llu,%llu) back to a checkpoint: %zu freed, %lld allocated",
           (unsigned long long)st->id.first, (unsigned long long)st->id.second,
           delta.ptrs_freed.size(), (long long)n);
    return delta;
  }

  void enablePeerAccess(c10::DeviceIndex dev,
                        c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
    // Pages of expandable segments are mapped through the virtual memory
    // API, which the call above does not cover: `dev` is granted access to
    // `dev_to_access`'s pages, mapped now and later, by every allocator there.
    TORCH_CHECK(cachealloc_torch_enable_peer_access(dev_to_access, dev) == 0,
                last_error());
  }

  std::string name() override {
    return "cachealloc";
  }

 private:
  std::array<std::atomic<void*>, kMaxDevices> main_;
  std::atomic<uint64_t> devices_in_use_{0};
  std::array<double, kMaxDevices> fractions_;
  std::mutex init_mutex_;
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
  // Sizes of the allocations made while recording (a free's entry carries its size).
};

// Never destroyed: tensors may be freed during interpreter shutdown.
std::shared_ptr<CacheallocAllocator>& instance() {
  static auto* a = new std::shared_ptr<CacheallocAllocator>();
  return *a;
}

void raw_delete_fn(void* ptr) {
  instance()->free_ptr(ptr);
}

// Installs the allocator as PyTorch's CUDA allocator (before CUDA is used).
void on_segv(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  const char msg[] = "cachealloc: fatal signal; native backtrace:\n";
  (void)!write(2, msg, sizeof msg - 1);
  backtrace_symbols_fd(frames, n, 2);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void install() {
  if (debug_on()) {
    std::signal(SIGSEGV, on_segv);
    std::signal(SIGABRT, on_segv);
  }
  auto& a = instance();
  TORCH_CHECK(a == nullptr, "cachealloc is already installed");
  a = std::make_shared<CacheallocAllocator>();
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
}

bool installed() {
  return instance() != nullptr && CCA::get() == instance().get();
}

}  // namespace cachealloc

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cachealloc as PyTorch's CUDA allocator (full C++ interface)";
  m.def("install", &cachealloc::install,
        "Install cachealloc as PyTorch's CUDA allocator (before CUDA is used)");
  m.def("installed", &cachealloc::installed,
        "Whether PyTorch's current CUDA allocator is cachealloc's");
  m.def("cache_info", [](int64_t dev) {
          size_t largest = 0;
          c10::cuda::CUDACachingAllocator::cacheInfo(static_cast<c10::DeviceIndex>(dev), &largest);
          return largest;
        },
        "PyTorch's cacheInfo with a zero guess, through the installed allocator");
}
