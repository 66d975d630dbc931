// Sharing memory: CUDA IPC (torch.multiprocessing sending CUDA tensors to
// another process) and peer access between devices.
// (The class and what the parts share: allocator.h.)
//
// The sender's shareIpcHandle names what backs a block in a handle (bytes)
// and an offset: a plain segment's cudaIpcMemHandle_t, or the pages of an
// expandable segment as POSIX file descriptors, in PyTorch 2.11's formats
// where they can say it (Note [IPC handles] in src/capi_torch/ipc.rs), so
// that either side may be PyTorch's own allocator. The receiver's
// getIpcDevPtr opens a handle once however many tensors use it, and the
// shared_ptr's deleter closes it when the last one is gone. PyTorch's own
// reference counting (CudaIPCSentData, torch/csrc/CudaIPCTypes.cpp) keeps the
// sender's block allocated until every receiver released it; the block is
// then freed through raw_delete_fn like any other, and a block of an
// expandable segment stays pinned until then (Note [Shared blocks are
// pinned] in allocator/src/allocator/ipc.rs).

#include "allocator.h"

namespace cachealloc {

CCA::ShareableHandle CacheallocAllocator::shareIpcHandle(void* ptr) {
  TORCH_CHECK(ptr != nullptr, "cachealloc: sharing a null pointer with another process");
  // The allocators that may own `ptr`: its private pool's, else each
  // device's in use, the current device's first.
  std::vector<void*> owners;
  if (pool_live_.load(std::memory_order_relaxed) > 0) {
    std::lock_guard<std::mutex> g(pools_mutex_);
    auto it = pool_of_.find(ptr);
    if (it != pool_of_.end()) {
      owners.push_back(it->second->handle);
    }
  }
  uint64_t devs = devices_in_use_.load(std::memory_order_relaxed);
  int cur = c10::cuda::current_device();
  if (cur >= 0 && cur < kMaxDevices && (devs & (1ull << cur))) {
    owners.push_back(main_[cur].load(std::memory_order_acquire));
  }
  for (int d = 0; d < kMaxDevices; ++d) {
    if (d != cur && (devs & (1ull << d))) {
      owners.push_back(main_[d].load(std::memory_order_acquire));
    }
  }
  std::string handle(256, '\0');
  for (void* h : owners) {
    int64_t offset = 0;
    auto out = reinterpret_cast<uint8_t*>(&handle[0]);
    int64_t n = cachealloc_torch_ipc_share(h, ptr, out, handle.size(), &offset);
    if (n == -2) {
      continue;  // not this allocator's
    }
    TORCH_CHECK(n >= 0, "cachealloc: sharing a CUDA tensor with another process: ",
                last_error());
    if (static_cast<size_t>(n) > handle.size()) {
      // A block over many pages: again with room (the same handle).
      handle.resize(static_cast<size_t>(n));
      out = reinterpret_cast<uint8_t*>(&handle[0]);
      n = cachealloc_torch_ipc_share(h, ptr, out, handle.size(), &offset);
      TORCH_CHECK(n >= 0 && static_cast<size_t>(n) <= handle.size(),
                  "cachealloc: sharing a CUDA tensor with another process: ", last_error());
    }
    handle.resize(static_cast<size_t>(n));
    debugf("shareIpcHandle %p: handle of %zu bytes (kind '%c'), offset %lld", ptr,
           handle.size(), handle.empty() ? '?' : handle[0], (long long)offset);
    return CCA::ShareableHandle{static_cast<ptrdiff_t>(offset), std::move(handle)};
  }
  TORCH_CHECK(false, "cachealloc: sharing " + hex(ptr) +
              " with another process: no cachealloc allocator handed it out");
  return {};
}

std::shared_ptr<void> CacheallocAllocator::getIpcDevPtr(std::string handle) {
  // PyTorch makes the tensor's device current first (a CUDAGuard in
  // _new_shared_cuda).
  c10::DeviceIndex dev = c10::cuda::current_device();
  void* p = cachealloc_torch_ipc_open(
      dev, reinterpret_cast<const uint8_t*>(handle.data()), handle.size());
  TORCH_CHECK(p != nullptr, last_error());
  debugf("getIpcDevPtr on device %d: %zu bytes (kind '%c') open at %p", (int)dev,
         handle.size(), handle.empty() ? '?' : handle[0], p);
  return std::shared_ptr<void>(p, [dev](void* q) {
    // A deleter must not throw: a failure is reported on stderr.
    if (cachealloc_torch_ipc_close(dev, q) != 0) {
      std::fprintf(stderr, "cachealloc: %s\n", last_error().c_str());
      std::fflush(stderr);
    }
  });
}

// PyTorch's free-memory callbacks (FreeCudaMemoryCallbacksRegistry): among
// them CudaIPCCollect, which frees the blocks of tensors shared with other
// processes that every receiver has released since. PyTorch's allocator runs
// them before it grows; this one before it fails (alloc_on).
bool run_free_memory_callbacks() {
  bool freed = false;
  auto* registry = c10::FreeCudaMemoryCallbacksRegistry();
  for (const auto& name : registry->Keys()) {
    auto callback = registry->Create(name);
    if (callback) {
      freed |= callback->Execute();
    }
  }
  debugf("free-memory callbacks ran: %s", freed ? "memory freed" : "nothing freed");
  return freed;
}

void CacheallocAllocator::enablePeerAccess(c10::DeviceIndex dev,
                                           c10::DeviceIndex dev_to_access) {
  c10::cuda::CUDAGuard guard(dev);
  cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
  } else {
    C10_CUDA_CHECK(err);
  }
  // Pages of expandable segments are mapped through the virtual memory
  // API, which the call above does not cover: `dev` is granted access to
  // `dev_to_access`'s pages, mapped now and later, by every allocator there
  // (pages other processes shared and this one mapped on it included).
  TORCH_CHECK(cachealloc_torch_enable_peer_access(dev_to_access, dev) == 0,
              last_error());
}

}  // namespace cachealloc
