// Sharing memory: CUDA IPC (refused, loudly) and peer access between devices.
// (The class and what the parts share: allocator.h.)

#include "allocator.h"

namespace cachealloc {

std::shared_ptr<void> CacheallocAllocator::getIpcDevPtr(std::string) {
  TORCH_CHECK(false,
              "cachealloc does not support CUDA IPC (opening a CUDA tensor "
              "shared by another process, torch.multiprocessing)");
  return nullptr;
}

CCA::ShareableHandle CacheallocAllocator::shareIpcHandle(void*) {
  TORCH_CHECK(false,
              "cachealloc does not support CUDA IPC (sharing a CUDA tensor "
              "with another process, torch.multiprocessing)");
  return {};
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
  // `dev_to_access`'s pages, mapped now and later, by every allocator there.
  TORCH_CHECK(cachealloc_torch_enable_peer_access(dev_to_access, dev) == 0,
              last_error());
}

}  // namespace cachealloc
