"""GPU test of the PyTorch integration: loads libcachealloc.so into PyTorch,
trains a few steps, empties the cache and reads the stats back, and checks the
hooks (memory fraction, record_stream), the out-of-memory exception, trace
recording and the C ABI's handling of bad input. In child processes on the
C++ allocator: PyTorch's own configuration (PYTORCH_CUDA_ALLOC_CONF /
PYTORCH_ALLOC_CONF, at start-up and through _set_allocator_settings), and the
statistics vector read by name against torch.cuda.memory_stats().

    python3 python/test_gpu.py [--lib PATH] [--steps N]

Exit status 0 when every check passed or when skipped (no torch, no CUDA
device, no library: the reason is printed), 1 when a check failed.
"""

import argparse
import ctypes
import gc
import gzip
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_check import FAILED, check, skip  # noqa: E402


# A child process on the C++ allocator: prints one line `RESULT <json>`.
CHILD_PRELUDE = """
import json, sys, warnings
sys.path.insert(0, sys.argv[1])
import torch
import cachealloc_torch as ca
so = sys.argv[2]
out = {}
"""


def child(code, env, timeout=900):
    """Runs `code` after CHILD_PRELUDE with `env` added to the environment;
    returns (the RESULT dict or None, the output's tail)."""
    import json
    e = dict(os.environ)
    for k in ("CACHEALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        e.pop(k, None)
    e.update(env)
    r = subprocess.run([sys.executable, "-c", CHILD_PRELUDE + code, HERE, SO],
                       capture_output=True, text=True, timeout=timeout, env=e)
    text = r.stdout + r.stderr
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]), text.strip()[-600:]
    return None, text.strip()[-600:]


def pytorch_conf_checks():
    """PyTorch's allocator configuration on the C++ allocator (docs/PYTORCH.md)."""
    # Start-up: every key with a meaning here, plus keys of no effect here.
    res, tail = child("""
ca.enable(so, mode="cpp")
x = torch.empty(100 << 20, dtype=torch.uint8, device="cuda")
y = torch.empty(1000, device="cuda")
st = torch.cuda.memory_stats()
core = ca._core_stats()
out["max_split"] = st["max_split_size"]
out["config"] = ca.info()["config"]
out["mismatch"] = [(k, v, st.get(k)) for k, v in core.items() if st.get(k) != v]
out["pinned"] = bool(torch.empty(16, pin_memory=True).is_pinned())
total = torch.cuda.mem_get_info()[1]
torch.cuda.memory._set_allocator_settings(
    "garbage_collection_threshold:0.5,per_process_memory_fraction:0.5")
out["after"] = ca.info()["config"]
out["cap"], out["half"] = ca.info()["memory_cap"], int(0.5 * total)
# torch 2.11's own name for it (what _set_allocator_settings forwards to).
setter = getattr(torch._C, "_accelerator_setAllocatorSettings",
                 torch.cuda.memory._set_allocator_settings)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    setter("max_split_size_mb:128")
out["warned"] = [str(m.message) for m in w]
out["max_split_after"] = torch.cuda.memory_stats()["max_split_size"]
print("RESULT " + json.dumps(out))
""", {"CACHEALLOC_CONF": "default",
      "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64,garbage_collection_threshold:0.8,"
      "roundup_power2_divisions:[256:1,>:4],backend:native,pinned_use_cuda_host_register:True,"
      "release_lock_on_cudamalloc:True"})
    if check("C++ allocator with PYTORCH_CUDA_ALLOC_CONF ran", res is not None, tail):
        conf = res["config"]
        check("PyTorch's keys in force", res["max_split"] == 64 << 20
              and "max_split_size_mb:64" in conf and "garbage_collection_threshold:0.8" in conf
              and "256:1" in conf and "512:4" in conf, conf)
        check("core statistics read by name equal torch.cuda.memory_stats()",
              res["mismatch"] == [], str(res["mismatch"][:5]))
        check("pinned memory with PyTorch's pinned keys", res["pinned"])
        check("_set_allocator_settings: threshold and fraction applied at run time",
              "garbage_collection_threshold:0.5" in res["after"]
              and abs(res["cap"] - res["half"]) <= 1 << 20,
              f"{res['after'][:120]}; cap {res['cap']} vs {res['half']}")
        check("_set_allocator_settings: a fixed setting warns and stays",
              res["max_split_after"] == 64 << 20
              and any("max_split_size_mb stays 64 MiB" in m for m in res["warned"]),
              str(res["warned"]))

    # CACHEALLOC_CONF's own keys win; PyTorch's others still apply.
    res, tail = child("""
ca.enable(so, mode="cpp")
x = torch.empty(1 << 20, device="cuda")
out["max_split"] = torch.cuda.memory_stats()["max_split_size"]
out["config"] = ca.info()["config"]
print("RESULT " + json.dumps(out))
""", {"CACHEALLOC_CONF": "default,max_split_size_mb:128",
      "PYTORCH_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:False"})
    check("CACHEALLOC_CONF wins for its own keys", res is not None
          and res["max_split"] == 128 << 20 and "expandable_segments:False" in res["config"],
          str(res) if res else tail)

    # An invalid value is refused in PyTorch's words.
    res, tail = child("""
ca.enable(so, mode="cpp")
try:
    torch.empty(1 << 20, device="cuda")
    out["error"] = None
except Exception as e:
    out["error"] = str(e)
print("RESULT " + json.dumps(out))
""", {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:1.5"})
    check("an invalid PyTorch setting is refused with PyTorch's message", res is not None
          and res["error"] is not None
          and "garbage_collect_threshold is invalid, set it in (0.0, 1.0)" in res["error"],
          str(res) if res else tail)

    # backend:cudaMallocAsync: cachealloc stays out, saying so in one line.
    res, tail = child("""
out["enable"] = ca.enable(so)
out["enabled"] = ca.is_enabled()
out["backend"] = torch.cuda.get_allocator_backend()
out["works"] = torch.ones(1 << 20, device="cuda").sum().item() == 1 << 20
print("RESULT " + json.dumps(out))
""", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    said = [ln for ln in tail.splitlines() if "backend:cudaMallocAsync" in ln]
    check("backend:cudaMallocAsync: cachealloc is not installed", res is not None
          and res["enable"] is None and not res["enabled"]
          and res["backend"] == "cudaMallocAsync" and res["works"] and len(said) == 1,
          str(res) if res else tail)


SO = None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib")
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        skip(f"PyTorch is not installed ({e})")
    import cachealloc_torch as ca
    try:
        so = ca.library_path(a.lib)
    except FileNotFoundError as e:
        skip(str(e))
    if not torch.cuda.is_available():
        skip("no CUDA device visible to PyTorch")

    # enable() after CUDA was initialised must fail with a clear error (in a child process).
    refused = subprocess.run(
        [sys.executable, "-c",
         "import sys, torch; sys.path.insert(0, sys.argv[1]); import cachealloc_torch as ca\n"
         "torch.cuda.init()\n"
         "try:\n ca.enable(sys.argv[2], mode='pluggable'); print('ENABLED')\n"
         "except ca.CacheallocError as e: print('REFUSED', e)\n", HERE, so],
        capture_output=True, text=True, timeout=120)
    check("enable() after CUDA init is refused with a clear error",
          "REFUSED" in refused.stdout and "before CUDA is first used" in refused.stdout,
          (refused.stdout + refused.stderr).strip()[-300:])

    global SO
    SO = so
    pytorch_conf_checks()

    # The plain C ABI through CUDAPluggableAllocator (python/parity.py covers the C++ interface).
    ca.enable(so, mode="pluggable")
    print(f"loaded {so}; CACHEALLOC_CONF={os.environ.get('CACHEALLOC_CONF', '(unset)')}", flush=True)
    check("enable() installed the OOM handler", ca._oom_exceptions)
    torch.cuda.init()
    dev = torch.cuda.current_device()
    inf = ca.info()
    print(f"device {dev}: {inf['device_name']}; config {inf['config'][:60]}...; notices {inf['notices']}")
    errors0 = ca.error_count()

    # A few real training steps (the nmt workload: transformer, AdamW, bf16 autocast).
    import workloads
    torch.manual_seed(0)
    t0 = time.perf_counter()
    steps = 0
    gen = workloads.nmt(a.steps, 0)
    for _ in gen:
        torch.cuda.synchronize()
        steps += 1
        if steps == 1:
            st = ca.memory_stats()
            check("stats during training", st["allocation.all.current"] > 0
                  and st["reserved_bytes.all.current"] >= st["allocated_bytes.all.current"] > 0,
                  f"{st['allocation.all.current']} allocations, "
                  f"{st['allocated_bytes.all.current']} B allocated, "
                  f"{st['reserved_bytes.all.current']} B reserved")
            # Record one step of the trace.
            tmp = tempfile.mkdtemp()
            trace = os.path.join(tmp, "step.trace.gz")
            ca.record_trace(trace)
        if steps == 2:
            n = ca.stop_trace()
            with gzip.open(trace, "rt") as f:
                lines = [ln for ln in f if not ln.startswith("#")]
            check("record_trace/stop_trace wrote a trace", n > 100 and len(lines) == n,
                  f"{n} events, {len(lines)} lines")
    gen.close()
    check(f"trained {a.steps} steps", steps == a.steps, f"{time.perf_counter() - t0:.1f} s")
    del gen
    gc.collect()
    torch.cuda.synchronize()

    st = ca.memory_stats()
    check("stats after training", st["allocated_bytes.all.peak"] > 1 << 30
          and st["reserved_bytes.all.peak"] >= st["allocated_bytes.all.peak"]
          and st["num_ooms"] == 0,
          f"peak allocated {st['allocated_bytes.all.peak']}, peak reserved "
          f"{st['reserved_bytes.all.peak']}, now allocated {st['allocated_bytes.all.current']}")
    summary = ca.memory_summary()
    check("memory_summary", "GPU reserved memory" in summary and len(summary.splitlines()) > 30)
    print(summary)
    frag = ca.fragmentation()
    check("fragmentation report", "largest free block" in frag)
    print(frag)
    snap = ca.snapshot()
    check("snapshot", len(snap["segments"]) == st["segment.all.current"],
          f"{len(snap['segments'])} segments")

    # empty_cache: reserved memory goes back to the driver.
    reserved = st["reserved_bytes.all.current"]
    free_before = torch.cuda.mem_get_info()[0]
    torch.cuda.empty_cache()
    free_after = torch.cuda.mem_get_info()[0]
    st2 = ca.memory_stats()
    released = reserved - st2["reserved_bytes.all.current"]
    left = ca.fragmentation_stats()
    check("torch.cuda.empty_cache() releases every entirely free segment",
          released > 0 and left["releasable"] == 0,
          f"reserved {reserved} -> {st2['reserved_bytes.all.current']} B "
          f"({st2['allocated_bytes.all.current']} B still allocated, kept in "
          f"{st2['segment.all.current']} partly used segments)")
    check("driver free memory went up by what was released",
          abs((free_after - free_before) - released) <= 64 << 20,
          f"driver free +{free_after - free_before} B, released {released} B")

    # record_stream: a tensor used on a side stream, freed on the default stream.
    s = torch.cuda.Stream()
    x = torch.ones(1 << 24, device="cuda")
    with torch.cuda.stream(s):
        y = x * 2
    x.record_stream(s)
    del x
    z = torch.empty(1 << 24, device="cuda")  # must not reuse x's block while s may still run
    s.synchronize()
    check("record_stream hook", ca.error_count() == errors0 and y.sum().item() == 2 * (1 << 24),
          f"errors {ca.error_count() - errors0}")
    del y, z

    # Memory fraction hook and the out-of-memory exception.
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction((1 << 30) / total)
    try:
        big = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        big.fill_(1)
        torch.cuda.synchronize()
        check("allocation above the memory fraction raises", False, "no exception")
    except RuntimeError as e:
        check("allocation above the memory fraction raises", "out of memory" in str(e),
              str(e).splitlines()[0][:200])
    torch.cuda.set_per_process_memory_fraction(1.0)
    ok = torch.ones(1 << 20, device="cuda").sum().item() == 1 << 20
    check("allocator works after the OOM", ok)
    check("the OOM is counted", ca.memory_stats()["num_ooms"] >= 1)

    # The C ABI on bad input, directly through ctypes.
    lib = ca._lib
    # No OOM handler while calling the library from ctypes: a C++ exception
    # must not unwind into the Python interpreter's C frames.
    lib.cachealloc_set_oom_handler(None)
    c0 = ca.error_count()
    check("size 0 -> NULL, no error", lib.cachealloc_alloc(0, dev, None) is None and ca.error_count() == c0)
    check("negative size -> NULL + error", lib.cachealloc_alloc(-1, dev, None) is None
          and ca.error_count() == c0 + 1 and "negative" in (ca.last_error() or ""))
    check("unknown device -> NULL + error", lib.cachealloc_alloc(512, 63, None) is None
          and "device 63" in (ca.last_error() or ""))
    lib.cachealloc_free(0xdead0000, 512, dev, None)
    check("foreign free ignored with an error", "not allocated by cachealloc" in (ca.last_error() or ""))
    p = lib.cachealloc_alloc(4096, dev, None)
    lib.cachealloc_free(p, 4096, dev, None)
    lib.cachealloc_free(p, 4096, dev, None)
    check("double free ignored with an error", "double free" in (ca.last_error() or ""))
    p = lib.cachealloc_alloc(4096, dev, None)
    lib.cachealloc_free(p, 512, dev, None)
    check("free with a size other than the requested one: an error, the block freed",
          "freed all the same" in (ca.last_error() or ""))
    lib.cachealloc_free(None, 0, dev, None)
    lib.cachealloc_record_stream(0xbad0000, None)
    check("record_stream of a foreign pointer ignored with an error",
          "not allocated" in (ca.last_error() or ""))
    check("empty_cache(device) returns bytes", ca.empty_cache(dev) >= 0)
    ca._install_oom_handler(torch, lib)

    print(f"\n{'FAILED: ' + ', '.join(FAILED) if FAILED else 'all checks passed'}", flush=True)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
