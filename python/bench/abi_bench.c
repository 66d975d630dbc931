/* cachealloc's C ABI timed from plain C, with no PyTorch in the process:
 * dlopen libcachealloc.so and time alloc+free pairs and the random-ops mix
 * (the latency bench's cases) through cachealloc_alloc / cachealloc_free,
 * the functions PyTorch's CUDAPluggableAllocator calls.
 *   cc -O2 -o abi_bench python/bench/abi_bench.c -ldl -lm
 *   ./abi_bench gpu-bundle/lib/libcachealloc.so                        */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>
#include <time.h>

typedef void* (*alloc_t)(ssize_t, int, void*);
typedef void (*free_t)(void*, ssize_t, int, void*);
static alloc_t ca_alloc;
static free_t ca_free;

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}

static double pair(long size, long iters) {
  for (int i = 0; i < 1000; i++) ca_free(ca_alloc(size, 0, NULL), size, 0, NULL);
  double t0 = now_ns();
  for (long i = 0; i < iters; i++) ca_free(ca_alloc(size, 0, NULL), size, 0, NULL);
  return (now_ns() - t0) / iters;
}

static uint64_t x = 88172645463325252ull;
static uint64_t next(void) { x ^= x << 13; x ^= x >> 7; x ^= x << 17; return x; }

static double mixed(long iters, int slots, long max_bytes) {
  void** live = calloc(slots, sizeof(void*));
  long* held = calloc(slots, sizeof(long));
  long* sizes = malloc(iters * sizeof(long));
  int* pick = malloc(iters * sizeof(int));
  double lo = log(512.0), hi = log((double)max_bytes);
  for (long i = 0; i < iters; i++) {
    sizes[i] = (long)exp(lo + (next() >> 11) * (1.0 / 9007199254740992.0) * (hi - lo));
    pick[i] = next() % slots;
  }
  double r = 0;
  for (int pass = 0; pass < 2; pass++) {
    double t0 = now_ns();
    for (long i = 0; i < iters; i++) {
      int s = pick[i];
      if (live[s]) { ca_free(live[s], held[s], 0, NULL); live[s] = NULL; }
      else { live[s] = ca_alloc(sizes[i], 0, NULL); held[s] = sizes[i]; }
    }
    r = (now_ns() - t0) / iters;
  }
  for (int s = 0; s < slots; s++) if (live[s]) ca_free(live[s], held[s], 0, NULL);
  free(live); free(held); free(sizes); free(pick);
  return r;
}

static double best3(double a, double b, double c) { double m = a < b ? a : b; return m < c ? m : c; }

int main(int argc, char** argv) {
  const char* lib = argc > 1 ? argv[1] : "gpu-bundle/lib/libcachealloc.so";
  void* h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (!h) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 2; }
  ca_alloc = (alloc_t)dlsym(h, "cachealloc_alloc");
  ca_free = (free_t)dlsym(h, "cachealloc_free");
  if (!ca_alloc || !ca_free) { fprintf(stderr, "missing symbols\n"); return 2; }
  long sizes[] = {512, 65536, 1 << 20, 16 << 20, 256 << 20};
  for (int i = 0; i < 5; i++)
    printf("abi_pair_ns[%ld] %.1f\n", sizes[i],
           best3(pair(sizes[i], 200000), pair(sizes[i], 200000), pair(sizes[i], 200000)));
  printf("abi_mixed_ns[256 slots] %.1f\n", best3(mixed(400000, 256, 8 << 20), mixed(400000, 256, 8 << 20), mixed(400000, 256, 8 << 20)));
  printf("abi_mixed_ns[4096 slots] %.1f\n", best3(mixed(400000, 4096, 64 << 20), mixed(400000, 4096, 64 << 20), mixed(400000, 4096, 64 << 20)));
  return 0;
}
