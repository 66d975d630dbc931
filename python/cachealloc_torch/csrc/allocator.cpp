// Allocation and free, the caching switch, the memory fraction, record_stream;
// the helpers the parts share; install() and the Python module.
// (The class and what the parts share: allocator.h.)

#include <torch/extension.h>

#include "allocator.h"

#include <execinfo.h>
#include <unistd.h>

#include <csignal>

namespace cachealloc {

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

// ---- allocation --------------------------------------------------------

void* CacheallocAllocator::main_handle(c10::DeviceIndex dev) {
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
    // Settings given at run time before this device was used.
    for (const auto& conf : settings_) {
      try {
        apply_settings_to(dev, h, conf, nullptr);
      } catch (const c10::Error& e) {
        TORCH_WARN("cachealloc: allocator settings \"", conf, "\" not applied to device ",
                   num(dev), ": ", e.what_without_backtrace());
      }
    }
    main_[dev].store(h, std::memory_order_release);
    devices_in_use_.fetch_or(1ull << dev);
  }
  return h;
}

// The pool a request on `stream` goes to, or nullptr (the device's).
Pool* CacheallocAllocator::route(c10::DeviceIndex dev, cudaStream_t stream) {
  std::lock_guard<std::mutex> g(pools_mutex_);
  auto& rs = routes_[dev];
  for (auto it = rs.rbegin(); it != rs.rend(); ++it) {
    if (it->filter(stream)) {
      return it->pool;
    }
  }
  return nullptr;
}

void* CacheallocAllocator::alloc_on(c10::DeviceIndex dev, size_t size, cudaStream_t stream) {
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
  if (C10_UNLIKELY(ptr == nullptr) && kind == 1 && captures_.load() == 0 &&
      run_free_memory_callbacks()) {
    // Then tensors other processes were sent and have released since.
    ptr = cachealloc_torch_alloc(h, size, stream, &kind);
  }
  if (C10_UNLIKELY(ptr == nullptr)) {
    if (kind == 1) {
      if (void* served = oom_fallback(dev, size, stream)) {
        return served;
      }
    }
    fail(dev, size, kind);
  }
  if (C10_UNLIKELY(history_on_.load(std::memory_order_relaxed))) {
    record(CDA::TraceEntry::ALLOC, dev, ptr, size, stream, kNoPool, true, h);
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

// MemPool(use_on_oom=True): a cached block of a pool of the device that is
// in use and serves its memory to an allocation the device's allocator had
// no memory for, or nullptr. As PyTorch's allocator: only the pool's free
// blocks serve (the pool does not grow for it), and a deleted pool (use
// count 0, kept for its live blocks) serves nothing. The block is the
// pool's: its free goes back there.
void* CacheallocAllocator::oom_fallback(c10::DeviceIndex dev, size_t size, cudaStream_t stream) {
  void* ptr = nullptr;
  MempoolId_t id = kNoPool;
  {
    std::lock_guard<std::mutex> g(pools_mutex_);
    RelaxedCapture rc(captures_.load() > 0);
    for (auto& [key, p] : pools_) {
      if (p->device != dev || !p->use_on_oom || p->use_count == 0) {
        continue;
      }
      int kind = 0;
      ptr = cachealloc_torch_alloc_cached(p->handle, size, stream, &kind);
      if (ptr != nullptr) {
        track(p.get(), ptr);
        id = p->id;
        break;
      }
      if (kind == 2) {
        debugf("pool (%llu,%llu) cannot serve: %s", (unsigned long long)p->id.first,
               (unsigned long long)p->id.second, last_error().c_str());
      }
    }
  }
  if (ptr == nullptr) {
    return nullptr;
  }
  debugf("pool (%llu,%llu) serves %p size %zu on out of memory",
         (unsigned long long)id.first, (unsigned long long)id.second, ptr, size);
  if (C10_UNLIKELY(history_on_.load(std::memory_order_relaxed))) {
    record(CDA::TraceEntry::ALLOC, dev, ptr, size, stream, id, true);
  }
  if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
    report_to_profiler(dev, ptr, static_cast<int64_t>(size));
  }
  return ptr;
}

// Registers `ptr` as a live block of private pool `p`, so that a free
// finds its pool (the caller holds pools_mutex_).
void CacheallocAllocator::track(Pool* p, void* ptr) {
  p->live.insert(ptr);
  pool_of_[ptr] = p;
  pool_live_.fetch_add(1, std::memory_order_relaxed);
}

// Forgets the live block `ptr` of private pool `p` (the caller holds
// pools_mutex_).
void CacheallocAllocator::untrack(Pool* p, void* ptr) {
  p->live.erase(ptr);
  pool_of_.erase(ptr);
  pool_live_.fetch_sub(1, std::memory_order_relaxed);
}

void* CacheallocAllocator::alloc_pool(Pool* p, c10::DeviceIndex dev, size_t size,
                                      cudaStream_t stream) {
  int kind = 0;
  void* ptr;
  const bool reuse = C10_UNLIKELY(reuse_on());
  if (reuse) {
    // Note [Reuse during a capture]
    std::lock_guard<std::mutex> g(pools_mutex_);
    if (!reuse_.held.empty()) {
      RelaxedCapture rc(true);
      reuse_reclaim(stream);
    }
  }
  {
    RelaxedCapture rc(true);
    clear_source_error();
    ptr = cachealloc_torch_alloc(p->handle, size, stream, &kind);
  }
  if (ptr == nullptr) {
    // What the MemPool's allocator threw, as PyTorch's allocator lets it through.
    rethrow_source_error();
    fail(dev, size, kind);
  }
  clear_source_error();
  debugf("pool (%llu,%llu) alloc %p size %zu stream %p",
         (unsigned long long)p->id.first, (unsigned long long)p->id.second,
         ptr, size, (void*)stream);
  {
    std::lock_guard<std::mutex> g(pools_mutex_);
    track(p, ptr);
    if (reuse) {
      reuse_note_alloc(p, ptr, stream);
    }
  }
  if (C10_UNLIKELY(history_on_.load(std::memory_order_relaxed))) {
    record(CDA::TraceEntry::ALLOC, dev, ptr, size, stream, p->id, true, p->handle);
  }
  if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
    report_to_profiler(dev, ptr, static_cast<int64_t>(size));
  }
  return ptr;
}

// torch.profiler's memory events (profile_memory=True): the change in
// bytes with the device's totals after it, as PyTorch's allocator reports.
void CacheallocAllocator::report_to_profiler(c10::DeviceIndex dev, void* ptr, int64_t delta) {
  auto st = getDeviceStats(dev);
  c10::reportMemoryUsageToProfiler(
      ptr, delta, static_cast<size_t>(st.allocated_bytes[0].current),
      static_cast<size_t>(st.reserved_bytes[0].current),
      c10::Device(c10::DeviceType::CUDA, dev));
}

void CacheallocAllocator::fail(c10::DeviceIndex dev, size_t size, int kind) {
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
           nullptr, kNoPool, false, main_[dev].load());
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
void CacheallocAllocator::free_ptr(void* ptr) {
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
      if (C10_UNLIKELY(!reuse_.blocks.empty())) {
        RelaxedCapture r(true);
        reuse_note_free(p, ptr);
      }
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
        record_free(d, ptr, kNoPool, size, h);
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

c10::DataPtr CacheallocAllocator::allocate(size_t size) {
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

c10::DeleterFnPtr CacheallocAllocator::raw_deleter() const {
  return enabled_.load(std::memory_order_relaxed) ? &raw_delete_fn : &uncached_delete_fn;
}

// raw_alloc while disabled: cudaMalloc, remembered so that raw_delete
// hands it to cudaFree whatever the setting is by then.
void* CacheallocAllocator::raw_uncached(size_t nbytes) {
  void* p = uncached_alloc(c10::cuda::current_device(), nbytes);
  if (p != nullptr) {
    std::lock_guard<std::mutex> g(uncached_mutex_);
    uncached_.insert(p);
    n_uncached_.store(uncached_.size());
  }
  return p;
}

void* CacheallocAllocator::raw_alloc(size_t nbytes) {
  if (C10_UNLIKELY(!enabled_.load(std::memory_order_relaxed))) {
    return raw_uncached(nbytes);
  }
  c10::DeviceIndex dev = c10::cuda::current_device();
  return alloc_on(dev, nbytes, c10::cuda::getCurrentCUDAStream(dev).stream());
}

void* CacheallocAllocator::raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) {
  if (C10_UNLIKELY(!enabled_.load(std::memory_order_relaxed))) {
    return raw_uncached(nbytes);
  }
  return alloc_on(c10::cuda::current_device(), nbytes, stream);
}

void CacheallocAllocator::raw_delete(void* ptr) {
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
void CacheallocAllocator::enable(bool value) {
  enabled_.store(value);
}

bool CacheallocAllocator::isEnabled() const {
  return enabled_.load();
}

void CacheallocAllocator::init(int device_count) {
  device_count_ = device_count;
  initialized_ = true;
}

bool CacheallocAllocator::initialized() {
  return initialized_;
}

double CacheallocAllocator::getMemoryFraction(c10::DeviceIndex device) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "cachealloc: bad device");
  return fractions_[device];
}

void CacheallocAllocator::setMemoryFraction(double fraction, c10::DeviceIndex device) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "cachealloc: bad device");
  TORCH_CHECK(fraction >= 0 && fraction <= 1,
              "cachealloc: memory fraction must be in [0, 1], got " + num_f(fraction));
  void* h = main_handle(device);
  TORCH_CHECK(cachealloc_torch_set_fraction(h, fraction) == 0, last_error());
  fractions_[device] = fraction;
  push_segment_changes(h, device, kNoPool, false);  // Note [Segment events]
}

void CacheallocAllocator::recordStream(const c10::DataPtr& ptr,
                                       c10::cuda::CUDAStream stream) {
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
      if (C10_UNLIKELY(!reuse_.blocks.empty())) {
        reuse_note_use(p, stream.stream());
      }
      return;
    }
  }
  c10::DeviceIndex dev = ptr.device().index();
  int rc = cachealloc_torch_record_stream(main_handle(dev), p, stream.stream());
  TORCH_CHECK(rc == 0, "cachealloc: record_stream: ", last_error());
}

std::shared_ptr<CacheallocAllocator>& instance() {
  static auto* a = new std::shared_ptr<CacheallocAllocator>();
  return *a;
}

void raw_delete_fn(void* ptr) {
  instance()->free_ptr(ptr);
}

// CACHEALLOC_TORCH_DEBUG=1: a native backtrace on a fatal signal.
void on_segv(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  const char msg[] = "cachealloc: fatal signal; native backtrace:\n";
  (void)!write(2, msg, sizeof msg - 1);
  backtrace_symbols_fd(frames, n, 2);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

// Installs the allocator as PyTorch's CUDA allocator (before CUDA is used).
void install() {
  if (debug_on()) {
    std::signal(SIGSEGV, on_segv);
    std::signal(SIGABRT, on_segv);
  }
  auto& a = instance();
  TORCH_CHECK(a == nullptr, "cachealloc is already installed");
  // PyTorch reads its CUDA allocator settings (PYTORCH_CUDA_ALLOC_CONF) once,
  // on first use, and checks a `backend` key there against the name of the
  // allocator in force then: read them now, while PyTorch's own allocator
  // is in force, so that backend:native passes (an invalid setting raises
  // PyTorch's error here, before anything is installed).
  (void)c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig::instance();
  a = std::make_shared<CacheallocAllocator>();
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
  // Note [The device allocator registry]: PyTorch's device-generic API
  // (torch.accelerator.memory_stats and its relatives, at::accelerator::*)
  // asks c10::GetAllocator(kCUDA), not the CUDA allocator pointer that
  // changeCurrentAllocator sets (torch 2.11 sets only that pointer). PyTorch's
  // own allocator registers itself there at load time with priority 0
  // (BackendStaticInitializer); registering with the same priority replaces
  // it, exactly as that registration made it, so both routes reach the same
  // allocator. There is no uninstall: the allocator is never destroyed, so
  // the registration stays valid for the life of the process.
  c10::SetAllocator(c10::DeviceType::CUDA, a.get(), /*priority=*/0);
  if (c10::GetAllocator(c10::DeviceType::CUDA) != a.get()) {
    TORCH_WARN("cachealloc: another allocator is registered for CUDA with a higher "
               "priority; torch.accelerator's memory functions will not reach cachealloc");
  }
  register_settings_hook();
}

// Whether PyTorch's CUDA allocator is cachealloc's (the pointer that
// torch.cuda's functions use).
bool installed() {
  return instance() != nullptr && CCA::get() == instance().get();
}

// Whether PyTorch's device-generic allocator for CUDA (what torch.accelerator
// asks) is cachealloc's: Note [The device allocator registry].
bool device_allocator_installed() {
  return instance() != nullptr &&
         c10::GetAllocator(c10::DeviceType::CUDA) == instance().get() &&
         c10::getDeviceAllocator(c10::DeviceType::CUDA) == instance().get();
}

}  // namespace cachealloc

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cachealloc as PyTorch's CUDA allocator (full C++ interface)";
  m.def("install", &cachealloc::install,
        "Install cachealloc as PyTorch's CUDA allocator (before CUDA is used)");
  m.def("installed", &cachealloc::installed,
        "Whether PyTorch's current CUDA allocator is cachealloc's");
  m.def("device_allocator_installed", &cachealloc::device_allocator_installed,
        "Whether PyTorch's device allocator for CUDA (torch.accelerator) is cachealloc's");
  m.def("cache_info", [](int64_t dev) {
          size_t largest = 0;
          c10::cuda::CUDACachingAllocator::cacheInfo(static_cast<c10::DeviceIndex>(dev), &largest);
          return largest;
        },
        "PyTorch's cacheInfo with a zero guess, through the installed allocator");
}
