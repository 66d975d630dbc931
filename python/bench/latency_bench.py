# PyTorch's side of the GPU latency comparison, kept in the repository so that
# it runs next to benches/gpu_latency.rs on the same GPU machine. Usage:
#   python3 python/bench/latency_bench.py OUT.json
#   python3 python/bench/latency_bench.py OUT.json --cachealloc CONF
# With --cachealloc, cachealloc is installed as PyTorch's allocator (C++ mode,
# CACHEALLOC_CONF=CONF) first, so the torch_* rows time the whole path a
# tensor's allocation takes through it; the driver rows are left out.
#
# Anchor latency bench, run on the GPU machine: PyTorch's caching allocator
# (C++ raw_alloc/raw_delete, no Python in the loop), cudaMalloc/cudaFree, and
# the driver's stream-ordered pool (cudaMallocAsync/cudaFreeAsync).
import json, os, sys, time
import torch
from torch.utils.cpp_extension import load_inline

SRC = r'''
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <chrono>
#include <random>
#include <thread>
#include <vector>
#include <atomic>
using clk = std::chrono::steady_clock;
static double ns_since(clk::time_point t0, long n) {
  return std::chrono::duration<double, std::nano>(clk::now() - t0).count() / n;
}
double torch_pair(long size, long iters) {
  for (int i = 0; i < 1000; i++) c10::cuda::CUDACachingAllocator::raw_delete(c10::cuda::CUDACachingAllocator::raw_alloc(size));
  auto t0 = clk::now();
  for (long i = 0; i < iters; i++) {
    void* p = c10::cuda::CUDACachingAllocator::raw_alloc(size);
    c10::cuda::CUDACachingAllocator::raw_delete(p);
  }
  return ns_since(t0, iters);
}
// slots: random alloc/free over `slots` live slots, log-uniform sizes [512 B, max_bytes]
double torch_mixed(long iters, int slots, long max_bytes, int seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(std::log(512.0), std::log((double)max_bytes));
  std::vector<void*> live(slots, nullptr);
  std::vector<long> sizes(iters);
  for (long i = 0; i < iters; i++) sizes[i] = (long)std::exp(u(rng));
  std::vector<int> pick(iters);
  for (long i = 0; i < iters; i++) pick[i] = rng() % slots;
  // warm
  for (long i = 0; i < iters; i++) { int s = pick[i]; if (live[s]) { c10::cuda::CUDACachingAllocator::raw_delete(live[s]); live[s] = nullptr; } else live[s] = c10::cuda::CUDACachingAllocator::raw_alloc(sizes[i]); }
  auto t0 = clk::now();
  for (long i = 0; i < iters; i++) { int s = pick[i]; if (live[s]) { c10::cuda::CUDACachingAllocator::raw_delete(live[s]); live[s] = nullptr; } else live[s] = c10::cuda::CUDACachingAllocator::raw_alloc(sizes[i]); }
  double r = ns_since(t0, iters);
  for (auto p : live) if (p) c10::cuda::CUDACachingAllocator::raw_delete(p);
  return r;
}
// T threads each doing alloc/free pairs of `size`; returns total ops (pairs) per second
double torch_threads(int threads, long size, long iters) {
  std::atomic<int> go{0};
  std::vector<std::thread> ts;
  int dev = c10::cuda::current_device();
  auto t0 = clk::now();
  for (int t = 0; t < threads; t++) ts.emplace_back([&, t] {
    c10::cuda::set_device(dev);
    for (long i = 0; i < iters; i++) {
      void* p = c10::cuda::CUDACachingAllocator::raw_alloc(size + 512 * (t % 4));
      c10::cuda::CUDACachingAllocator::raw_delete(p);
    }
  });
  for (auto& t : ts) t.join();
  double secs = std::chrono::duration<double>(clk::now() - t0).count();
  return threads * iters / secs;
}
double cuda_pair(long size, long iters) {
  void* p;
  cudaMalloc(&p, size); cudaFree(p);
  auto t0 = clk::now();
  for (long i = 0; i < iters; i++) { cudaMalloc(&p, size); cudaFree(p); }
  return ns_since(t0, iters);
}
double async_pair(long size, long iters) {
  cudaMemPool_t pool; int dev; cudaGetDevice(&dev);
  cudaDeviceGetDefaultMemPool(&pool, dev);
  uint64_t thr = UINT64_MAX;
  cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &thr);
  cudaStream_t s; cudaStreamCreate(&s);
  void* p;
  for (int i = 0; i < 1000; i++) { cudaMallocAsync(&p, size, s); cudaFreeAsync(p, s); }
  cudaStreamSynchronize(s);
  auto t0 = clk::now();
  for (long i = 0; i < iters; i++) { cudaMallocAsync(&p, size, s); cudaFreeAsync(p, s); }
  double r = ns_since(t0, iters);
  cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  return r;
}
double async_mixed(long iters, int slots, long max_bytes, int seed) {
  cudaStream_t s; cudaStreamCreate(&s);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(std::log(512.0), std::log((double)max_bytes));
  std::vector<void*> live(slots, nullptr);
  std::vector<long> sizes(iters); for (long i = 0; i < iters; i++) sizes[i] = (long)std::exp(u(rng));
  std::vector<int> pick(iters); for (long i = 0; i < iters; i++) pick[i] = rng() % slots;
  for (long i = 0; i < iters; i++) { int k = pick[i]; if (live[k]) { cudaFreeAsync(live[k], s); live[k] = nullptr; } else cudaMallocAsync(&live[k], sizes[i], s); }
  cudaStreamSynchronize(s);
  auto t0 = clk::now();
  for (long i = 0; i < iters; i++) { int k = pick[i]; if (live[k]) { cudaFreeAsync(live[k], s); live[k] = nullptr; } else cudaMallocAsync(&live[k], sizes[i], s); }
  double r = ns_since(t0, iters);
  for (auto p : live) if (p) cudaFreeAsync(p, s);
  cudaStreamSynchronize(s); cudaStreamDestroy(s);
  return r;
}
double empty_cache_ms(int nseg, long seg_bytes) {
  std::vector<void*> ps;
  for (int i = 0; i < nseg; i++) ps.push_back(c10::cuda::CUDACachingAllocator::raw_alloc(seg_bytes));
  for (auto p : ps) c10::cuda::CUDACachingAllocator::raw_delete(p);
  auto t0 = clk::now();
  c10::cuda::CUDACachingAllocator::emptyCache();
  return std::chrono::duration<double, std::milli>(clk::now() - t0).count();
}
'''
FUNCS = ["torch_pair", "torch_mixed", "torch_threads", "cuda_pair", "async_pair", "async_mixed", "empty_cache_ms"]

def main(out, conf=None):
    if conf is not None:
        os.environ["CACHEALLOC_CONF"] = conf
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import cachealloc_torch
        cachealloc_torch.enable(mode="cpp")
    t0 = time.time()
    ext = load_inline("anchor_lat", cpp_sources=SRC, functions=FUNCS, with_cuda=True,
                      extra_ldflags=["-lcudart"], verbose=False)
    print(f"compiled in {time.time()-t0:.0f}s", flush=True)
    torch.cuda.init(); torch.empty(1, device="cuda")
    res = {}
    def rec(k, v):
        res[k] = v; print(f"{k:45s} {v:12.1f}", flush=True)
    for size in [512, 65536, 1 << 20, 16 << 20, 256 << 20]:
        rec(f"torch_pair_ns[{size}]", min(ext.torch_pair(size, 200000) for _ in range(3)))
        if conf is None:
            rec(f"async_pair_ns[{size}]", min(ext.async_pair(size, 200000) for _ in range(3)))
            rec(f"cuda_pair_ns[{size}]", min(ext.cuda_pair(size, 300) for _ in range(3)))
    rec("torch_mixed_ns[256 slots, <=8MiB]", min(ext.torch_mixed(400000, 256, 8 << 20, 1) for _ in range(3)))
    if conf is None:
        rec("async_mixed_ns[256 slots, <=8MiB]", min(ext.async_mixed(400000, 256, 8 << 20, 1) for _ in range(3)))
    rec("torch_mixed_ns[4096 slots, <=64MiB]", min(ext.torch_mixed(400000, 4096, 64 << 20, 2) for _ in range(3)))
    if conf is None:
        rec("async_mixed_ns[4096 slots, <=64MiB]", min(ext.async_mixed(400000, 4096, 64 << 20, 2) for _ in range(3)))
    for t in [1, 2, 4, 8, 16]:
        rec(f"torch_threads_pairs_per_s[{t}]", ext.torch_threads(t, 65536, 200000))
    torch.cuda.empty_cache()
    rec("torch_empty_cache_ms[100 x 20MiB]", ext.empty_cache_ms(100, 20 << 20))
    rec("torch_empty_cache_ms[1000 x 2MiB]", ext.empty_cache_ms(1000, 2 << 20))
    json.dump(res, open(out, "w"), indent=1)

if __name__ == "__main__":
    if len(sys.argv) not in (2, 4) or (len(sys.argv) == 4 and sys.argv[2] != "--cachealloc"):
        raise SystemExit("usage: latency_bench.py OUT.json [--cachealloc CONF]")
    main(sys.argv[1], sys.argv[3] if len(sys.argv) == 4 else None)
