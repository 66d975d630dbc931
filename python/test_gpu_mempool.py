"""GPU checks of torch.cuda.MemPool's options on cachealloc's C++ allocator,
after PyTorch's TestMemPool tests (test/test_cuda.py): a pool whose memory
comes from a CUDAPluggableAllocator (MemPool(allocator=...)) compiled here
with torch.utils.cpp_extension.load_inline as PyTorch's tests compile
theirs; use_on_oom under a memory fraction; a pool deleted while its
tensors live; empty_cache and pools; expandable segments with such a pool;
no_split.

    python3 python/test_gpu_mempool.py [--lib PATH] [--native] [--build-only]

Each check runs in a child process that enables cachealloc (mode="cpp")
before CUDA is used; `--native` runs the same checks on PyTorch's own
allocator instead (every check holds there too: it is what they mirror).
`--build-only` compiles the allocator library and exits (no GPU needed).
Exit status 0 when every check passed or when skipped (no torch, no CUDA
device, no library, no compiler: the reason is printed), 1 when a check
failed.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_check import FAILED, check, skip  # noqa: E402

# The MemPool allocator: PyTorch's test allocator (the flags 123 and 321),
# plus counters and the list of live segments, so that a check can tell
# that a tensor's memory came from here. It returns NULL when cudaMalloc
# fails instead of throwing.
ALLOCATOR_SOURCE = r"""
#include <cuda_runtime_api.h>
#include <cstddef>
#include <cstdint>

extern "C" {
C10_EXPORT int called_dummy_alloc = 0;
C10_EXPORT int called_dummy_free = 0;
C10_EXPORT long long n_alloc = 0;
C10_EXPORT long long n_free = 0;
C10_EXPORT long long live_bytes = 0;
C10_EXPORT long long last_stream = 0;
C10_EXPORT int last_device = -1;

static const int kSlots = 4096;
static uintptr_t slot_ptr[kSlots];
static size_t slot_size[kSlots];

C10_EXPORT void* dummy_alloc(size_t size, int device, void* stream) {
  called_dummy_alloc = 123;
  void* ptr = nullptr;
  if (cudaMalloc(&ptr, size) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  n_alloc++;
  live_bytes += (long long)size;
  last_stream = (long long)(uintptr_t)stream;
  last_device = device;
  for (int i = 0; i < kSlots; ++i) {
    if (slot_ptr[i] == 0) {
      slot_ptr[i] = (uintptr_t)ptr;
      slot_size[i] = size;
      break;
    }
  }
  return ptr;
}

C10_EXPORT void dummy_free(void* ptr, size_t size, int device, void* stream) {
  called_dummy_free = 321;
  cudaFree(ptr);
  n_free++;
  live_bytes -= (long long)size;
  for (int i = 0; i < kSlots; ++i) {
    if (slot_ptr[i] == (uintptr_t)ptr) {
      slot_ptr[i] = 0;
      break;
    }
  }
}

// 1 when [p, p + n) lies inside a live segment of this allocator.
C10_EXPORT int dummy_owns(uintptr_t p, size_t n) {
  for (int i = 0; i < kSlots; ++i) {
    if (slot_ptr[i] != 0 && slot_ptr[i] <= p && p + n <= slot_ptr[i] + slot_size[i]) {
      return 1;
    }
  }
  return 0;
}
}
"""

ALLOCATOR_NAME = "cachealloc_test_mempool_allocator"


def build_allocator():
    """Compiles ALLOCATOR_SOURCE (cached by torch in its extensions folder);
    returns the library's path."""
    import torch
    from torch.utils.cpp_extension import load_inline
    if "TORCH_CUDA_ARCH_LIST" not in os.environ and not torch.cuda.is_available():
        # C++ only, no kernels: any architecture will do where none can be read.
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    return load_inline(name=ALLOCATOR_NAME, cpp_sources=ALLOCATOR_SOURCE,
                       is_python_module=False, with_cuda=True, verbose=False)


# A child: cachealloc enabled (unless native), the allocator loaded; the
# body fills `out` and the prelude's tail prints one line `RESULT <json>`.
CHILD_PRELUDE = """
import ctypes, gc, json, sys, threading, warnings
sys.path.insert(0, sys.argv[1])
import torch
so, alloc_so, native = sys.argv[2], sys.argv[3], sys.argv[4] == "1"
if not native:
    import cachealloc_torch as ca
    ca.enable(so, mode="cpp")
lib = ctypes.CDLL(alloc_so)
lib.dummy_owns.restype = ctypes.c_int
lib.dummy_owns.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
flag = lambda name: ctypes.c_int.in_dll(lib, name).value
count = lambda name: ctypes.c_longlong.in_dll(lib, name).value
def owns(t):
    return bool(lib.dummy_owns(t.data_ptr(), t.numel() * t.element_size()))
def new_allocator():
    return torch.cuda.memory.CUDAPluggableAllocator(alloc_so, "dummy_alloc", "dummy_free")
MB = 1 << 20
NELEM_1MB = MB // 4
def limit_memory(extra_mb):
    # PyTorch's _setup_mempool_limited_memory_test: what is reserved now
    # plus extra_mb (and a page, for the fraction's rounding).
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info()
    allowed = extra_mb * MB + torch.cuda.memory_reserved() + 4096
    torch.cuda.set_per_process_memory_fraction(allowed / total)
out = {}
"""

CHILD_EPILOGUE = """
print("RESULT " + json.dumps(out))
"""

# Each check: (name, body, environment). A body sets out[...] entries; the
# parent turns `out["checks"]` (a list of [label, passed, detail]) into
# ok/FAIL lines.
CHECKS = []


def mirror(name, env=None):
    def add(body):
        CHECKS.append((name, body, env or {}))
        return body
    return add


# test_mempool_with_allocator
mirror("with_allocator")("""
res = out["checks"] = []
plain = torch.cuda.MemPool()
pool = torch.cuda.MemPool(new_allocator().allocator())
res.append(["a new pool has use count 1", pool.use_count() == 1, str(pool.use_count())])
res.append(["nothing allocated yet", flag("called_dummy_alloc") == 0 and flag("called_dummy_free") == 0, ""])
stream = torch.cuda.Stream()
with torch.cuda.use_mem_pool(pool):
    out_0 = torch.randn(NELEM_1MB, device="cuda")
    in_ctx = pool.use_count()
res.append(["use_mem_pool holds a reference", in_ctx == 2 and pool.use_count() == 1,
            f"{in_ctx}, {pool.use_count()}"])
res.append(["the pool's allocation came from the allocator's alloc function",
            flag("called_dummy_alloc") == 123 and owns(out_0), ""])
res.append(["the allocator got the device and the current stream",
            count("last_stream") == torch.cuda.current_stream().cuda_stream
            and ctypes.c_int.in_dll(lib, "last_device").value == torch.cuda.current_device(),
            f"{count('last_stream'):#x}"])
out_non_pool = torch.empty(NELEM_1MB, device="cuda")
res.append(["an allocation outside the pool does not use it", not owns(out_non_pool), ""])
with torch.cuda.use_mem_pool(pool):
    n0 = len(pool.snapshot())
    out_1 = torch.randn(NELEM_1MB, device="cuda")
    n1 = len(pool.snapshot())
    r1 = torch.cuda.memory_reserved()
    out_2 = torch.randn(NELEM_1MB, device="cuda")
    r2 = torch.cuda.memory_reserved()
    n2 = len(pool.snapshot())
res.append(["1 MiB blocks packed in 2 MiB segments (1, 1, 2 segments)", (n0, n1, n2) == (1, 1, 2),
            str((n0, n1, n2))])
res.append(["memory_reserved() counts the pool's new segment", r2 - r1 == 2 * MB, f"+{r2 - r1}"])
segs = pool.snapshot()
res.append(["the pool's snapshot: its segments are the allocator's, owned by the pool",
            len(segs) == 2 and all(lib.dummy_owns(s["address"], s["total_size"]) for s in segs)
            and all(tuple(s.get("segment_pool_id", pool.id)) == tuple(pool.id) for s in segs)
            and count("n_alloc") == 2, json.dumps([(hex(s["address"]), s["total_size"]) for s in segs])])
with torch.cuda.stream(stream):
    with torch.cuda.use_mem_pool(pool):
        side = torch.empty(3 * MB, dtype=torch.uint8, device="cuda")
res.append(["a side stream's segment: asked for that stream",
            owns(side) and count("last_stream") == stream.cuda_stream, f"{count('last_stream'):#x}"])
del side
torch.cuda.synchronize()
torch.cuda.empty_cache()
res.append(["empty_cache leaves a pool in use alone", flag("called_dummy_free") == 0, ""])
del out_0, out_1, out_2
del pool
gc.collect()
res.append(["deleting the pool gives its segments back through the free function",
            flag("called_dummy_free") == 321 and count("live_bytes") == 0 and count("n_free") == count("n_alloc"),
            f"live {count('live_bytes')}, {count('n_alloc')} allocs, {count('n_free')} frees"])
""")

# test_mempool_empty_cache_inactive
mirror("empty_cache_inactive")("""
res = out["checks"] = []
torch.cuda.empty_cache()
allocator = new_allocator()
def f():
    pool = torch.cuda.MemPool(allocator.allocator())
    with torch.cuda.use_mem_pool(pool):
        x = torch.arange(1024 * 1024 * 2, device="cuda")
    return x  # the pool goes at return; x, allocated from it, lives on
x = f()
gc.collect()
res.append(["the pool gone, its live tensor keeps the memory", flag("called_dummy_free") == 0 and owns(x)
            and x[-1].item() == 1024 * 1024 * 2 - 1, ""])
del x
torch.cuda.empty_cache()
res.append(["freed and emptied: back through the free function", flag("called_dummy_free") == 321
            and count("live_bytes") == 0, f"live {count('live_bytes')}"])
""")

# test_tensor_delete_after_allocator_delete
mirror("tensor_delete_after_allocator_delete")("""
res = out["checks"] = []
allocator = new_allocator()
pool = torch.cuda.MemPool(allocator.allocator())
with torch.cuda.use_mem_pool(pool):
    a = torch.ones(8 * MB, dtype=torch.uint8, device="cuda")
del pool
del allocator
gc.collect()
b = torch.empty(8 * MB, dtype=torch.uint8, device="cuda")  # other work meanwhile
res.append(["pool and allocator objects gone, the tensor lives", flag("called_dummy_free") == 0
            and owns(a) and int(a.sum().item()) == 8 * MB, ""])
del a
torch.cuda.empty_cache()
res.append(["the tensor freed last: its segment goes back through the free function",
            flag("called_dummy_free") == 321 and count("live_bytes") == 0, f"live {count('live_bytes')}"])
""")


LIMITED = """
res = out["checks"] = []
make = (lambda **kw: torch.cuda.MemPool(new_allocator().allocator(), **kw)) if WITH_ALLOCATOR \\
    else (lambda **kw: torch.cuda.MemPool(**kw))
pool_do_not_use = make()
pool_use = make(use_on_oom=True)
limit_memory(80)
with torch.cuda.use_mem_pool(pool_do_not_use):
    a = torch.randn(40 * NELEM_1MB, device="cuda")
with torch.cuda.use_mem_pool(pool_use):
    b = torch.randn(40 * NELEM_1MB, device="cuda")
a_ptr, b_ptr = a.data_ptr(), b.data_ptr()
def ooms(f):
    try:
        f()
        return False
    except torch.OutOfMemoryError:
        return True
res.append(["two pools of 40 MiB fill an 80 MiB fraction: the device is out of memory",
            ooms(lambda: torch.randn(40 * NELEM_1MB, device="cuda")), ""])
del a, b
c = None
try:
    c = torch.randn(30 * NELEM_1MB, device="cuda")
except torch.OutOfMemoryError as e:
    res.append(["the use_on_oom pool serves a request that ran out", False, str(e)[:300]])
if c is not None:
    c_ptr = c.data_ptr()
    res.append(["the use_on_oom pool serves a request that ran out, from its cached block",
                c_ptr == b_ptr, f"{c_ptr:#x} vs {b_ptr:#x}"])
    res.append(["the other pool serves nothing",
                ooms(lambda: torch.randn(30 * NELEM_1MB, device="cuda")), ""])
    del c
    with torch.cuda.use_mem_pool(pool_use):
        e = torch.randn(20 * NELEM_1MB, device="cuda")
    res.append(["the lending pool serves its own allocations again", e.data_ptr() == b_ptr,
                f"{e.data_ptr():#x}"])
    del e
del pool_use, pool_do_not_use
gc.collect()
torch.cuda.empty_cache()
if WITH_ALLOCATOR:
    res.append(["both pools' segments back through the free function",
                count("live_bytes") == 0 and count("n_alloc") == 2, f"{count('n_alloc')} allocs"])
torch.cuda.set_per_process_memory_fraction(1.0)
"""

# test_mempool_limited_memory_with_allocator, and the same with plain pools.
mirror("limited_memory_with_allocator")("WITH_ALLOCATOR = True\n" + LIMITED)
mirror("limited_memory")("WITH_ALLOCATOR = False\n" + LIMITED)

# test_deleted_mempool_not_used_on_oom
mirror("deleted_mempool_not_used_on_oom")("""
res = out["checks"] = []
limit_memory(40)
for _ in range(10):
    p = torch.cuda.MemPool(new_allocator().allocator(), use_on_oom=True)
    with torch.cuda.use_mem_pool(p):
        a = torch.randn(40 * NELEM_1MB, device="cuda")
    del a, p
gc.collect()
res.append(["ten pools made and deleted: their segments went back", count("live_bytes") == 0,
            f"live {count('live_bytes')}"])
new_pool = torch.cuda.MemPool(use_on_oom=True)
with torch.cuda.use_mem_pool(new_pool):
    a = torch.randn(40 * NELEM_1MB, device="cuda")
del a
try:
    b = torch.randn(20 * NELEM_1MB, device="cuda")
    c = torch.randn(20 * NELEM_1MB, device="cuda")
    res.append(["a live use_on_oom pool serves two requests that ran out", True, ""])
    del b, c
except torch.OutOfMemoryError as e:
    res.append(["a live use_on_oom pool serves two requests that ran out", False, str(e)[:300]])
del new_pool
gc.collect()
torch.cuda.empty_cache()
# A use_on_oom pool deleted while a tensor of it lives serves nothing: x
# takes 30 of its cached 40 MiB block, and 10 MiB of it stay free.
gone = torch.cuda.MemPool(new_allocator().allocator(), use_on_oom=True)
with torch.cuda.use_mem_pool(gone):
    big = torch.empty(40 * MB, dtype=torch.uint8, device="cuda")
del big
with torch.cuda.use_mem_pool(gone):
    x = torch.ones(30 * MB, dtype=torch.uint8, device="cuda")
res.append(["the pool's second tensor reuses its cached block", count("n_alloc") == 11,
            f"{count('n_alloc')} segments asked for"])
del gone
gc.collect()
try:
    y = torch.empty(8 * MB, dtype=torch.uint8, device="cuda")
    res.append(["a deleted use_on_oom pool serves nothing", False, "served"])
    del y
except torch.OutOfMemoryError:
    res.append(["a deleted use_on_oom pool serves nothing", True, ""])
del x
gc.collect()
torch.cuda.empty_cache()
try:
    y = torch.empty(8 * MB, dtype=torch.uint8, device="cuda")
    res.append(["its last tensor freed, its memory is the device's again",
                count("live_bytes") == 0, f"live {count('live_bytes')}"])
except torch.OutOfMemoryError as e:
    res.append(["its last tensor freed, its memory is the device's again", False, str(e)[:300]])
torch.cuda.set_per_process_memory_fraction(1.0)
""")

# test_mempool_expandable: a pool with an allocator under expandable
# segments (pools with an allocator use its plain segments).
EXPANDABLE = """
res = out["checks"] = []
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
allocator = new_allocator()
pool = torch.cuda.MemPool(allocator.allocator())
with torch.cuda.use_mem_pool(pool):
    t = torch.randn(4 * NELEM_1MB, device="cuda")
    s = torch.randn(100, device="cuda")
outside = torch.randn(4 * NELEM_1MB, device="cuda")
segs = pool.snapshot()
res.append(["the pool's memory comes from the allocator", owns(t) and owns(s) and not owns(outside), ""])
res.append(["its segments are plain, not expandable",
            len(segs) == 2 and not any(x.get("is_expandable", False) for x in segs),
            json.dumps([(x["total_size"], x.get("is_expandable")) for x in segs])])
del t, s, pool
gc.collect()
torch.cuda.empty_cache()
res.append(["its segments went back", count("live_bytes") == 0, ""])
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
"""
mirror("expandable", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})(EXPANDABLE)
mirror("expandable_at_run_time")(EXPANDABLE)

# test_mempool_no_split, with and without an allocator.
NO_SPLIT = """
res = out["checks"] = []
torch.cuda.empty_cache()
make = (lambda **kw: torch.cuda.MemPool(new_allocator().allocator(), **kw)) if WITH_ALLOCATOR \\
    else (lambda **kw: torch.cuda.MemPool(**kw))
pool_split = make()
pool_no_split = make(no_split=True)
keep = []
for _ in range(2):
    for p in (pool_split, pool_no_split):
        with torch.cuda.use_mem_pool(p):
            keep.append(torch.randn(4 * NELEM_1MB, device="cuda"))
            keep.append(torch.randn(1000, device="cuda"))
split, whole = pool_split.snapshot(), pool_no_split.snapshot()
res.append(["a no_split pool needs more segments", len(whole) > len(split),
            f"{len(whole)} vs {len(split)}"])
res.append(["every no_split segment holds one block",
            all(len(s["blocks"]) == 1 for s in whole),
            str([len(s["blocks"]) for s in whole])])
res.append(["the split pool splits", any(len(s["blocks"]) > 1 for s in split), ""])
for t in keep:
    t.fill_(1.0)
torch.cuda.synchronize()
del keep, pool_split, pool_no_split
gc.collect()
torch.cuda.empty_cache()
if WITH_ALLOCATOR:
    res.append(["the pools' segments went back", count("live_bytes") == 0, ""])
"""
mirror("no_split")("WITH_ALLOCATOR = False\n" + NO_SPLIT)
mirror("no_split_with_allocator")("WITH_ALLOCATOR = True\n" + NO_SPLIT)

# test_mempool_emptycache_multithread: empty_cache under use_mem_pool keeps
# the pool's cached segment.
mirror("emptycache_multithread")("""
res = out["checks"] = []
def work(pool):
    with torch.cuda.use_mem_pool(pool):
        x = torch.randn(4, device="cuda")
        del x
        torch.cuda.empty_cache()
pools = [torch.cuda.MemPool(new_allocator().allocator()) for _ in range(4)]
threads = [threading.Thread(target=work, args=(p,)) for p in pools]
for t in threads:
    t.start()
for t in threads:
    t.join()
res.append(["each pool keeps its one cached segment", [len(p.snapshot()) for p in pools] == [1] * 4,
            str([len(p.snapshot()) for p in pools])])
del pools
gc.collect()
torch.cuda.empty_cache()
res.append(["deleted, they give them back", count("live_bytes") == 0, ""])
""")


def run_child(name, body, env, so, alloc_so, native, timeout=600):
    e = dict(os.environ)
    for k in ("CACHEALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        e.pop(k, None)
    e.update(env)
    code = CHILD_PRELUDE + body + CHILD_EPILOGUE
    try:
        r = subprocess.run([sys.executable, "-c", code, HERE, so or "", alloc_so,
                            "1" if native else "0"],
                           capture_output=True, text=True, timeout=timeout, env=e)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s"
    text = (r.stdout + r.stderr).strip()
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]), text[-800:]
    return None, text[-800:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", help="libcachealloc.so (default: cachealloc_torch.library_path())")
    ap.add_argument("--native", action="store_true",
                    help="run the checks on PyTorch's own allocator")
    ap.add_argument("--build-only", action="store_true",
                    help="compile the MemPool allocator and exit (no GPU needed)")
    ap.add_argument("--only", help="run the checks whose name contains this")
    a = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        skip(f"PyTorch is not installed ({e})")
    try:
        alloc_so = build_allocator()
    except Exception as e:  # no compiler, no CUDA headers
        if a.build_only:
            print(f"FAIL build of the MemPool allocator: {e}", flush=True)
            sys.exit(1)
        skip(f"the MemPool allocator cannot be built here ({type(e).__name__}: {e})")
    print(f"MemPool allocator: {alloc_so}", flush=True)
    if a.build_only:
        sys.exit(0)
    so = None
    if not a.native:
        import cachealloc_torch as ca
        try:
            so = ca.library_path(a.lib)
        except FileNotFoundError as e:
            skip(str(e))
    if not torch.cuda.is_available():
        skip("no CUDA device visible to PyTorch")
    print(f"{'native PyTorch allocator' if a.native else 'cachealloc ' + so}", flush=True)
    for name, body, env in CHECKS:
        if a.only and a.only not in name:
            continue
        res, tail = run_child(name, body, env, so, alloc_so, a.native)
        label = name + (f" ({', '.join(f'{k}={v}' for k, v in env.items())})" if env else "")
        if res is None:
            check(f"{label}: the child ran to the end", False, tail)
            continue
        for what, passed, detail in res.get("checks", []):
            check(f"{label}: {what}", passed, detail)
    print(f"\n{'FAILED: ' + ', '.join(FAILED) if FAILED else 'all checks passed'}", flush=True)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
