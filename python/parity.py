"""Parity of PyTorch features: PyTorch's own allocator against cachealloc.

Each check runs in its own process, once per allocator variant:

    native                 PyTorch's caching allocator
    cachealloc             cachealloc through PyTorch's C++ allocator interface (CACHEALLOC_CONF=default)
    cachealloc-expandable  the same with CACHEALLOC_CONF=expandable
    cachealloc-pluggable   cachealloc through CUDAPluggableAllocator (for comparison; not by default)

and one table is printed: "pass", "FAIL: why", or "loud: why" for a feature
cachealloc refuses with an error naming it (the row is then marked as such).

    python3 python/parity.py                         # every check, default variants
    python3 python/parity.py --checks oom,cuda_graph --variants native,cachealloc
    python3 python/parity.py --jobs 4 --markdown out.md

A check that passes natively must pass with cachealloc; the exit status is 1 otherwise.
Checks run --jobs at a time (default 4); each uses little memory (the OOM
check caps itself with a memory fraction) so that they can share the GPU.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
TAG = "PARITY_RESULT "

VARIANTS = {
    "native": dict(kind="native", conf=None),
    "native-expandable": dict(kind="native", conf="expandable_segments:True"),
    "cachealloc": dict(kind="cachealloc", conf="default", mode="cpp"),
    "cachealloc-expandable": dict(kind="cachealloc", conf="expandable", mode="cpp"),
    "cachealloc-pluggable": dict(kind="cachealloc", conf="default", mode="pluggable"),
}
DEFAULT_VARIANTS = "native,cachealloc,cachealloc-expandable"


class Loud(Exception):
    """A feature cachealloc refuses on purpose, with an error that names it."""


# ------------------------------------------------------------------ checks
# Each takes torch and returns a short note (or raises).


def check_alloc_free(torch):
    x = torch.randn(1 << 20, device="cuda")
    y = (x * 2).sum().item()
    assert abs(y - 2 * x.sum().item()) < 1e-2 * max(1.0, abs(y))
    del x
    return "ok"


def check_memory_stats(torch):
    torch.cuda.init()
    torch.cuda.reset_peak_memory_stats()
    a0 = torch.cuda.memory_allocated()
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    a1 = torch.cuda.memory_allocated()
    assert a1 - a0 >= 64 << 20, (a0, a1)
    assert torch.cuda.memory_reserved() >= a1
    assert torch.cuda.max_memory_allocated() >= a1
    assert torch.cuda.max_memory_reserved() >= torch.cuda.memory_reserved()
    s = torch.cuda.memory_stats()
    for k in ("allocated_bytes.all.current", "reserved_bytes.all.peak", "num_alloc_retries",
              "num_ooms", "active_bytes.large_pool.current", "requested_bytes.all.current",
              "segment.all.current", "inactive_split.all.current"):
        assert k in s, k
    assert s["allocation.all.current"] >= 1
    del x
    assert torch.cuda.memory_allocated() == a0
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == a0
    torch.cuda.reset_accumulated_memory_stats()
    s = torch.cuda.memory_stats()
    assert s["allocated_bytes.all.allocated"] == 0, s["allocated_bytes.all.allocated"]
    assert "Allocated memory" in torch.cuda.memory_summary()
    segs = torch.cuda.memory_snapshot()
    assert isinstance(segs, list)
    torch.cuda.memory._snapshot()
    return f"allocated +{(a1 - a0) >> 20} MiB"


def check_cudnn_benchmark(torch):
    torch.backends.cudnn.benchmark = True
    conv = torch.nn.Conv2d(16, 32, 3, padding=1).cuda()
    x = torch.randn(8, 16, 64, 64, device="cuda", requires_grad=True)
    note = ""
    ca = sys.modules.get("cachealloc_torch")
    if ca is not None and ca.mode() == "cpp":
        # cuDNN keeps only the algorithms whose workspace fits in what cacheInfo
        # reports; with a small cache that must still count the device's free memory.
        offered, free = ca.cache_info(), torch.cuda.mem_get_info()[0]
        if offered < free // 2:
            raise AssertionError(f"cacheInfo offers {offered >> 20} MiB with "
                                 f"{free >> 20} MiB free on the device")
        note = f"cacheInfo {offered >> 20} MiB, device free {free >> 20} MiB; "
    for _ in range(2):
        y = conv(x)
        y.sum().backward()
    torch.cuda.synchronize()
    return note + "conv fwd+bwd"


def _mlp(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 64)).cuda()


def check_cuda_graph(torch):
    model = _mlp(torch)
    static_in = torch.randn(32, 64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = model(static_in)
    worst = 0.0
    keep = []
    for i in range(5):
        x = torch.randn(32, 64, device="cuda")
        static_in.copy_(x)
        # Allocations between replays must not take the graph's memory.
        keep.append(torch.full((1 << 18,), float(i), device="cuda"))
        g.replay()
        keep.append(torch.ones(1 << 16, device="cuda") * 3)
        ref = model(x)
        worst = max(worst, (static_out - ref).abs().max().item())
    assert worst < 1e-4, worst
    for i, t in enumerate(keep[0::2]):
        assert t.eq(float(i)).all().item()
    del g
    torch.cuda.synchronize()
    return f"5 replays, max diff {worst:.1e}"


def check_graph_reset_recapture(torch):
    # A graph reset while a tensor of its pool is alive, then captured again:
    # that tensor is freed during the second capture, which empties the
    # released pool. Freeing the pool's memory then would invalidate the
    # capture; it must stay until the capture is over.
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = torch.full((1000,), 1.0, device="cuda")
        g = torch.cuda.CUDAGraph()
        g.capture_begin()
        b = a
        for _ in range(10):
            b = b + 1
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    assert b.sum().item() == 11000.0
    g.reset()
    with torch.cuda.stream(s):
        g.capture_begin()
        b.fill_(2.0)
        for _ in range(10):
            b = b + 2
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    total = b.sum().item()
    assert total == 22000.0, total
    g.reset()
    del g, b
    torch.cuda.synchronize()
    assert not torch.cuda.is_current_stream_capturing()
    x = torch.ones(1 << 20, device="cuda")  # the process still works
    torch.cuda.empty_cache()
    return f"sum {total:.0f} after recapture; {x.sum().item():.0f} after"


def check_graphed_callables(torch):
    model = _mlp(torch)
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    gm = torch.cuda.make_graphed_callables(model, (x,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        inp = torch.randn(32, 64, device="cuda", requires_grad=True)
        out = gm(inp)
        out.sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ref = model(inp)
    diff = (gm(inp) - ref).abs().max().item()
    assert diff < 1e-4, diff
    return f"fwd+bwd graphs, diff {diff:.1e}"


def check_compile_reduce_overhead(torch):
    model = _mlp(torch)

    @torch.compile(mode="reduce-overhead")
    def f(x):
        return model(x).relu().sum(dim=1)

    worst = 0.0
    for _ in range(6):
        x = torch.randn(32, 64, device="cuda")
        y = f(x).clone()
        worst = max(worst, (y - model(x).relu().sum(dim=1)).abs().max().item())
    assert worst < 1e-3, worst
    return f"6 calls, diff {worst:.1e}"


def check_compile_default(torch):
    model = _mlp(torch)
    f = torch.compile(model)
    x = torch.randn(32, 64, device="cuda")
    diff = (f(x) - model(x)).abs().max().item()
    assert diff < 1e-3, diff
    return f"diff {diff:.1e}"


def check_mempool(torch):
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        a = torch.ones(1 << 20, device="cuda")
        b = torch.ones(1 << 20, device="cuda") * 2
    c = torch.zeros(1 << 20, device="cuda")
    segs = torch.cuda.memory_snapshot(pool.id) if _takes_pool(torch) else None
    if segs is not None:
        addrs = {s["address"] for s in segs}
        assert addrs, "no segment in the pool's snapshot"
        inside = lambda t: any(s["address"] <= t.data_ptr() < s["address"] + s["total_size"]
                               for s in segs)
        assert inside(a) and inside(b) and not inside(c)
    assert (a + b).eq(3).all().item()
    n = pool.use_count()
    del a, b, c
    del pool
    torch.cuda.empty_cache()
    return f"use_count {n}"


def _takes_pool(torch):
    import inspect
    try:
        return "mempool_id" in inspect.signature(torch.cuda.memory_snapshot).parameters
    except (TypeError, ValueError):
        return False


def check_oom(torch):
    torch.cuda.init()
    torch.cuda.set_per_process_memory_fraction(0.05)
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        msg = str(e)
        assert msg.startswith("CUDA out of memory. Tried to allocate"), msg[:200]
        assert torch.cuda.memory_stats()["num_ooms"] >= 1
        return msg[:48]
    raise AssertionError("no OutOfMemoryError")


def check_oom_observer(torch):
    seen = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *a: seen.append(a))
    torch.cuda.set_per_process_memory_fraction(0.05)
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        pass
    assert seen, "observer not called"
    return f"{len(seen)} call(s)"


def check_memory_fraction(torch):
    torch.cuda.set_per_process_memory_fraction(0.5)
    got = torch.cuda.get_per_process_memory_fraction() if hasattr(
        torch.cuda, "get_per_process_memory_fraction") else 0.5
    assert abs(got - 0.5) < 1e-9, got
    x = torch.ones(1 << 20, device="cuda")
    return f"fraction {got}"


def check_snapshot_history(torch):
    import pickle
    import tempfile
    torch.cuda.memory._record_memory_history(max_entries=10000)
    xs = [torch.randn(1 << k, device="cuda") for k in range(10, 22)]
    del xs[::2]
    path = os.path.join(tempfile.mkdtemp(), "snap.pickle")
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"]
    frees = [e for e in trace if e["action"] in ("free_requested", "free_completed")]
    assert len(allocs) >= 12 and frees, (len(allocs), len(frees))
    assert all(e["size"] > 0 for e in frees), "a free entry without its size"
    assert any(any("parity.py" in fr["filename"] for fr in e["frames"]) for e in allocs), \
        "no Python frames in the trace"
    blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert blocks
    from torch.cuda import _memory_viz
    html1 = _memory_viz.segment_plot(snap)
    html2 = _memory_viz.trace_plot(snap)
    assert len(html1) > 1000 and len(html2) > 1000
    out = os.environ.get("PARITY_SNAPSHOT_DIR")
    if out:
        import shutil
        conf = os.environ.get("CACHEALLOC_CONF")
        shutil.copy(path, os.path.join(out, f"snapshot-{'cachealloc-' + conf if conf else 'native'}.pickle"))
    return f"{len(allocs)} allocs, {len(snap['segments'])} segments"


def check_nccl_allreduce(torch):
    import tempfile
    import torch.distributed as dist
    if not dist.is_nccl_available():
        return "skipped: no NCCL"
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    t = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    assert t[5].item() == 5.0
    dist.destroy_process_group()
    return "world size 1"


def check_threads_streams(torch):
    import threading
    errors = []

    def work(i):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for k in range(20):
                    x = torch.full((1 << 16,), float(i), device="cuda")
                    y = torch.empty((1 << 10) * (1 + k % 7), device="cuda")
                    assert x.sum().item() == float(i) * (1 << 16)
                    del x, y
            s.synchronize()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[:2]
    return "8 threads"


def check_record_stream(torch):
    side = torch.cuda.Stream()
    x = torch.full((1 << 22,), 7.0, device="cuda")
    out = torch.empty(1 << 22, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keeps the side stream busy
        out.copy_(x)
    x.record_stream(side)
    del x
    # Allocations on the main stream must not get x's memory while the side stream may read it.
    ys = [torch.full((1 << 22,), -1.0, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    assert out.eq(7.0).all().item(), "record_stream: memory reused too early"
    return "ok"


def check_record_stream_in_capture(torch):
    # A tensor from before a capture, used by the capturing stream and freed
    # during the capture: its guard must wait for the capture to end (an event
    # recorded on the capturing stream cannot be queried until then).
    s = torch.cuda.Stream()
    x = torch.full((1 << 20,), 2.0, device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        y = x * 3
        x.record_stream(s)
        del x
        # Allocations inside the capture make the allocator look at its guards.
        zs = [torch.ones(1 << 18, device="cuda") * i for i in range(4)]
    g.replay()
    torch.cuda.synchronize()
    after = [torch.full((1 << 20,), -1.0, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    assert y.eq(6.0).all().item(), "captured result wrong"
    assert all(t.eq(-1.0).all().item() for t in after)
    del zs
    return "ok"


def check_empty_cache(torch):
    torch.cuda.init()
    base = torch.cuda.memory_reserved()
    xs = [torch.empty(32 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
    peak = torch.cuda.memory_reserved()
    del xs
    torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved()
    assert peak - base >= 256 << 20 and after <= base, (base, peak, after)
    return f"{(peak - after) >> 20} MiB returned"


def check_training_loop(torch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 1)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(1024, 128, device="cuda")
    y = x[:, :1] * 3 + 1
    first = None
    for _ in range(200):
        loss = torch.nn.functional.mse_loss(model(x), y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = loss.item()
    assert last < first * 0.1, (first, last)
    return f"loss {first:.2f} -> {last:.3f}"


def check_multi_device(torch):
    n = torch.cuda.device_count()
    if n < 2:
        return "skipped: 1 GPU"
    a = torch.ones(1 << 20, device="cuda:0")
    before0 = torch.cuda.memory_allocated(0)
    torch.cuda.set_device(1)
    b = torch.ones(1 << 20, device="cuda:1") * 2
    c = a.to("cuda:1") + b
    assert c.eq(3).all().item()
    assert torch.cuda.memory_allocated(1) >= 8 << 20
    # A tensor of device 0 freed while device 1 is current.
    del a
    assert torch.cuda.memory_allocated(0) == before0 - (4 << 20), "device 0's free not counted"
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(1) >= torch.cuda.memory_allocated(1) > 0
    with torch.cuda.device(0):
        d = torch.randn(1 << 18, device="cuda") * 1
    assert d.device.index == 0
    # Copies that cannot be one memcpy run as a kernel on one device reading
    # the other's memory when the devices are peers: with expandable segments
    # that needs access to the pages, mapped before the copy and after it.
    p2p = torch.cuda.can_device_access_peer(0, 1) and torch.cuda.can_device_access_peer(1, 0)
    x0 = torch.arange(1 << 20, device="cuda:0", dtype=torch.float32).view(1024, 1024)
    y1 = x0.t().to("cuda:1")
    assert torch.equal(y1.cpu(), x0.t().cpu()), "0 -> 1 transposed copy"
    x1 = torch.arange(1 << 20, device="cuda:1", dtype=torch.float32).view(1024, 1024) * 2
    y0 = x1.t().to("cuda:0")
    assert torch.equal(y0.cpu(), x1.t().cpu()), "1 -> 0 transposed copy"
    later = torch.randn(2048, 2048, device="cuda:0")
    z1 = later.t().to("cuda:1")
    assert torch.equal(z1.cpu(), later.t().cpu()), "copy of a tensor mapped after peer access"
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    return f"{n} GPUs, peer copies {'over P2P' if p2p else 'staged'}"


def check_ddp(torch):
    """DistributedDataParallel over two GPUs under torchrun (ddp_check.py)."""
    n = torch.cuda.device_count()
    if n < 2:
        return "skipped: 1 GPU"
    env = dict(os.environ)
    ours = "CACHEALLOC_CONF" in env
    env["CACHEALLOC_TORCH"] = "1" if ours else "0"
    env["DDP_CHECK_ALLOCATOR"] = "cachealloc" if ours else "native"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", "2", os.path.join(HERE, "ddp_check.py")]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    ok = [l for l in p.stdout.splitlines() if l.startswith("DDP_OK")]
    tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
    assert p.returncode == 0 and ok, f"exit {p.returncode}: {tail}"
    return "torchrun, " + ok[0][len("DDP_OK "):]


def check_ipc(torch):
    x = torch.ones(16, device="cuda")
    try:
        x.untyped_storage()._share_cuda_()
    except RuntimeError as e:
        if "cachealloc" in str(e) and "IPC" in str(e):
            raise Loud("CUDA IPC refused by name") from e
        raise
    return "shared"


def check_checkpoint_state(torch):
    """A graph pool set back to a checkpoint (what CUDA graph trees do to
    record a second path): the same blocks, and the graph still replays."""
    def fn():
        bufs = [torch.ones(512, device="cuda", dtype=torch.uint8) for _ in range(11)]
        return bufs[5].add_(2), bufs[8]

    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    s.synchronize()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        outs = fn()
    pool, dev = g.pool(), outs[0].device.index

    def blocks():
        return [(b["size"], b["state"]) for seg in torch.cuda.memory_snapshot()
                if seg["segment_pool_id"] == pool for b in seg["blocks"]]

    before = blocks()
    state = torch._C._cuda_getCheckpointState(dev, pool)
    torch._C._cuda_setCheckpointPoolState(dev, state, [], [])
    after = blocks()
    assert before == after, (before, after)
    g.replay()
    torch.cuda.synchronize()
    assert outs[0][0].item() == 3 and outs[1][0].item() == 1
    return f"{sum(st == 'active_allocated' for _, st in before)} blocks restored, graph replays"


CHECKS = {n[len("check_"):]: f for n, f in list(globals().items()) if n.startswith("check_")}


# ------------------------------------------------------------------ worker / parent


def worker(check, variant):
    v = VARIANTS[variant]
    sys.path.insert(0, HERE)
    t0 = time.perf_counter()
    import torch
    if v["kind"] == "cachealloc":
        import cachealloc_torch as ca
        ca.enable(mode=v["mode"])
    try:
        note = CHECKS[check](torch)
        res = dict(status="pass", note=note)
    except Loud as e:
        res = dict(status="loud", note=f"{e}: {str(e.__cause__)[:160]}")
    except Exception as e:  # noqa: BLE001 - every failure is a result
        res = dict(status="FAIL", note=f"{type(e).__name__}: {str(e)[:300]}")
    res["seconds"] = round(time.perf_counter() - t0, 1)
    print(TAG + json.dumps(res), flush=True)


def run(check, variant, timeout, log_dir):
    v = VARIANTS[variant]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("CACHEALLOC_CONF", None)
    if v["kind"] == "native" and v["conf"]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = v["conf"]
    if v["kind"] == "cachealloc":
        env["CACHEALLOC_CONF"] = v["conf"]
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", check, variant]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        out = p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or "") + (e.stderr or "") if isinstance(e.stdout, str) else ""
        return dict(status="FAIL", note=f"timed out after {timeout} s"), out
    if log_dir:
        with open(os.path.join(log_dir, f"{check}.{variant}.log"), "w") as f:
            f.write(out)
    for line in out.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG):]), out
    tail = [l for l in out.strip().splitlines() if l.strip()][-1:] or [""]
    return dict(status="FAIL", note=f"process exit {p.returncode}: {tail[0][:200]}"), out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--checks", default=",".join(CHECKS))
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--log-dir", help="write each process's output here")
    ap.add_argument("--markdown", help="write the table here")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker)
        return
    checks, variants = a.checks.split(","), a.variants.split(",")
    for c in checks:
        if c not in CHECKS:
            raise SystemExit(f"unknown check {c!r}; known: {', '.join(CHECKS)}")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    if a.log_dir:
        os.makedirs(a.log_dir, exist_ok=True)
    # Build the extension once before the parallel runs (it is cached afterwards).
    if any(VARIANTS[v].get("mode") == "cpp" for v in variants):
        r, out = run("alloc_free", next(v for v in variants if VARIANTS[v].get("mode") == "cpp"),
                     a.timeout, a.log_dir)
        if r["status"] != "pass":
            print(out[-3000:])
    jobs = [(c, v) for c in checks for v in variants]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.jobs) as ex:
        results = dict(zip(jobs, ex.map(lambda cv: run(*cv, a.timeout, a.log_dir)[0], jobs)))
    width = max(len(c) for c in checks)
    head = ["check"] + variants
    rows = [[c] + [f"{results[c, v]['status']}" + (f" ({results[c, v]['note']})"
                                                     if results[c, v].get("note") else "")
                   for v in variants] for c in checks]
    w = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    fmt = lambda r: "| " + " | ".join(str(x).ljust(n) for x, n in zip(r, w)) + " |"
    lines = [fmt(head), "|" + "|".join("-" * (n + 2) for n in w) + "|"] + [fmt(r) for r in rows]
    bad = [(c, v) for c in checks for v in variants
           if VARIANTS[v]["kind"] == "cachealloc" and VARIANTS[v].get("mode") == "cpp"
           and results[c, v]["status"] == "FAIL"
           and any(results[c, n]["status"] == "pass" for n in variants
                   if VARIANTS[n]["kind"] == "native")]
    text = "\n".join(lines) + (f"\n\nregressions against native: {bad}" if bad else
                               "\n\nevery check that passes natively passes with cachealloc") \
        + f"\n({time.perf_counter() - t0:.0f} s, width {width})"
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({f"{c}|{v}": r for (c, v), r in results.items()}, f, indent=1)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
