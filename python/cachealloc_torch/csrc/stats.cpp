// Statistics: PyTorch's DeviceStats from the core allocators' statistics
// vectors (Note [The statistics vector] in src/capi_torch.rs).
// (The class and what the parts share: allocator.h.)

#include "allocator.h"

namespace cachealloc {

std::vector<void*> CacheallocAllocator::handles_of(c10::DeviceIndex dev) {
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
std::array<int64_t, kStatsLen> CacheallocAllocator::raw_stats(c10::DeviceIndex dev) {
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

bool CacheallocAllocator::accumulated(size_t i) {
  // allocated/freed of every stat, and the counters after the stats.
  return i >= CACHEALLOC_STATS_NUM_ALLOC_RETRIES
             ? i < CACHEALLOC_STATS_MAX_SPLIT_SIZE
             : (i % CACHEALLOC_STAT_FIELDS) == CACHEALLOC_STAT_ALLOCATED ||
                   (i % CACHEALLOC_STAT_FIELDS) == CACHEALLOC_STAT_FREED;
}

CDA::DeviceStats CacheallocAllocator::getDeviceStats(c10::DeviceIndex dev) {
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

void CacheallocAllocator::resetAccumulatedStats(c10::DeviceIndex dev) {
  TORCH_CHECK(dev >= 0 && dev < kMaxDevices, "cachealloc: bad device");
  auto v = raw_stats(dev);
  std::lock_guard<std::mutex> g(stats_mutex_);
  base_[dev] = v;
}

void CacheallocAllocator::resetPeakStats(c10::DeviceIndex dev) {
  TORCH_CHECK(dev >= 0 && dev < kMaxDevices, "cachealloc: bad device");
  for (void* h : handles_of(dev)) {
    cachealloc_torch_reset_peak(h);
  }
}

// PyTorch's contract: a zero *largestBlock asks for the largest block a
// request could get, the device's free memory included (cuDNN's benchmark
// mode sizes its workspace by it); a nonzero one is a guess to raise.
void CacheallocAllocator::cacheInfo(c10::DeviceIndex dev, size_t* largestBlock) {
  void* h = main_handle(dev);
  int64_t n = *largestBlock == 0 ? cachealloc_torch_cache_info(h)
                                 : cachealloc_torch_largest_free(h);
  TORCH_CHECK(n >= 0, last_error());
  *largestBlock = std::max(*largestBlock, static_cast<size_t>(n));
}

}  // namespace cachealloc
