# Side-by-side latency of PyTorch's caching allocator and cachealloc in ONE
# process, alternating: each repetition runs PyTorch's case and then the same
# case on cachealloc, so both see the same moment of a host whose speed moves
# by ±30% from one minute to the next (virtualized GPU hosts do). cachealloc
# is called through its C ABI (libcachealloc.so, `cachealloc_alloc` /
# `cachealloc_free`: what PyTorch's CUDAPluggableAllocator calls), so the
# ABI's own checks are in its figures; PyTorch through raw_alloc/raw_delete
# as in latency_bench.py. Same cases, sizes and random plans as
# latency_bench.py (std::mt19937_64, log-uniform sizes, warm pass then timed
# pass over the same sequence).
#
#   python3 python/bench/side_by_side.py --lib gpu-bundle/lib/libcachealloc.so OUT.json [--reps N]
#   python3 python/bench/side_by_side.py --lib new=A.so --lib old=B.so OUT.json [--only random]
#   python3 python/bench/side_by_side.py --lib a=A.so --lib b=copy-of-A.so --conf b=default,slab_max_kb:64 OUT.json
#
# Prints, per case, the minimum of each allocator over the repetitions, the
# ratio of the minimums and the median of the per-repetition ratios. With
# several `--lib NAME=PATH`, every build runs after PyTorch in each
# repetition (each library is loaded on its own, with its own cache), so two
# builds are compared in one process, as the ratio to the same PyTorch runs.
#
# `--floor PATH` (a build of python/bench/null_abi.c: the two ABI functions
# with no allocator behind them) times the bench's own loop, plan and call in
# every repetition too. That floor is in both allocators' figures and pulls
# the faster one's ratio towards 1, so each build's line then also gives the
# median of the paired ratios with the floor taken off both sides:
# (cachealloc - floor) / (PyTorch - floor), the allocators' own work.
import argparse, json, os, statistics, time
import torch
from torch.utils.cpp_extension import load_inline

SRC = r'''
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <chrono>
#include <cmath>
#include <random>
#include <string>
#include <vector>
using clk = std::chrono::steady_clock;
static double ns_since(clk::time_point t0, long n) {
  return std::chrono::duration<double, std::nano>(clk::now() - t0).count() / n;
}
typedef void* (*ca_alloc_t)(ssize_t, int, void*);
typedef void (*ca_free_t)(void*, ssize_t, int, void*);
static std::vector<ca_alloc_t> ca_alloc_fns;
static std::vector<ca_free_t> ca_free_fns;

// Loads one build of libcachealloc.so; returns its index, or -1.
long ca_load(std::string path) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) return -1;
  auto a = (ca_alloc_t)dlsym(h, "cachealloc_alloc");
  auto f = (ca_free_t)dlsym(h, "cachealloc_free");
  if (a == nullptr || f == nullptr) return -1;
  ca_alloc_fns.push_back(a);
  ca_free_fns.push_back(f);
  return (long)ca_alloc_fns.size() - 1;
}

struct Torch {
  void* alloc(long n) { return c10::cuda::CUDACachingAllocator::raw_alloc(n); }
  void release(void* p, long) { c10::cuda::CUDACachingAllocator::raw_delete(p); }
};
struct Ca {
  ca_alloc_t a;
  ca_free_t f;
  explicit Ca(long lib) : a(ca_alloc_fns.at(lib)), f(ca_free_fns.at(lib)) {}
  void* alloc(long n) { return a((ssize_t)n, 0, nullptr); }
  void release(void* p, long n) { f(p, (ssize_t)n, 0, nullptr); }
};

template <class A> double pair(A a, long size, long iters) {
  for (int i = 0; i < 1000; i++) a.release(a.alloc(size), size);
  auto t0 = clk::now();
  for (long i = 0; i < iters; i++) a.release(a.alloc(size), size);
  return ns_since(t0, iters);
}

template <class A> double mixed(A a, long iters, int slots, long max_bytes, int seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(std::log(512.0), std::log((double)max_bytes));
  std::vector<void*> live(slots, nullptr);
  std::vector<long> held(slots, 0);
  std::vector<long> sizes(iters);
  for (long i = 0; i < iters; i++) sizes[i] = (long)std::exp(u(rng));
  std::vector<int> pick(iters);
  for (long i = 0; i < iters; i++) pick[i] = rng() % slots;
  auto run = [&]() {
    for (long i = 0; i < iters; i++) {
      int s = pick[i];
      if (live[s]) { a.release(live[s], held[s]); live[s] = nullptr; }
      else { live[s] = a.alloc(sizes[i]); held[s] = sizes[i]; }
    }
  };
  run();  // warm
  auto t0 = clk::now();
  run();
  double r = ns_since(t0, iters);
  for (int s = 0; s < slots; s++) if (live[s]) a.release(live[s], held[s]);
  return r;
}

// Creates build `lib`'s allocator now (one alloc and free), so that it reads
// CACHEALLOC_CONF as the caller set it for this build.
long ca_warm(long lib) {
  Ca a(lib);
  void* p = a.alloc(512);
  if (p == nullptr) return -1;
  a.release(p, 512);
  return 0;
}
double torch_pair(long lib, long size, long iters) { return pair(Torch{}, size, iters); }
double ca_pair(long lib, long size, long iters) { return pair(Ca(lib), size, iters); }
double torch_mixed(long lib, long iters, int slots, long max_bytes, int seed) { return mixed(Torch{}, iters, slots, max_bytes, seed); }
double ca_mixed(long lib, long iters, int slots, long max_bytes, int seed) { return mixed(Ca(lib), iters, slots, max_bytes, seed); }
'''
FUNCS = ["ca_load", "ca_warm", "torch_pair", "ca_pair", "torch_mixed", "ca_mixed"]

CASES = [
    ("pair 512 B", lambda e, w, i: getattr(e, f"{w}_pair")(i, 512, 200000)),
    ("pair 64 KiB", lambda e, w, i: getattr(e, f"{w}_pair")(i, 65536, 200000)),
    ("pair 1 MiB", lambda e, w, i: getattr(e, f"{w}_pair")(i, 1 << 20, 200000)),
    ("pair 16 MiB", lambda e, w, i: getattr(e, f"{w}_pair")(i, 16 << 20, 200000)),
    ("pair 256 MiB", lambda e, w, i: getattr(e, f"{w}_pair")(i, 256 << 20, 200000)),
    ("random ops, 256 slots <= 8 MiB", lambda e, w, i: getattr(e, f"{w}_mixed")(i, 400000, 256, 8 << 20, 1)),
    ("random ops, 4096 slots <= 64 MiB", lambda e, w, i: getattr(e, f"{w}_mixed")(i, 400000, 4096, 64 << 20, 2)),
]


def parse_lib(spec):
    """`NAME=PATH` or a plain path (named `cachealloc`)."""
    name, sep, path = spec.partition("=")
    return (name, path) if sep and name and path else ("cachealloc", spec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--lib", action="append", metavar="[NAME=]PATH",
                    help="a build of libcachealloc.so; repeat to compare builds "
                         "(default: gpu-bundle/lib/libcachealloc.so)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--only", metavar="TEXT", help="run only the cases whose label contains TEXT")
    ap.add_argument("--floor", metavar="PATH",
                    help="a build of python/bench/null_abi.c, timed in every repetition "
                         "as the bench's floor (see the top of this file)")
    ap.add_argument("--conf", action="append", metavar="NAME=CONF", default=[],
                    help="run build NAME with CACHEALLOC_CONF=CONF (its allocator is created "
                         "at load, reading it then); two builds with different configurations "
                         "must be two files, as the same path loads once")
    args = ap.parse_args()
    cases = [c for c in CASES if args.only is None or args.only in c[0]]
    if not cases:
        ap.error(f"no case matches --only {args.only!r} (cases: {', '.join(l for l, _ in CASES)})")
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    libs = [parse_lib(s) for s in (args.lib or ["gpu-bundle/lib/libcachealloc.so"])]
    names = [n for n, _ in libs]
    if len(set(names)) != len(names):
        ap.error(f"two --lib builds share a name: {names}")
    confs = {}
    for spec in args.conf:
        name, sep, conf = spec.partition("=")
        if not sep or name not in names:
            ap.error(f"--conf {spec!r}: expected NAME=CONF with NAME one of {names}")
        confs[name] = conf
    paths = [p for _, p in libs]
    if confs and len(set(paths)) != len(paths):
        ap.error("with --conf, every --lib must be its own file (a path loads once per process)")
    if args.floor is not None:
        if "floor" in names:
            ap.error("--lib may not be named 'floor' together with --floor")
        libs.append(("floor", args.floor))
    t0 = time.time()
    ext = load_inline("side_by_side", cpp_sources=SRC, functions=FUNCS, with_cuda=True,
                      extra_ldflags=["-lcudart", "-ldl"], verbose=False)
    print(f"compiled in {time.time() - t0:.0f}s", flush=True)
    torch.cuda.init()
    torch.empty(1, device="cuda")
    index = {}
    base_conf = os.environ.get("CACHEALLOC_CONF")
    for name, path in libs:
        i = ext.ca_load(path)
        if i < 0:
            raise SystemExit(f"cannot load cachealloc_alloc/cachealloc_free from {path}")
        index[name] = i
        if name in confs:
            os.environ["CACHEALLOC_CONF"] = confs[name]
            if ext.ca_warm(i) < 0:
                raise SystemExit(f"{name}: the first allocation failed with CACHEALLOC_CONF={confs[name]!r}")
            if base_conf is None:
                del os.environ["CACHEALLOC_CONF"]
            else:
                os.environ["CACHEALLOC_CONF"] = base_conf
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
          f"{args.reps} alternating repetitions per case; builds: "
          + ", ".join(f"{n}={p}" + (f" (CACHEALLOC_CONF={confs[n]})" if n in confs else "")
                      for n, p in libs), flush=True)
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "reps": args.reps, "libs": dict(libs), "confs": confs, "cases": {}}
    shown = [n for n, _ in libs]
    floored = args.floor is not None
    extra = " floor off: median of paired ratios |" if floored else ""
    print("| case | build | PyTorch min (ns) | cachealloc min (ns) | ratio of minimums | median of paired ratios |"
          + extra + " paired ratios |")
    print("|---|---|---:|---:|---:|---:|" + ("---:|" if floored else "") + "---|")
    for label, run in cases:
        t, c = [], {n: [] for n in shown}
        for _ in range(args.reps):
            t.append(run(ext, "torch", 0))
            for n in shown:
                c[n].append(run(ext, "ca", index[n]))
        res["cases"][label] = {"torch_ns": t, **{f"{n}_ns": c[n] for n in shown}}
        for n in shown:
            paired = [ci / ti for ti, ci in zip(t, c[n])]
            off = ""
            if floored and n != "floor":
                net = [(ci - fi) / (ti - fi) for ti, ci, fi in zip(t, c[n], c["floor"])]
                off = f" {statistics.median(net):.2f} |"
            elif floored:
                off = " – |"
            print(f"| {label} | {n} | {min(t):.0f} | {min(c[n]):.0f} | {min(c[n]) / min(t):.2f} | "
                  f"{statistics.median(paired):.2f} |{off} {' '.join(f'{p:.2f}' for p in paired)} |", flush=True)
    json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
