"""What the CUDA virtual memory calls cost while the GPU is busy.

The allocator's expandable segments move physical pages with cuMemMap /
cuMemSetAccess / cuMemUnmap while a training step's kernels are queued. This
script answers, on the driver directly (ctypes, no allocator involved):

* the cost of each call per page with the GPU idle, and with the GPU busy
  running a kernel that does not touch the pages (does the call wait for it?);
* whether one cuMemSetAccess over a run of adjacent mappings, and one
  cuMemUnmap over adjacent mappings, replace one call per page;
* whether one physical page can be mapped at two addresses at once (the
  data written through one is read through the other).

    python3 python/bench/vmm_busy.py [--pages 64] [--page-mb 2] [--json OUT]
"""

import argparse
import ctypes as C
import json
import time

import torch

cu = C.CDLL("libcuda.so.1")


class Location(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class AllocFlags(C.Structure):
    _fields_ = [
        ("compressionType", C.c_ubyte),
        ("gpuDirectRDMACapable", C.c_ubyte),
        ("usage", C.c_ushort),
        ("reserved", C.c_ubyte * 4),
    ]


class Prop(C.Structure):
    _fields_ = [
        ("type", C.c_int),
        ("requestedHandleTypes", C.c_int),
        ("location", Location),
        ("win32HandleMetaData", C.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(C.Structure):
    _fields_ = [("location", Location), ("flags", C.c_int)]


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


def call(fn, *args):
    """Calls a driver function; returns (CUresult, microseconds)."""
    t = time.perf_counter()
    rc = fn(*args)
    return rc, (time.perf_counter() - t) * 1e6


U64 = C.c_uint64
cu.cuMemAddressReserve.argtypes = [C.POINTER(U64), C.c_size_t, C.c_size_t, U64, C.c_ulonglong]
cu.cuMemCreate.argtypes = [C.POINTER(U64), C.c_size_t, C.POINTER(Prop), C.c_ulonglong]
cu.cuMemMap.argtypes = [U64, C.c_size_t, C.c_size_t, U64, C.c_ulonglong]
cu.cuMemSetAccess.argtypes = [U64, C.c_size_t, C.POINTER(AccessDesc), C.c_size_t]
cu.cuMemUnmap.argtypes = [U64, C.c_size_t]
cu.cuMemRelease.argtypes = [U64]
cu.cuMemAddressFree.argtypes = [U64, C.c_size_t]
cu.cuMemsetD8_v2.argtypes = [U64, C.c_ubyte, C.c_size_t]
cu.cuMemcpyDtoH_v2.argtypes = [C.c_void_p, U64, C.c_size_t]
cu.cuMemGetAllocationGranularity.argtypes = [C.POINTER(C.c_size_t), C.POINTER(Prop), C.c_int]



def setup():
    """Makes the primary context current; returns the device's page
    properties, read/write access for it, and the cycles per millisecond of
    torch.cuda._sleep (measured, not assumed)."""
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the primary context is current from here on
    dev = torch.cuda.current_device()
    prop = Prop()
    prop.type = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = Location(1, dev)  # CU_MEM_LOCATION_TYPE_DEVICE
    access = AccessDesc(Location(1, dev), 3)  # READWRITE
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(50_000_000)
    torch.cuda.synchronize()
    return prop, access, 50_000_000 / ((time.perf_counter() - t) * 1e3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-mb", type=int, default=2)
    ap.add_argument("--busy-ms", type=float, default=300.0)
    ap.add_argument("--json")
    a = ap.parse_args()

    prop, access, cycles_per_ms = setup()
    gran = C.c_size_t()
    check(cu.cuMemGetAllocationGranularity(C.byref(gran), C.byref(prop), 0), "granularity")
    page = a.page_mb << 20
    assert page % gran.value == 0, f"page must be a multiple of {gran.value}"
    n = a.pages

    handles = []
    for _ in range(n):
        h = U64()
        check(cu.cuMemCreate(C.byref(h), page, C.byref(prop), 0), "cuMemCreate")
        handles.append(h.value)
    span = n * page
    va = [U64(), U64()]
    for v in va:
        check(cu.cuMemAddressReserve(C.byref(v), span, 0, 0, 0), "reserve")
    base, base2 = va[0].value, va[1].value

    def busy():
        """Queues a kernel of --busy-ms that touches none of the pages."""
        torch.cuda._sleep(int(cycles_per_ms * a.busy_ms))

    def rounds(busy_gpu):
        """One round of each way of mapping and unmapping the n pages; µs per page."""
        out = {}
        torch.cuda.synchronize()

        def timed(label, fn):
            torch.cuda.synchronize()
            if busy_gpu:
                busy()
            t0 = time.perf_counter()
            fn()
            out[label] = (time.perf_counter() - t0) * 1e6 / n
            # Whether the kernel queued before the calls outlived them (if
            # not, the calls may have waited for it).
            if busy_gpu:
                out[label + "_waited"] = torch.cuda.current_stream().query()
            torch.cuda.synchronize()

        def map_each_access_each():
            for i, h in enumerate(handles):
                check(cu.cuMemMap(base + i * page, page, 0, h, 0), "map")
                check(cu.cuMemSetAccess(base + i * page, page, C.byref(access), 1), "access")

        def unmap_each():
            for i in range(n):
                check(cu.cuMemUnmap(base + i * page, page), "unmap")

        def map_each():
            for i, h in enumerate(handles):
                check(cu.cuMemMap(base + i * page, page, 0, h, 0), "map")

        def access_once():
            check(cu.cuMemSetAccess(base, span, C.byref(access), 1), "access over the run")

        def unmap_once():
            check(cu.cuMemUnmap(base, span), "unmap over the run")

        timed("map+access, per page", map_each_access_each)
        timed("unmap, per page", unmap_each)
        timed("map only", map_each)
        timed("access, one call for the run", access_once)
        timed("unmap, one call for the run", unmap_once)
        return out

    def pending_after(fn):
        """Queues a busy kernel, runs fn, and returns (ms fn took, whether the
        kernel was still running when fn returned)."""
        torch.cuda.synchronize()
        busy()
        t0 = time.perf_counter()
        fn()
        took = (time.perf_counter() - t0) * 1e3
        still = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        return took, still

    def gpu_stall(moves):
        """GPU time of a queue of matmuls while the host maps and unmaps
        `moves` pages (none of them touched by the matmuls): ms."""
        x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(1500):
            x = x @ x
            x = x * 1e-3
        end.record()
        done = 0
        while done < moves:
            for i, h in enumerate(handles[: min(n, moves - done)]):
                check(cu.cuMemMap(base + i * page, page, 0, h, 0), "map")
                check(cu.cuMemSetAccess(base + i * page, page, C.byref(access), 1), "access")
            for i in range(min(n, moves - done)):
                check(cu.cuMemUnmap(base + i * page, page), "unmap")
            done += min(n, moves - done)
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    gpu_stall(0)
    stall = [(m, round(gpu_stall(m), 1)) for m in (0, 4 * n, 0, 4 * n, 0, 8 * n)]

    def launches_beside(background):
        """Host µs per kernel launch (a small add) over 4,000 launches while
        another thread maps and unmaps pages in a loop (or does nothing)."""
        import threading

        y = torch.zeros(1024, device="cuda")
        stop = threading.Event()
        moved = [0]

        def mover():
            while not stop.is_set():
                for i, h in enumerate(handles):
                    check(cu.cuMemMap(base + i * page, page, 0, h, 0), "map")
                    check(cu.cuMemSetAccess(base + i * page, page, C.byref(access), 1), "access")
                for i in range(n):
                    check(cu.cuMemUnmap(base + i * page, page), "unmap")
                moved[0] += n

        torch.cuda.synchronize()
        t = threading.Thread(target=mover) if background else None
        if t:
            t.start()
            time.sleep(0.01)
        t0 = time.perf_counter()
        for _ in range(4000):
            y.add_(1.0)
        us = (time.perf_counter() - t0) * 1e6 / 4000
        stop.set()
        if t:
            t.join()
        torch.cuda.synchronize()
        return round(us, 2), moved[0]

    launch = [launches_beside(b) for b in (False, True, False, True)]

    idle = [rounds(False) for _ in range(3)]
    busy_r = [rounds(True) for _ in range(3)]

    # Does each call wait for queued work? Time one call against the kernel.
    probes = {}
    h0 = handles[0]
    probes["cuMemMap"] = pending_after(lambda: check(cu.cuMemMap(base, page, 0, h0, 0), "map"))
    probes["cuMemSetAccess"] = pending_after(
        lambda: check(cu.cuMemSetAccess(base, page, C.byref(access), 1), "access")
    )
    probes["cuMemUnmap"] = pending_after(lambda: check(cu.cuMemUnmap(base, page), "unmap"))
    probes["cuMemCreate+Release"] = pending_after(
        lambda: (
            lambda h: (
                check(cu.cuMemCreate(C.byref(h), page, C.byref(prop), 0), "create"),
                check(cu.cuMemRelease(h.value), "release"),
            )
        )(U64())
    )

    # One page at two addresses at once: write through one, read through the other.
    check(cu.cuMemMap(base, page, 0, h0, 0), "map at the first address")
    check(cu.cuMemSetAccess(base, page, C.byref(access), 1), "access")
    rc2 = cu.cuMemMap(base2, page, 0, h0, 0)
    double = {"second_map_rc": rc2}
    if rc2 == 0:
        check(cu.cuMemSetAccess(base2, page, C.byref(access), 1), "access 2")
        check(cu.cuMemsetD8_v2(base, 0x5A, page), "memset")
        buf = (C.c_ubyte * 16)()
        check(cu.cuMemcpyDtoH_v2(buf, base2 + page - 16, 16), "read")
        double["read_through_second"] = all(b == 0x5A for b in buf)
        # Unmapping the first address leaves the second mapping working.
        check(cu.cuMemUnmap(base, page), "unmap first")
        check(cu.cuMemsetD8_v2(base2, 0x33, page), "memset 2")
        check(cu.cuMemcpyDtoH_v2(buf, base2, 16), "read 2")
        double["second_alive_after_first_unmapped"] = all(b == 0x33 for b in buf)
        check(cu.cuMemUnmap(base2, page), "unmap second")
    else:
        cu.cuMemUnmap(base, page)

    for h in handles:
        check(cu.cuMemRelease(h), "release")
    for v in va:
        check(cu.cuMemAddressFree(v.value, span), "free range")

    def med(rs, k):
        xs = sorted(r[k] for r in rs)
        return xs[len(xs) // 2]

    keys = [k for k in idle[0] if not k.endswith("_waited")]
    waited = {k: sum(r[k + "_waited"] for r in busy_r) for k in keys}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {n} pages of {a.page_mb} MiB")
    print(f"{'call':32} {'idle µs/page':>13} {'busy µs/page':>13} {'kernel done after (of 3)':>24}")
    for k in keys:
        print(f"{k:32} {med(idle, k):13.1f} {med(busy_r, k):13.1f} {waited[k]:24}")
    print(f"busy kernel {a.busy_ms} ms; one call each while it runs (ms the call took, kernel still running after):")
    for k, (ms, still) in probes.items():
        print(f"  {k:24} {ms:8.3f} ms  still running: {still}")
    print("one page mapped at two addresses:", double)
    print(f"host µs per kernel launch, alone / beside a thread moving pages (µs, pages moved): {launch}")
    print(f"GPU time of 1500 queued matmul pairs, ms, while the host moves (maps + unmaps) k pages, as (k, ms): {stall}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "pages": n,
                    "page_mb": a.page_mb,
                    "idle": idle,
                    "busy": busy_r,
                    "probes": probes,
                    "double_map": double,
                    "gpu_ms_while_moving": stall,
                    "launch_us_beside_mover": launch,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
