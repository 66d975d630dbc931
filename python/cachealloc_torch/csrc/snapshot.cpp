// Snapshots (torch.cuda.memory._snapshot) from the core's snapshot words
// (Note [The snapshot words] in src/capi_torch.rs), and the allocation history
// of torch.cuda.memory._record_memory_history.
// (The class and what the parts share: allocator.h.)

#include "allocator.h"

namespace cachealloc {

// Note [History metadata]: every history entry carries two strings, as
// PyTorch's allocator records them (torch 2.11, CUDACachingAllocator.cpp
// record_trace) and as its snapshot and pickle write them under the keys
// "compile_context" and "user_metadata":
//
// - compile_context: the innermost torch.compile region the allocating
//   thread is in ("Torch-Compiled Region: 0/0"), or "N/A" outside one.
//   PyTorch's record_function callback (registered by
//   _record_memory_history(..., compile_context=True)) calls
//   pushCompileContext / popCompileContext around each region; as in
//   PyTorch, they change the thread's stack only while history is on.
// - user_metadata: the thread's string from
//   torch.cuda.memory._set_memory_metadata (kept whether history is on or
//   not; "" clears it).
//
// Both are per thread, as PyTorch keeps them (its static thread_locals are
// shared by all devices), so an entry carries what the thread that
// allocated or freed had set. record_function annotations (recordAnnotation,
// _record_memory_history's annotation callback) go to a ring of their own,
// snapshot's external_annotations, while history is on.
namespace {
thread_local std::vector<std::string> tl_compile_context;
thread_local std::string tl_user_metadata;

std::string compile_context_now() {
  return tl_compile_context.empty() ? std::string("N/A") : tl_compile_context.back();
}

// The segments in an allocator's snapshot words: address → (size, stream).
std::map<uint64_t, std::pair<uint64_t, void*>> segments_in(const std::vector<uint64_t>& w) {
  std::map<uint64_t, std::pair<uint64_t, void*>> out;
  for (size_t i = 0; i + kSegmentWords <= w.size();) {
    out[w[i + CACHEALLOC_SEGMENT_ADDRESS]] = {
        w[i + CACHEALLOC_SEGMENT_TOTAL_SIZE],
        reinterpret_cast<void*>(w[i + CACHEALLOC_SEGMENT_STREAM])};
    i += kSegmentWords + w[i + CACHEALLOC_SEGMENT_BLOCKS] * kBlockWords;
  }
  return out;
}

// What changes whenever allocator `h`'s segments may have: its segments
// made and given back (an expandable range's reservation counts there, not
// in the device calls) and its device allocations and frees.
uint64_t device_calls(void* h) {
  std::array<int64_t, kStatsLen> v{};
  if (cachealloc_torch_stats(h, v.data(), kStatsLen) != 0) {
    return 0;
  }
  constexpr size_t seg = CACHEALLOC_STATS_SEGMENT +
                         CACHEALLOC_STAT_AGGREGATE * CACHEALLOC_STAT_FIELDS;
  return static_cast<uint64_t>(v[seg + CACHEALLOC_STAT_ALLOCATED] + v[seg + CACHEALLOC_STAT_FREED] +
                               v[CACHEALLOC_STATS_NUM_DEVICE_ALLOC] +
                               v[CACHEALLOC_STATS_NUM_DEVICE_FREE]);
}
}  // namespace

std::vector<uint64_t> CacheallocAllocator::words_of(void* h) {
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

void CacheallocAllocator::add_segments(std::vector<CDA::SegmentInfo>& out, void* h,
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

// The segments of the devices in use, of every pool or only `mempool_id`'s.
std::vector<CDA::SegmentInfo> CacheallocAllocator::segments_of(MempoolId_t mempool_id) {
  std::vector<CDA::SegmentInfo> out;
  uint64_t devs = devices_in_use_.load();
  for (int d = 0; d < kMaxDevices; ++d) {
    if (!(devs & (1ull << d))) {
      continue;
    }
    void* h = main_[d].load();
    if (mempool_id == kNoPool) {
      add_segments(out, h, d, kNoPool, cachealloc_torch_is_expandable(h) == 1);
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
      add_segments(out, ph, d, id, false);
    }
  }
  return out;
}

CCA::SnapshotInfo CacheallocAllocator::snapshot(MempoolId_t mempool_id,
                                                bool include_traces) {
  CCA::SnapshotInfo info{};
  uint64_t devs = devices_in_use_.load();
  if (history_on_.load()) {
    // Note [Segment events]: changes made out of sight of the hooks (the
    // library's own empty_cache, say) are in the history the snapshot gives.
    for (int d = 0; d < kMaxDevices; ++d) {
      if (devs & (1ull << d)) {
        push_segment_changes(main_[d].load(), static_cast<c10::DeviceIndex>(d), kNoPool, false);
      }
    }
    std::lock_guard<std::mutex> g(pools_mutex_);  // a pool is not dropped meanwhile
    for (auto& [key, p] : pools_) {
      push_segment_changes(p->handle, p->device, p->id, false);
    }
  }
  info.segments = segments_of(mempool_id);
  info.config_metadata = config_info(devs);
  // Entries and annotations carry TSC times; a snapshot gives microseconds
  // since the epoch, as PyTorch's does.
  auto tsc_to_us = clock_converter_.makeConverter();
  auto to_us = [&](CDA::trace_time_& t) {
    auto approx = t.approx_t_;
    t.t_ = tsc_to_us(approx) / 1000;
  };
  std::lock_guard<std::mutex> g(history_mutex_);
  if (include_traces) {
    int n = std::max(device_count_, 1);
    info.device_traces.resize(n);
    for (int d = 0; d < n && d < kMaxDevices; ++d) {
      auto& ring = traces_[d];
      auto& out = info.device_traces[d];
      size_t start = ring.size() < max_entries_ ? 0 : ring_next_[d];
      for (size_t k = 0; k < ring.size(); ++k) {
        out.push_back(ring[(start + k) % ring.size()]);
        to_us(out.back().time_);
      }
    }
    size_t start = annotations_.size() < max_entries_ ? 0 : annotations_next_;
    for (size_t k = 0; k < annotations_.size(); ++k) {
      info.external_annotations.push_back(
          annotations_[(start + k) % annotations_.size()]);
      to_us(info.external_annotations.back().time_);
    }
  }
  // As PyTorch's allocator, each device's history gets a `snapshot` entry
  // (the active bytes the snapshot saw), after the entries it returned.
  if (history_on_.load() &&
      !skip_.count(static_cast<int>(CDA::TraceEntry::SNAPSHOT))) {
    std::array<size_t, kMaxDevices> active{};
    for (const auto& s : info.segments) {
      active[s.device] += s.active_size;
    }
    for (int d = 0; d < kMaxDevices; ++d) {
      if (devs & (1ull << d)) {
        push_trace(CDA::TraceEntry(CDA::TraceEntry::SNAPSHOT,
                                   static_cast<c10::DeviceIndex>(d), 0, active[d],
                                   nullptr, mempool_id, c10::getApproximateTime(),
                                   nullptr, compile_context_now(), tl_user_metadata));
      }
    }
  }
  return info;
}

// PyTorch's allocator settings as a snapshot reports them
// (snapshot["allocator_settings"]): PyTorch's parsed configuration, with
// what cachealloc applies where it decides (max_split_size and
// expandable_segments of the first device in use).
CCA::AllocatorConfigInfo CacheallocAllocator::config_info(uint64_t devs) {
  using Config = c10::CachingAllocator::AcceleratorAllocatorConfig;
  using CudaConfig = CCA::CUDAAllocatorConfig;
  CCA::AllocatorConfigInfo c{};
  c.garbage_collection_threshold = Config::garbage_collection_threshold();
  c.max_split_size = Config::max_split_size();
  c.pinned_num_register_threads = CudaConfig::pinned_num_register_threads();
  c.expandable_segments = Config::use_expandable_segments();
  c.release_lock_on_malloc = CudaConfig::release_lock_on_cudamalloc();
  c.pinned_use_host_register = CudaConfig::pinned_use_cuda_host_register();
  c.graph_capture_record_stream_reuse = CudaConfig::graph_capture_record_stream_reuse();
  c.last_allocator_settings = Config::last_allocator_settings();
  c.roundup_power2_divisions = Config::roundup_power2_divisions();
  if (devs != 0) {
    auto d = static_cast<c10::DeviceIndex>(__builtin_ctzll(devs));
    void* h = main_[d].load();
    int64_t split = raw_stats(d)[CACHEALLOC_STATS_MAX_SPLIT_SIZE];
    c.max_split_size = split < 0 ? std::numeric_limits<size_t>::max()
                                 : static_cast<size_t>(split);
    c.expandable_segments = cachealloc_torch_is_expandable(h) == 1;
  }
  return c;
}

void* CacheallocAllocator::getBaseAllocation(void* ptr, size_t* size) {
  auto addr = reinterpret_cast<uint64_t>(ptr);
  for (auto& s : segments_of(kNoPool)) {
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

void CacheallocAllocator::recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                                        size_t alloc_trace_max_entries, CCA::RecordContext when,
                                        bool clearHistory,
                                        const std::vector<std::string>& skip_actions) {
  // Note [Segment events]: the segments each allocator has now are where
  // history starts from.
  std::unordered_map<void*, SegView> views;
  if (enabled) {
    uint64_t devs = devices_in_use_.load();
    for (int d = 0; d < kMaxDevices; ++d) {
      if (devs & (1ull << d)) {
        for (void* h : handles_of(static_cast<c10::DeviceIndex>(d))) {
          views[h] = SegView{device_calls(h), segments_in(words_of(h))};
        }
      }
    }
  }
  {
    std::lock_guard<std::mutex> g(seg_mutex_);
    seg_views_ = std::move(views);
  }
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
    annotations_.clear();
    annotations_next_ = 0;
  }
  if (!enabled) {
    contexts_.clear();
  }
  history_on_.store(enabled);
}

bool CacheallocAllocator::isHistoryEnabled() {
  return history_on_.load();
}

void CacheallocAllocator::push_trace(CDA::TraceEntry e) {
  // history_mutex_ held
  auto& ring = traces_[e.device_];
  if (ring.size() < max_entries_) {
    ring.push_back(std::move(e));
  } else {
    ring[ring_next_[e.device_]] = std::move(e);
    ring_next_[e.device_] = (ring_next_[e.device_] + 1) % max_entries_;
  }
}

void CacheallocAllocator::record(CDA::TraceEntry::Action action, c10::DeviceIndex dev, void* ptr,
                                 size_t size, cudaStream_t stream, MempoolId_t pool,
                                 bool keep_context, void* h) {
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
  std::vector<CDA::TraceEntry> segs;
  if (h != nullptr) {
    segment_changes(h, dev, pool, when >= CCA::RecordContext::ALLOC ? ctx : nullptr, segs);
  }
  std::lock_guard<std::mutex> g(history_mutex_);
  push_entries(segs);
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
        when_ >= CCA::RecordContext::ALLOC ? ctx : nullptr,
        compile_context_now(), tl_user_metadata));
  }
}

void CacheallocAllocator::record_free(c10::DeviceIndex dev, void* ptr, MempoolId_t pool,
                                      size_t size, void* h) {
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
  std::vector<CDA::TraceEntry> segs;
  if (h != nullptr) {
    segment_changes(h, dev, pool, ctx, segs);
  }
  std::lock_guard<std::mutex> g(history_mutex_);
  if (history_on_.load()) {
    for (auto a : {CDA::TraceEntry::FREE_REQUESTED,
                   CDA::TraceEntry::FREE_COMPLETED}) {
      if (!skip_.count(static_cast<int>(a))) {
        push_trace(CDA::TraceEntry(a, dev, reinterpret_cast<size_t>(ptr),
                                   size, nullptr, pool,
                                   c10::getApproximateTime(), ctx,
                                   compile_context_now(), tl_user_metadata));
      }
    }
  }
  push_entries(segs);
}

// ---- Note [Segment events] ------------------------------------------------
//
// PyTorch's allocator records a segment_alloc entry for each cudaMalloc and
// segment_free for each cudaFree (segment_map / segment_unmap for the pages
// of expandable segments), and its viewer needs them: the "Allocator State
// History" view rebuilds the segments of every earlier point by undoing
// these entries from the snapshot's segments, and a block whose segment was
// given back later (empty_cache) would otherwise lie in no segment. The core
// makes those calls out of sight, so while history is on each allocator's
// segments are compared with what it had when last looked at, whenever its
// counts of segments made and given back or of device calls have changed:
// after the allocations, frees and out-of-memory errors it served, after
// emptyCache and a new memory fraction, before a snapshot, and when a
// private pool is dropped.
// A segment that appeared is a segment_alloc entry, one that went a
// segment_free entry, placed before the allocation (or out-of-memory) entry
// that caused it and after the free entries; an expandable segment's range
// appearing or going is a segment_map / segment_unmap entry of the whole
// range (the pages mapped inside it are not reported one by one; its blocks
// stay inside it). An allocator first seen after history began starts with
// no segments, so its segments are new then. Entries carry the context of
// the request that caused them, as PyTorch's do.


// The entries for allocator `h`'s segment changes since it was last looked
// at, into `out` (takes seg_mutex_; not history_mutex_).
void CacheallocAllocator::segment_changes(void* h, c10::DeviceIndex dev, MempoolId_t pool,
                                          const std::shared_ptr<c10::GatheredContext>& ctx,
                                          std::vector<CDA::TraceEntry>& out) {
  if (!history_on_.load(std::memory_order_relaxed)) {
    return;
  }
  uint64_t calls = device_calls(h);
  std::lock_guard<std::mutex> g(seg_mutex_);
  auto it = seg_views_.find(h);
  if (it != seg_views_.end() ? it->second.calls == calls : calls == 0) {
    return;
  }
  auto now = segments_in(words_of(h));
  bool expandable = cachealloc_torch_is_expandable(h) == 1;
  auto gone = expandable ? CDA::TraceEntry::SEGMENT_UNMAP : CDA::TraceEntry::SEGMENT_FREE;
  auto came = expandable ? CDA::TraceEntry::SEGMENT_MAP : CDA::TraceEntry::SEGMENT_ALLOC;
  SegView& view = seg_views_[h];
  auto entry = [&](CDA::TraceEntry::Action a, uint64_t addr,
                   const std::pair<uint64_t, void*>& seg) {
    out.emplace_back(a, dev, addr, seg.first, seg.second, pool, c10::getApproximateTime(), ctx,
                     compile_context_now(), tl_user_metadata);
  };
  for (const auto& [addr, seg] : view.segs) {
    auto n = now.find(addr);
    if (n == now.end() || n->second.first != seg.first) {
      entry(gone, addr, seg);
    }
  }
  for (const auto& [addr, seg] : now) {
    auto o = view.segs.find(addr);
    if (o == view.segs.end() || o->second.first != seg.first) {
      entry(came, addr, seg);
    }
  }
  view.segs = std::move(now);
  view.calls = calls;
}

// history_mutex_ held.
void CacheallocAllocator::push_entries(std::vector<CDA::TraceEntry>& entries) {
  if (!history_on_.load()) {
    return;
  }
  for (auto& e : entries) {
    if (!skip_.count(static_cast<int>(e.action_))) {
      push_trace(std::move(e));
    }
  }
  entries.clear();
}

// Records allocator `h`'s segment changes now (emptyCache, a new memory
// fraction), with the caller's stack when history keeps stacks of frees.
void CacheallocAllocator::push_segment_changes(void* h, c10::DeviceIndex dev, MempoolId_t pool,
                                               bool with_context) {
  if (!history_on_.load(std::memory_order_relaxed)) {
    return;
  }
  CCA::CreateContextFn rec;
  CCA::RecordContext when;
  {
    std::lock_guard<std::mutex> g(history_mutex_);
    rec = recorder_;
    when = when_;
  }
  std::shared_ptr<c10::GatheredContext> ctx;
  if (with_context && rec && when == CCA::RecordContext::ALL) {
    ctx = rec();
  }
  std::vector<CDA::TraceEntry> segs;
  segment_changes(h, dev, pool, ctx, segs);
  std::lock_guard<std::mutex> g(history_mutex_);
  push_entries(segs);
}

// Private pool allocator `h` is being dropped: its remaining segments go.
void CacheallocAllocator::forget_segments(void* h, c10::DeviceIndex dev, MempoolId_t pool) {
  std::vector<CDA::TraceEntry> segs;
  {
    std::lock_guard<std::mutex> g(seg_mutex_);
    auto it = seg_views_.find(h);
    if (it == seg_views_.end()) {
      return;
    }
    for (const auto& [addr, seg] : it->second.segs) {
      segs.emplace_back(CDA::TraceEntry::SEGMENT_FREE, dev, addr, seg.first, seg.second, pool,
                        c10::getApproximateTime(), nullptr, compile_context_now(),
                        tl_user_metadata);
    }
    seg_views_.erase(it);
  }
  std::lock_guard<std::mutex> g(history_mutex_);
  push_entries(segs);
}

// ---- memory-viz metadata: Note [History metadata] -----------------------

void CacheallocAllocator::recordAnnotation(
    const std::vector<std::pair<std::string, std::string>>& md) {
  if (!history_on_.load(std::memory_order_relaxed)) {
    return;
  }
  CDA::AnnotationEntry ae(c10::cuda::current_device(), c10::getApproximateTime());
  for (const auto& [name, value] : md) {
    ae.recordUserMetadata(name, value);
  }
  std::lock_guard<std::mutex> g(history_mutex_);
  if (annotations_.size() < max_entries_) {
    annotations_.push_back(std::move(ae));
  } else {
    annotations_[annotations_next_] = std::move(ae);
    annotations_next_ = (annotations_next_ + 1) % max_entries_;
  }
}

void CacheallocAllocator::pushCompileContext(std::string& md) {
  if (history_on_.load(std::memory_order_relaxed)) {
    tl_compile_context.push_back(md);
  }
}

void CacheallocAllocator::popCompileContext() {
  if (history_on_.load(std::memory_order_relaxed) && !tl_compile_context.empty()) {
    tl_compile_context.pop_back();
  }
}

void CacheallocAllocator::setUserMetadata(const std::string& metadata) {
  tl_user_metadata = metadata;
}

std::string CacheallocAllocator::getUserMetadata() {
  return tl_user_metadata;
}

void CacheallocAllocator::attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) {
  std::lock_guard<std::mutex> g(observers_mutex_);
  observers_.push_back(std::move(observer));
}

void CacheallocAllocator::attachAllocatorTraceTracker(CCA::AllocatorTraceTracker) {
  TORCH_CHECK(false,
              "cachealloc does not support allocator trace trackers "
              "(attachAllocatorTraceTracker); use "
              "torch.cuda.memory._record_memory_history instead");
}

}  // namespace cachealloc
