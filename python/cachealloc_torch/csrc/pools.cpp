// Private pools (CUDA graphs, torch.cuda.MemPool): each its own core
// allocator, routed to while a capture or use_mem_pool is under way; and their
// checkpoints (CUDA graph trees).
// (The class and what the parts share: allocator.h.)

#include "allocator.h"

namespace cachealloc {

// pools_mutex_ held.
Pool* CacheallocAllocator::find_pool(c10::DeviceIndex dev, MempoolId_t id) {
  auto it = pools_.find(key(dev, id));
  return it == pools_.end() ? nullptr : it->second.get();
}

// pools_mutex_ held.
Pool* CacheallocAllocator::incref(c10::DeviceIndex dev, MempoolId_t id) {
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
      rs.erase(it);
      nroutes_[dev].fetch_sub(1);
      captures_.fetch_sub(1);
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

void CacheallocAllocator::createOrIncrefPool(
    c10::DeviceIndex dev, MempoolId_t id,
    std::shared_ptr<CCA::CUDAAllocator> allocator) {
  TORCH_CHECK(allocator == nullptr,
              "cachealloc does not support MemPool(allocator=...): a pool "
              "with its own allocator; use torch.cuda.MemPool() without one");
  main_handle(dev);
  std::lock_guard<std::mutex> g(pools_mutex_);
  Pool* p = incref(dev, id);
  debugf("pool (%llu,%llu) incref, use count %d", (unsigned long long)id.first,
         (unsigned long long)id.second, p->use_count);
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

void CacheallocAllocator::setNoSplit(c10::DeviceIndex, MempoolId_t) {
  TORCH_CHECK(false,
              "cachealloc does not support MemPool(no_split=True): its "
              "pools split blocks like the device's allocator");
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
