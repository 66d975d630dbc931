// Private pools (CUDA graphs, torch.cuda.MemPool): each its own core
// allocator, routed to while a capture or use_mem_pool is under way; a
// MemPool's options (allocator=..., use_on_oom, no_split); and their
// checkpoints (CUDA graph trees).
// (The class and what the parts share: allocator.h.)

#include "allocator.h"

namespace cachealloc {

// ---- MemPool(allocator=...): the pool's segment source --------------------
//
// The core asks these two functions for each segment of such a pool and
// gives each back through them (cachealloc_torch_pool_new_sourced), while
// it holds the pool's lock. They call the pool's CUDAAllocator as PyTorch's
// allocator does (raw_alloc_with_stream, raw_delete: a
// CUDAPluggableAllocator calls the user's functions with the size, device
// and stream) and never throw: an exception is kept for the caller to
// rethrow once the core has returned (rethrow_source_error).

namespace {

thread_local std::exception_ptr source_error;

void* source_alloc(void* ctx, size_t size, int device, void* stream) noexcept {
  auto* src = static_cast<SegmentSource*>(ctx);
  try {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    void* p = src->allocator->raw_alloc_with_stream(size, static_cast<cudaStream_t>(stream));
    debugf("device %d segment %p size %zu from the MemPool allocator", device, p, size);
    return p;
  } catch (...) {
    source_error = std::current_exception();
    (void)cudaGetLastError();
    return nullptr;
  }
}

int source_free(void* ctx, void* ptr, size_t size, int device, void*) noexcept {
  auto* src = static_cast<SegmentSource*>(ctx);
  try {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    src->allocator->raw_delete(ptr);
    debugf("device %d segment %p size %zu back to the MemPool allocator", device, ptr, size);
    return 0;
  } catch (...) {
    source_error = std::current_exception();
    (void)cudaGetLastError();
    return -1;
  }
}

}  // namespace

void rethrow_source_error() {
  if (source_error) {
    std::exception_ptr e = source_error;
    source_error = nullptr;
    std::rethrow_exception(e);
  }
}

void clear_source_error() {
  source_error = nullptr;
}

// pools_mutex_ held.
Pool* CacheallocAllocator::find_pool(c10::DeviceIndex dev, MempoolId_t id) {
  auto it = pools_.find(key(dev, id));
  return it == pools_.end() ? nullptr : it->second.get();
}

// pools_mutex_ held. A new pool's segments come from `allocator` when one
// is given (MemPool(allocator=...)), else from the device.
Pool* CacheallocAllocator::incref(c10::DeviceIndex dev, MempoolId_t id,
                                  std::shared_ptr<CCA::CUDAAllocator> allocator) {
  Pool* p = find_pool(dev, id);
  if (p == nullptr) {
    auto owned = std::make_unique<Pool>();
    void* h;
    if (allocator != nullptr) {
      owned->source = std::make_unique<SegmentSource>(SegmentSource{std::move(allocator), dev});
      h = cachealloc_torch_pool_new_sourced(dev, &source_alloc, &source_free,
                                            owned->source.get());
    } else {
      h = cachealloc_torch_pool_new(dev);
    }
    TORCH_CHECK(h != nullptr, last_error());
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
void CacheallocAllocator::maybe_drop(Pool* p) {
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
  clear_source_error();
  if (cachealloc_torch_pool_drop(p->handle) != 0) {
    // Still in use according to the core, or its allocator's free function
    // failed: keep it (emptyCache tries again).
    debugf("pool (%llu,%llu) kept: %s", (unsigned long long)p->id.first,
           (unsigned long long)p->id.second, last_error().c_str());
    clear_source_error();
    return;
  }
  debugf("pool (%llu,%llu) dropped", (unsigned long long)p->id.first,
         (unsigned long long)p->id.second);
  forget_segments(p->handle, p->device, p->id);  // Note [Segment events]
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
bool CacheallocAllocator::drop_unused_pools() {
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

// ---- Note [Reuse during a capture] ----------------------------------------
//
// With PyTorch's graph_capture_record_stream_reuse:True, a private pool's
// block used on other streams (record_stream) and freed during a CUDA graph
// capture can be reused during the same capture, as PyTorch's allocator
// does (torch 2.11, CUDACachingAllocator.cpp: record_free_markers,
// free_safe_blocks_in_capture): at the free, the current terminal nodes of
// the capture on the block's stream and on every stream it was used on are
// its free markers (if one of those streams is not being captured, there
// are none and the block waits for the capture to end, as without the
// setting). Before each allocation on a stream during a capture, the nodes
// that precede the stream's current terminal nodes are walked (from where
// the last walk of that stream in that capture stopped), and a held block
// allocated on that stream whose markers are all among them goes back to its
// pool (cachealloc_torch_reclaim; Note [Reclaim during a capture] in the
// core): everything the stream adds from then on runs after the block's last
// uses. Only the graph's order is read; no event is recorded or queried.
// Without the setting (PyTorch's default) nothing here runs.

bool CacheallocAllocator::reuse_on() {
  return CCA::CUDAAllocatorConfig::graph_capture_record_stream_reuse();
}

namespace {

struct CaptureInfo {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  const cudaGraphNode_t* terminals = nullptr;
  size_t n = 0;
};

// The capture `stream` is part of and its current terminal nodes; status
// None when it is not being captured (or the runtime cannot say).
CaptureInfo capture_info(cudaStream_t stream) {
  CaptureInfo info;
  cudaGraph_t graph = nullptr;
#if CUDART_VERSION >= 13000
  cudaError_t err = cudaStreamGetCaptureInfo(stream, &info.status, &info.id, &graph,
                                             &info.terminals, nullptr, &info.n);
#else
  cudaError_t err = cudaStreamGetCaptureInfo_v2(stream, &info.status, &info.id, &graph,
                                                &info.terminals, &info.n);
#endif
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return CaptureInfo{};
  }
  return info;
}

std::vector<cudaGraphNode_t> parents(cudaGraphNode_t node) {
  size_t n = 0;
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaGraphNodeGetDependencies(node, nullptr, nullptr, &n));
  std::vector<cudaGraphNode_t> out(n);
  if (n > 0) {
    C10_CUDA_CHECK(cudaGraphNodeGetDependencies(node, out.data(), nullptr, &n));
  }
#else
  C10_CUDA_CHECK(cudaGraphNodeGetDependencies(node, nullptr, &n));
  std::vector<cudaGraphNode_t> out(n);
  if (n > 0) {
    C10_CUDA_CHECK(cudaGraphNodeGetDependencies(node, out.data(), &n));
  }
#endif
  out.resize(n);
  return out;
}

}  // namespace

// A block of pool `p` allocated on `stream` while a capture is under way.
void CacheallocAllocator::reuse_note_alloc(Pool* p, void* ptr, cudaStream_t stream) {
  reuse_.blocks[ptr] = CaptureReuse::Block{p, stream, {}};
}

// record_stream of a pool block during a capture.
void CacheallocAllocator::reuse_note_use(void* ptr, cudaStream_t stream) {
  auto it = reuse_.blocks.find(ptr);
  if (it != reuse_.blocks.end() && stream != it->second.stream) {
    it->second.uses.push_back(stream);
  }
}

// The pool block `ptr` was just freed (the core held it if a stream it was
// used on is being captured): its free markers.
void CacheallocAllocator::reuse_note_free(Pool* p, void* ptr) {
  auto it = reuse_.blocks.find(ptr);
  if (it == reuse_.blocks.end()) {
    return;
  }
  CaptureReuse::Block b = std::move(it->second);
  reuse_.blocks.erase(it);
  if (b.uses.empty() || !reuse_on()) {
    return;  // not held by the core, or the setting was turned off
  }
  std::unordered_set<cudaGraphNode_t> markers;
  unsigned long long capture = 0;
  std::vector<cudaStream_t> streams = b.uses;
  streams.push_back(b.stream);
  for (cudaStream_t s : streams) {
    CaptureInfo info = capture_info(s);
    if (info.status != cudaStreamCaptureStatusActive ||
        (capture != 0 && info.id != capture)) {
      return;  // held until the capture ends
    }
    capture = info.id;
    markers.insert(info.terminals, info.terminals + info.n);
  }
  debugf("pool (%llu,%llu) block %p held with %zu free markers",
         (unsigned long long)p->id.first, (unsigned long long)p->id.second, ptr,
         markers.size());
  reuse_.held[ptr] =
      CaptureReuse::Held{p, b.stream, std::vector<cudaGraphNode_t>(markers.begin(), markers.end())};
}

// Before an allocation on `stream`: held blocks of that stream whose last
// uses precede everything the stream does next go back to their pools.
void CacheallocAllocator::reuse_reclaim(cudaStream_t stream) {
  CaptureInfo info = capture_info(stream);
  if (info.status != cudaStreamCaptureStatusActive || info.n == 0) {
    return;
  }
  auto& visited = reuse_.visited[{info.id, stream}];
  std::vector<cudaGraphNode_t> todo(info.terminals, info.terminals + info.n);
  while (!todo.empty()) {
    cudaGraphNode_t v = todo.back();
    todo.pop_back();
    if (!visited.insert(v).second) {
      continue;
    }
    for (cudaGraphNode_t u : parents(v)) {
      todo.push_back(u);
    }
  }
  for (auto it = reuse_.held.begin(); it != reuse_.held.end();) {
    const auto& h = it->second;
    bool safe = h.stream == stream && !h.markers.empty() &&
                std::all_of(h.markers.begin(), h.markers.end(),
                            [&](cudaGraphNode_t m) { return visited.count(m) > 0; });
    if (!safe) {
      ++it;
      continue;
    }
    int rc = cachealloc_torch_reclaim(h.pool->handle, it->first);
    TORCH_CHECK(rc >= 0, "cachealloc: reuse during a capture: ", last_error());
    debugf("pool (%llu,%llu) block %p reclaimed during the capture (%d)",
           (unsigned long long)h.pool->id.first, (unsigned long long)h.pool->id.second,
           it->first, rc);
    it = reuse_.held.erase(it);
  }
}

// The route to `p` ends: its blocks held behind the capture wait for the
// capture to end in the core, as without the setting.
void CacheallocAllocator::reuse_forget(Pool* p) {
  for (auto it = reuse_.held.begin(); it != reuse_.held.end();) {
    it = it->second.pool == p ? reuse_.held.erase(it) : std::next(it);
  }
  for (auto it = reuse_.blocks.begin(); it != reuse_.blocks.end();) {
    it = it->second.pool == p ? reuse_.blocks.erase(it) : std::next(it);
  }
  if (captures_.load() == 0) {
    reuse_.visited.clear();
  }
}

void CacheallocAllocator::beginAllocateToPool(c10::DeviceIndex dev, MempoolId_t id,
                                              std::function<bool(cudaStream_t)> filter) {
  main_handle(dev);
  std::lock_guard<std::mutex> g(pools_mutex_);
  Pool* p = incref(dev, id);
  debugf("pool (%llu,%llu) begin route, use count %d",
         (unsigned long long)id.first, (unsigned long long)id.second, p->use_count);
  routes_[dev].push_back({id, std::move(filter), p});
  nroutes_[dev].fetch_add(1);
  captures_.fetch_add(1);
}

void CacheallocAllocator::endAllocateToPool(c10::DeviceIndex dev, MempoolId_t id) {
  std::lock_guard<std::mutex> g(pools_mutex_);
  auto& rs = routes_[dev];
  for (auto it = rs.begin(); it != rs.end(); ++it) {
    if (it->id == id) {
      debugf("pool (%llu,%llu) end route", (unsigned long long)id.first,
             (unsigned long long)id.second);
      Pool* p = it->pool;
      rs.erase(it);
      nroutes_[dev].fetch_sub(1);
      captures_.fetch_sub(1);
      reuse_forget(p);
      return;
    }
  }
  TORCH_CHECK(false, "cachealloc: endAllocateToPool for a pool " + pool_name(id) +
              " with no allocation to it under way");
}

void CacheallocAllocator::releasePool(c10::DeviceIndex dev, MempoolId_t id) {
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

// MemPool(allocator=...) makes the pool with the allocator its segments
// come from; a pool that exists already takes no allocator (as PyTorch's).
void CacheallocAllocator::createOrIncrefPool(
    c10::DeviceIndex dev, MempoolId_t id,
    std::shared_ptr<CCA::CUDAAllocator> allocator) {
  main_handle(dev);
  std::lock_guard<std::mutex> g(pools_mutex_);
  if (allocator != nullptr) {
    TORCH_CHECK(find_pool(dev, id) == nullptr, "cachealloc: createOrIncrefPool with an "
                "allocator for the pool " + pool_name(id) + ", which exists already");
    TORCH_CHECK(allocator.get() != static_cast<CCA::CUDAAllocator*>(this),
                "cachealloc: MemPool(allocator=...) given cachealloc's own allocator; "
                "leave allocator out for a pool of cachealloc's memory");
  }
  bool sourced = allocator != nullptr;
  Pool* p = incref(dev, id, std::move(allocator));
  debugf("pool (%llu,%llu) incref, use count %d%s", (unsigned long long)id.first,
         (unsigned long long)id.second, p->use_count,
         sourced ? ", segments from the MemPool allocator" : "");
}

void CacheallocAllocator::setUseOnOOM(c10::DeviceIndex dev, MempoolId_t id,
                                      bool use_on_oom) {
  std::lock_guard<std::mutex> g(pools_mutex_);
  Pool* p = find_pool(dev, id);
  TORCH_CHECK(p != nullptr || !use_on_oom,
              "cachealloc: setUseOnOOM of an unknown pool " + pool_name(id));
  if (p != nullptr) {
    p->use_on_oom = use_on_oom;
  }
}

// MemPool(no_split=True): the pool hands its blocks out whole.
void CacheallocAllocator::setNoSplit(c10::DeviceIndex dev, MempoolId_t id) {
  std::lock_guard<std::mutex> g(pools_mutex_);
  Pool* p = find_pool(dev, id);
  TORCH_CHECK(p != nullptr, "cachealloc: setNoSplit of an unknown pool " + pool_name(id));
  TORCH_CHECK(cachealloc_torch_pool_set_no_split(p->handle, 1) == 0, last_error());
}

int CacheallocAllocator::getPoolUseCount(c10::DeviceIndex dev, MempoolId_t id) {
  std::lock_guard<std::mutex> g(pools_mutex_);
  Pool* p = find_pool(dev, id);
  return p ? p->use_count : 0;
}

bool CacheallocAllocator::checkPoolLiveAllocations(
    c10::DeviceIndex dev, MempoolId_t id,
    const std::unordered_set<void*>& expected) {
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

void CacheallocAllocator::emptyCache(MempoolId_t mempool_id) {
  uint64_t devs = devices_in_use_.load();
  if (mempool_id != kNoPool) {
    // As PyTorch's allocator: a pool still in use (a live graph or
    // MemPool) keeps its cached blocks, which a captured graph may use.
    std::lock_guard<std::mutex> g(pools_mutex_);
    for (int d = 0; d < kMaxDevices; ++d) {
      Pool* p = find_pool(d, mempool_id);
      if (p != nullptr && p->use_count == 0) {
        clear_source_error();
        if (cachealloc_torch_empty_cache(p->handle) < 0) {
          rethrow_source_error();  // what the MemPool's allocator threw
          TORCH_CHECK(false, last_error());
        }
        push_segment_changes(p->handle, p->device, p->id, true);
        maybe_drop(p);
      }
    }
    return;
  }
  for (int d = 0; d < kMaxDevices; ++d) {
    if (devs & (1ull << d)) {
      TORCH_CHECK(cachealloc_torch_empty_cache(main_[d].load()) >= 0,
                  last_error());
      push_segment_changes(main_[d].load(), static_cast<c10::DeviceIndex>(d), kNoPool, true);
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
    push_segment_changes(p->handle, p->device, p->id, true);
    maybe_drop(p);
  }
  clear_source_error();
}

std::shared_ptr<CCA::AllocatorState> CacheallocAllocator::getCheckpointState(
    c10::DeviceIndex dev, MempoolId_t id) {
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
CCA::CheckpointDelta CacheallocAllocator::setCheckpointPoolState(
    c10::DeviceIndex dev, std::shared_ptr<CCA::AllocatorState> as) {
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

}  // namespace cachealloc
