"""Whether giving a segment back stalls the host while the GPU is busy.

Every memory rule of `default` that releases a free segment and makes
another (the release rules, the oversize rule, PyTorch's max_split_size_mb)
pays a cuMemFree and a cuMemAlloc. This script answers, on the driver
directly (ctypes, no allocator involved), for segments of several sizes:

* how long cuMemAlloc and cuMemFree take with the GPU idle, and with a kernel
  queued that touches none of the memory (does the call wait for it?);
* the same for a segment made of one page of the virtual memory API
  (cuMemAddressReserve + cuMemCreate + cuMemMap + cuMemSetAccess, given back
  with cuMemUnmap + cuMemRelease + cuMemAddressFree), which the driver does
  not order against queued work: the caller must know the work is done.

    python3 python/bench/free_busy.py [--sizes-mb 2,20,200,2000] [--busy-ms 300] [--json OUT]
"""

import argparse
import ctypes as C
import json
import time

import torch

from vmm_busy import U64, check, cu, setup

cu.cuMemAlloc_v2.argtypes = [C.POINTER(U64), C.c_size_t]
cu.cuMemFree_v2.argtypes = [U64]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="2,20,200,2000")
    ap.add_argument("--busy-ms", type=float, default=300.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()

    prop, access, cycles_per_ms = setup()

    def plain_alloc(size):
        p = U64()
        check(cu.cuMemAlloc_v2(C.byref(p), size), "cuMemAlloc")
        return p.value

    def plain_free(p, size):
        check(cu.cuMemFree_v2(p), "cuMemFree")

    def vmm_alloc(size):
        va, h = U64(), U64()
        check(cu.cuMemAddressReserve(C.byref(va), size, 0, 0, 0), "reserve")
        check(cu.cuMemCreate(C.byref(h), size, C.byref(prop), 0), "create")
        check(cu.cuMemMap(va.value, size, 0, h.value, 0), "map")
        check(cu.cuMemSetAccess(va.value, size, C.byref(access), 1), "access")
        return (va.value, h.value)

    def vmm_free(p, size):
        va, h = p
        check(cu.cuMemUnmap(va, size), "unmap")
        check(cu.cuMemRelease(h), "release")
        check(cu.cuMemAddressFree(va, size), "address free")

    def timed(fn, busy_gpu):
        """ms fn took, and whether a kernel queued before it still ran when it returned."""
        torch.cuda.synchronize()
        if busy_gpu:
            torch.cuda._sleep(int(cycles_per_ms * a.busy_ms))
        t0 = time.perf_counter()
        out = fn()
        took = (time.perf_counter() - t0) * 1e3
        running = busy_gpu and not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        return out, took, running

    rows = []
    for mb in [int(x) for x in a.sizes_mb.split(",")]:
        size = mb << 20
        for kind, alloc, free in [("cuMemAlloc/cuMemFree", plain_alloc, plain_free),
                                  ("one VMM page", vmm_alloc, vmm_free)]:
            for busy_gpu in (False, True):
                best = None
                for _ in range(a.rounds):
                    p, t_alloc, r_alloc = timed(lambda: alloc(size), busy_gpu)
                    # Written by the GPU, as a segment's memory is, before it goes back.
                    ptr = p if isinstance(p, int) else p[0]
                    check(cu.cuMemsetD8_v2(ptr, 1, size), "memset")
                    _, t_free, r_free = timed(lambda: free(p, size), busy_gpu)
                    row = dict(size_mb=mb, kind=kind, busy=busy_gpu, alloc_ms=t_alloc,
                               free_ms=t_free, kernel_running_after_alloc=r_alloc,
                               kernel_running_after_free=r_free)
                    if best is None or t_alloc + t_free < best["alloc_ms"] + best["free_ms"]:
                        best = row
                rows.append(best)
                print(f"{mb:>6} MiB  {kind:22} {'busy' if busy_gpu else 'idle':4}  "
                      f"alloc {best['alloc_ms']:8.3f} ms (kernel still running: {best['kernel_running_after_alloc']!s:5})  "
                      f"free {best['free_ms']:8.3f} ms (kernel still running: {best['kernel_running_after_free']!s:5})",
                      flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(busy_ms=a.busy_ms, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
