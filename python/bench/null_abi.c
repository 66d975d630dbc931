/* The floor of the one-process bench (side_by_side.py --floor): the two C ABI
 * functions of libcachealloc.so with no allocator behind them. alloc hands
 * out bump-pointer addresses (512-aligned, never dereferenced) and free does
 * nothing, so timing this library measures the bench's loop, its plan and
 * the indirect call, which every allocator's figure includes.
 *   cc -O2 -shared -fPIC -o null_abi.so python/bench/null_abi.c           */
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

static uintptr_t next_addr = (uintptr_t)1 << 40;

void* cachealloc_alloc(ssize_t size, int device, void* stream) {
  (void)device;
  (void)stream;
  if (size <= 0) return NULL;
  uintptr_t p = next_addr;
  next_addr += ((uintptr_t)size + 511) & ~(uintptr_t)511;
  return (void*)p;
}

void cachealloc_free(void* ptr, ssize_t size, int device, void* stream) {
  (void)ptr;
  (void)size;
  (void)device;
  (void)stream;
}
