"""What giving 1 GiB of VMM pages back to the driver costs, by page size and by how.

empty_cache() on expandable segments unmaps every idle page and releases its
physical allocation: its time per GiB is the cost of those calls. This script
measures them on the driver directly (ctypes, no allocator involved), the
pages written by the GPU first, the GPU idle:

* per page size (2, 8, 20, 32 MiB): cuMemUnmap a call per page, one call per
  run of pages, and cuMemRelease a call per page, from one thread;
* cuMemRelease and cuMemUnmap spread over 2, 4 and 8 host threads (does the
  driver take them in parallel?);
* whether an 8 MiB piece of a 32 MiB physical allocation can be mapped on
  its own (pages sharing one allocation, released with one call).

    python3 python/bench/vmm_release.py [--gib 1] [--rounds 3] [--json OUT]
"""

import argparse
import ctypes as C
import json
import statistics
import threading
import time

from vmm_busy import U64, check, cu, setup

cu.cuCtxGetCurrent.argtypes = [C.POINTER(C.c_void_p)]
cu.cuCtxSetCurrent.argtypes = [C.c_void_p]


def timed(fn):
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def in_threads(n, items, fn, ctx):
    """Runs fn(item) for every item, the items split over n threads -> ms."""
    parts = [items[i::n] for i in range(n)]

    def work(part):
        check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        for x in part:
            fn(x)
    ts = [threading.Thread(target=work, args=(p,)) for p in parts]
    t = time.perf_counter()
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    return (time.perf_counter() - t) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    prop, access, _ = setup()
    ctx = C.c_void_p()
    check(cu.cuCtxGetCurrent(C.byref(ctx)), "cuCtxGetCurrent")
    total = int(a.gib * (1 << 30))

    def make(page, piece=None):
        """total bytes of pages of `page` bytes, mapped side by side (each in mappings of
        `piece` bytes), written -> (va, handles, mappings)."""
        piece = piece or page
        n = total // page
        va = U64()
        check(cu.cuMemAddressReserve(C.byref(va), n * page, 0, 0, 0), "reserve")
        handles, maps = [], []
        for i in range(n):
            h = U64()
            check(cu.cuMemCreate(C.byref(h), page, C.byref(prop), 0), "cuMemCreate")
            handles.append(h.value)
            for off in range(0, page, piece):
                at = va.value + i * page + off
                check(cu.cuMemMap(at, piece, off, h.value, 0), "cuMemMap")
                maps.append((at, piece))
        check(cu.cuMemSetAccess(va.value, n * page, C.byref(access), 1), "cuMemSetAccess")
        check(cu.cuMemsetD8_v2(va.value, 1, n * page), "cuMemsetD8")
        check(cu.cuCtxSynchronize(), "sync")
        return va.value, n * page, handles, maps

    def unmap_each(maps):
        for at, size in maps:
            check(cu.cuMemUnmap(at, size), "cuMemUnmap")

    def release_each(handles):
        for h in handles:
            check(cu.cuMemRelease(h), "cuMemRelease")

    rows = []

    def record(name, page_mb, ms_list, n_pages):
        med = statistics.median(ms_list)
        rows.append(dict(case=name, page_mb=page_mb, pages=n_pages, ms=ms_list,
                         ms_per_gib=med / a.gib, us_per_page=med * 1e3 / n_pages))
        print(f"{name:44s} {page_mb:>4} MiB  {n_pages:5d} pages  {med / a.gib:7.2f} ms/GiB  "
              f"{med * 1e3 / n_pages:7.1f} us/page", flush=True)

    for page_mb in (2, 8, 20, 32):
        page = page_mb << 20
        cases = {"unmap a call per page": [], "unmap one call over the run": [],
                 "release a call per page": [], "unmap (one call) + release": []}
        thr = {n: [] for n in (2, 4, 8)}
        thr_unmap = {n: [] for n in (4,)}
        n = 0
        for _ in range(a.rounds):
            va, span, hs, maps = make(page)
            n = len(hs)
            cases["unmap a call per page"].append(timed(lambda: unmap_each(maps)))
            cases["release a call per page"].append(timed(lambda: release_each(hs)))
            va2, span2, hs2, _ = make(page)
            cases["unmap one call over the run"].append(
                timed(lambda: check(cu.cuMemUnmap(va2, span2), "unmap run")))
            release_each(hs2)
            va3, span3, hs3, _ = make(page)
            cases["unmap (one call) + release"].append(
                timed(lambda: (check(cu.cuMemUnmap(va3, span3), "unmap run"), release_each(hs3))))
            for k in thr:
                va4, span4, hs4, _ = make(page)
                check(cu.cuMemUnmap(va4, span4), "unmap run")
                thr[k].append(in_threads(k, hs4, lambda h: check(cu.cuMemRelease(h), "rel"), ctx))
                check(cu.cuMemAddressFree(va4, span4), "free")
            for k in thr_unmap:
                va5, span5, hs5, maps5 = make(page)
                thr_unmap[k].append(in_threads(k, maps5, lambda m: check(cu.cuMemUnmap(*m), "unmap"),
                                               ctx))
                release_each(hs5)
                check(cu.cuMemAddressFree(va5, span5), "free")
            for v, s in ((va, span), (va2, span2), (va3, span3)):
                check(cu.cuMemAddressFree(v, s), "free")
        for name, ms in cases.items():
            record(name, page_mb, ms, n)
        for k, ms in thr.items():
            record(f"release in {k} threads", page_mb, ms, n)
        for k, ms in thr_unmap.items():
            record(f"unmap a call per page in {k} threads", page_mb, ms, n)

    # One 32 MiB allocation mapped as four 8 MiB pieces (one release for four pages)?
    # The driver takes no offset into an allocation today (CUDA_ERROR_NOT_SUPPORTED).
    va, h = U64(), U64()
    check(cu.cuMemAddressReserve(C.byref(va), 32 << 20, 0, 0, 0), "reserve")
    check(cu.cuMemCreate(C.byref(h), 32 << 20, C.byref(prop), 0), "cuMemCreate")
    rc = cu.cuMemMap(va.value + (8 << 20), 8 << 20, 8 << 20, h.value, 0)
    pieces = "supported" if rc == 0 else f"refused (CUresult {rc})"
    if rc == 0:
        check(cu.cuMemUnmap(va.value + (8 << 20), 8 << 20), "unmap")
    check(cu.cuMemRelease(h.value), "release")
    check(cu.cuMemAddressFree(va.value, 32 << 20), "free")
    print(f"mapping an 8 MiB piece at an offset into a 32 MiB allocation: {pieces}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gib=a.gib, rounds=a.rounds, rows=rows, pieces=pieces), f, indent=1)


if __name__ == "__main__":
    main()
