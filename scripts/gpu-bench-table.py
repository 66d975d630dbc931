#!/usr/bin/env python3
"""Side-by-side table of the GPU latency figures (markdown).

Usage: scripts/gpu-bench-table.py RUST.json [TORCH.json]

RUST.json  from `benches/gpu_latency --json RUST.json` (cachealloc, raw
           cuMemAlloc, cuMemAllocAsync on the default pool)
TORCH.json from `python/bench/latency_bench.py TORCH.json` (PyTorch's caching
           allocator, cudaMalloc, cudaMallocAsync), run in the same device call
"""
import json
import math
import sys

SIZES = [512, 65536, 1 << 20, 16 << 20, 256 << 20]
MIXED = ["256 slots, <=8MiB", "4096 slots, <=64MiB"]
THREADS = [1, 2, 4, 8, 16]
EMPTY = ["100 x 20MiB", "1000 x 2MiB"]


def size_name(b):
    if b >= 1 << 20:
        return f"{b >> 20} MiB"
    if b >= 1 << 10:
        return f"{b >> 10} KiB"
    return f"{b} B"


def fmt(v, digits=0):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:,.{digits}f}"


def ns(v):
    if v is None:
        return "–"
    if v >= 10000:
        return f"{v / 1000:,.1f} µs"
    return f"{v:,.0f} ns"


def main():
    rust = json.load(open(sys.argv[1]))
    torch = json.load(open(sys.argv[2])) if len(sys.argv) > 2 else {}
    g = lambda d, k: d.get(k)
    print(f"Device: {rust.get('device', '?')}; CUDA driver {rust.get('driver_version', '?')}; "
          f"cachealloc config `{rust.get('config', '?')}`\n")
    print("| case | cachealloc | PyTorch caching | cachealloc / PyTorch | goal ≤ 0.25 | "
          "cuMemAllocAsync (pool, thr max) | cudaMallocAsync (from PyTorch run) | cuMemAlloc/cuMemFree |")
    print("|---|---:|---:|---:|:---:|---:|---:|---:|")
    for s in SIZES:
        c, t = g(rust, f"cachealloc_pair_ns[{s}]"), g(torch, f"torch_pair_ns[{s}]")
        ratio = c / t if c and t else None
        print(f"| alloc+free pair, {size_name(s)} | {ns(c)} | {ns(t)} | "
              f"{'–' if ratio is None else f'{ratio:.2f}'} | "
              f"{'–' if ratio is None else ('yes' if ratio <= 0.25 else 'no')} | "
              f"{ns(g(rust, f'async_pair_ns[{s}]'))} | {ns(g(torch, f'async_pair_ns[{s}]'))} | "
              f"{ns(g(rust, f'cuda_pair_ns[{s}]'))} |")
    for m in MIXED:
        c, t = g(rust, f"cachealloc_mixed_ns[{m}]"), g(torch, f"torch_mixed_ns[{m}]")
        ratio = c / t if c and t else None
        print(f"| random ops, {m} (per op) | {ns(c)} | {ns(t)} | "
              f"{'–' if ratio is None else f'{ratio:.2f}'} | "
              f"{'–' if ratio is None else ('yes' if ratio <= 0.25 else 'no')} | "
              f"{ns(g(rust, f'async_mixed_ns[{m}]'))} | {ns(g(torch, f'async_mixed_ns[{m}]'))} | "
              f"{ns(g(rust, f'cuda_mixed_ns[{m}]'))} |")
    c1 = g(rust, "cachealloc_threads_pairs_per_s[1]")
    t1 = g(torch, "torch_threads_pairs_per_s[1]")
    print("\n| threads | cachealloc pairs/s | × 1 thread | PyTorch pairs/s | × 1 thread |")
    print("|---:|---:|---:|---:|---:|")
    for n in THREADS:
        c, t = g(rust, f"cachealloc_threads_pairs_per_s[{n}]"), g(torch, f"torch_threads_pairs_per_s[{n}]")
        print(f"| {n} | {fmt(c)} | {'–' if not (c and c1) else f'{c / c1:.2f}'} | "
              f"{fmt(t)} | {'–' if not (t and t1) else f'{t / t1:.2f}'} |")
    print("\n| empty_cache | cachealloc (ms) | segments | PyTorch (ms) |")
    print("|---|---:|---:|---:|")
    for e in EMPTY:
        segs = g(rust, f"cachealloc_empty_cache_segments[{e}]")
        print(f"| {e} | {fmt(g(rust, f'cachealloc_empty_cache_ms[{e}]'), 2)} | "
              f"{'–' if segs is None else int(segs)} | {fmt(g(torch, f'torch_empty_cache_ms[{e}]'), 2)} |")


if __name__ == "__main__":
    main()
