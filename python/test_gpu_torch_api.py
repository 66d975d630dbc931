"""GPU test of PyTorch's device-generic and memory-viz interfaces on the C++
allocator (docs/PYTORCH.md, "torch.accelerator" and "Memory snapshots,
history and the CLI"):

- torch.accelerator's memory functions (memory_stats, memory_allocated,
  max_memory_allocated, memory_reserved, max_memory_reserved,
  reset_peak_memory_stats, reset_accumulated_memory_stats, empty_cache,
  get_memory_info) give cachealloc's figures, the same as torch.cuda's, in
  the sequence PyTorch's TestCuda.test_memory_stats checks;
- memory history carries PyTorch's user metadata
  (torch.cuda.memory._set_memory_metadata) on every entry, per thread, as
  PyTorch's test_memory_plots_metadata checks, and torch.compile's region
  markers ("compile_context", test_memory_compile_regions' intent);
- record_function annotations, snapshot entries and times in microseconds
  since the epoch, as PyTorch's allocator records them;
- a snapshot has the keys PyTorch's own allocator gives (compared with a run
  on PyTorch's allocator), and PyTorch's memory-viz functions and CLI run on
  a dumped one;
- the history has the segment entries PyTorch's viewer needs: its
  "Allocator State History" (MemoryViz.js simulate_memory, copied in Python
  here) can undo a history in which empty_cache gave segments back, on plain
  and expandable segments (and on PyTorch's allocator, the reference);
- with graph_capture_record_stream_reuse:True, a block used on side streams
  and freed during a CUDA graph capture is reused during it exactly where
  PyTorch's allocator reuses it (after the side streams are joined back, not
  before), with 2 and 4 side streams, and without the setting it is not
  (the intent of PyTorch's test_graph_capture_reclaim_2_streams /
  _4_streams: addresses compared with a run on PyTorch's allocator).

Each group runs in a child process of its own (cachealloc must be enabled
before CUDA is first used).

    python3 python/test_gpu_torch_api.py [--lib PATH]

Exit status 0 when every check passed or when skipped (no torch, no CUDA
device, no library: the reason is printed), 1 when a check failed.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_check import FAILED, check, skip  # noqa: E402
SO = None


# A child process: prints one line `RESULT <json>`. NATIVE=1 leaves
# PyTorch's own allocator in place.
CHILD_PRELUDE = """
import json, os, sys, time, warnings
sys.path.insert(0, sys.argv[1])
import torch
import cachealloc_torch as ca
so = sys.argv[2]
if os.environ.get("NATIVE") != "1":
    ca.enable(so, mode="cpp")
out = {}
"""


def child(code, env=None, timeout=900):
    """Runs `code` after CHILD_PRELUDE; returns (the RESULT dict or None,
    the output's tail)."""
    e = dict(os.environ)
    for k in ("CACHEALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "NATIVE"):
        e.pop(k, None)
    e.update(env or {})
    try:
        r = subprocess.run([sys.executable, "-c", CHILD_PRELUDE + code, HERE, SO],
                           capture_output=True, text=True, timeout=timeout, env=e)
    except subprocess.TimeoutExpired as ex:
        return None, f"timed out after {timeout} s: {str(ex.stdout)[-300:]}"
    text = r.stdout + r.stderr
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]), text.strip()[-800:]
    return None, text.strip()[-800:]


ACCELERATOR = """
import gc
acc, cu = torch.accelerator, torch.cuda
out["registry"] = [ca._ext.installed(), ca._ext.device_allocator_installed()]
keep = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
small = torch.empty(1000, device="cuda")
a, c = acc.memory_stats(), cu.memory_stats()
common = set(a) & set(c)
out["n_common"] = len(common)
out["diff"] = [(k, a[k], c[k]) for k in sorted(common) if a[k] != c[k]][:5]
out["has_keys"] = all(k in a for k in ("active_bytes.all.current", "allocated_bytes.all.peak",
                                         "reserved_bytes.all.current", "num_ooms"))
core = ca._core_stats()
out["core_diff"] = [(k, v, a[k]) for k, v in core.items() if k in a and a[k] != v][:5]
out["n_core"] = sum(1 for k in core if k in a)
out["funcs"] = [(f, getattr(acc, f)(), getattr(cu, f)()) for f in
                ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved")]
# PyTorch's TestCuda.test_memory_stats, through torch.accelerator.
gc.collect()
cu.empty_cache()
cu.reset_peak_memory_stats()
cu.reset_accumulated_memory_stats()
prev_allocated, prev_reserved = acc.memory_allocated(), acc.memory_reserved()
out["prev"] = [prev_allocated, acc.max_memory_allocated(), prev_reserved,
               acc.max_memory_reserved()]
prev_active = acc.memory_stats()["active_bytes.all.current"]
tmp = torch.randn(256, device="cuda")
out["active_after_1k"] = acc.memory_stats()["active_bytes.all.current"] - prev_active
out["freed_before"] = acc.memory_stats()["active_bytes.all.freed"]
del tmp
gc.collect()
acc.empty_cache()
out["active_back"] = acc.memory_stats()["active_bytes.all.current"] - prev_active
out["freed_after"] = acc.memory_stats()["active_bytes.all.freed"]
acc.reset_peak_memory_stats()
out["peaks_after_reset"] = [acc.max_memory_allocated(), acc.max_memory_reserved(),
                            acc.memory_allocated(), acc.memory_reserved()]
# reset_accumulated_memory_stats through torch.accelerator, read by torch.cuda.
acc.reset_accumulated_memory_stats()
out["accumulated_zero"] = cu.memory_stats()["allocation.all.allocated"]
t = torch.empty(1 << 20, device="cuda")
out["accumulated_one"] = cu.memory_stats()["allocation.all.allocated"]
del t
# empty_cache through torch.accelerator gives memory back.
big = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
del big
before = cu.memory_reserved()
acc.empty_cache()
out["released"] = before - cu.memory_reserved()
free_a, total_a = acc.get_memory_info()
free_c, total_c = cu.mem_get_info()
out["meminfo"] = [total_a, total_c, abs(free_a - free_c)]
print("RESULT " + json.dumps(out))
"""


def accelerator_checks():
    res, tail = child(ACCELERATOR)
    if not check("torch.accelerator child ran", res is not None, tail):
        return
    check("cachealloc is PyTorch's CUDA allocator and its device allocator",
          res["registry"] == [True, True], str(res["registry"]))
    check("torch.accelerator.memory_stats() equals torch.cuda.memory_stats()",
          res["n_common"] > 50 and res["diff"] == [] and res["has_keys"],
          f"{res['n_common']} common keys; differences {res['diff']}")
    check("torch.accelerator.memory_stats() is cachealloc's (the core's statistics by name)",
          res["n_core"] > 50 and res["core_diff"] == [],
          f"{res['n_core']} keys compared; differences {res['core_diff']}")
    check("memory_allocated, max_memory_allocated, memory_reserved, max_memory_reserved: "
          "torch.accelerator's equal torch.cuda's",
          all(x == y for _, x, y in res["funcs"]) and res["funcs"][0][1] > 3 << 20,
          str(res["funcs"]))
    p = res["prev"]
    check("after torch.cuda's resets, peaks equal current values", p[0] == p[1] and p[2] == p[3],
          str(p))
    check("a 1 KiB tensor adds 1024 active bytes (torch.accelerator.memory_stats)",
          res["active_after_1k"] == 1024 and res["freed_before"] == 0,
          f"+{res['active_after_1k']} B active, {res['freed_before']} B freed")
    check("freeing it gives the 1024 bytes back and counts them freed",
          res["active_back"] == 0 and res["freed_after"] == 1024,
          f"{res['active_back']} B left, {res['freed_after']} B freed")
    pk = res["peaks_after_reset"]
    check("torch.accelerator.reset_peak_memory_stats sets the peaks to the current values",
          pk[0] == pk[2] and pk[1] == pk[3], str(pk))
    check("torch.accelerator.reset_accumulated_memory_stats resets what torch.cuda reads",
          res["accumulated_zero"] == 0 and res["accumulated_one"] == 1,
          f"{res['accumulated_zero']} then {res['accumulated_one']}")
    check("torch.accelerator.empty_cache releases cached memory",
          res["released"] >= 512 << 20, f"{res['released']} B released")
    m = res["meminfo"]
    check("torch.accelerator.get_memory_info agrees with torch.cuda.mem_get_info",
          m[0] == m[1] and m[2] <= 64 << 20, str(m))


METADATA = """
import gc, threading
contexts = {}
for context in ["alloc", "all", "state"]:
    try:
        gc.collect()
        torch.cuda.memory.empty_cache()
        torch.cuda.memory._set_memory_metadata("metadata test")
        torch.cuda.memory._record_memory_history(context=context)
        x = torch.rand(3, 4, device="cuda")
        del x
        torch.cuda.memory.empty_cache()
        torch.cuda.memory._set_memory_metadata("")
        ss = torch.cuda.memory._snapshot()
        ev = ss["device_traces"][0]
        contexts[context] = [len(ev), sorted({e["user_metadata"] for e in ev}),
                             sorted({e["action"] for e in ev}),
                             sorted({e["compile_context"] for e in ev})]
    finally:
        torch.cuda.memory._record_memory_history(None)
out["contexts"] = contexts
out["cleared"] = torch.cuda.memory._get_memory_metadata()
# Per thread: each thread's entries carry its own string.
torch.cuda.memory._record_memory_history("all")
torch.cuda.memory._set_memory_metadata("main")
a = torch.empty(4096, device="cuda")
ptrs = {}
def worker():
    torch.cuda.memory._set_memory_metadata("worker")
    b = torch.empty(8192, device="cuda")
    ptrs["worker"] = b.data_ptr()
    del b
t = threading.Thread(target=worker)
t.start(); t.join()
ptrs["main"] = a.data_ptr()
del a
ss = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(None)
torch.cuda.memory._set_memory_metadata("")
out["threads"] = {who: sorted({e["user_metadata"] for e in ss["device_traces"][0]
                               if e.get("addr") == p and e["action"] != "snapshot"})
                  for who, p in ptrs.items()}
print("RESULT " + json.dumps(out))
"""


def metadata_checks():
    res, tail = child(METADATA)
    if not check("user metadata child ran", res is not None, tail):
        return
    for context, (n, metas, actions, compiles) in res["contexts"].items():
        check(f"context={context}: every history entry carries the user metadata",
              n >= 2 and metas == ["metadata test"] and "alloc" in actions,
              f"{n} entries, metadata {metas}, actions {actions}")
        check(f"context={context}: outside torch.compile, compile_context is 'N/A'",
              compiles == ["N/A"], str(compiles))
    check("the metadata is cleared by ''", res["cleared"] == "", repr(res["cleared"]))
    check("each thread's entries carry its own metadata",
          res["threads"] == {"main": ["main"], "worker": ["worker"]}, str(res["threads"]))


COMPILE = """
import torch._dynamo
def f(x):
    y = torch.relu(x @ x + 1)
    torch._dynamo.graph_break()
    return torch.sigmoid(y @ y) * 2
cf = torch.compile(f, backend="eager")
x = torch.randn(128, 128, device="cuda")
torch.cuda.memory._record_memory_history("all", compile_context=True)
x_in = torch.randn(128, 128, device="cuda")
r = cf(x_in)
r2 = cf(x_in)
ss = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(None)
allocs = [e for e in ss["device_traces"][0] if e["action"] == "alloc"]
out["by_addr"] = {"input": [e["compile_context"] for e in allocs if e["addr"] == x_in.data_ptr()]}
out["sequence"] = [e["compile_context"] for e in allocs]
out["close"] = bool(torch.allclose(r, f(x_in)))
# With compile_context off, the same calls record "N/A".
torch.cuda.memory._record_memory_history("all")
cf(x_in)
ss = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(None)
out["off"] = sorted({e["compile_context"] for e in ss["device_traces"][0]})
print("RESULT " + json.dumps(out))
"""


def compile_checks():
    res, tail = child(COMPILE)
    if not check("torch.compile child ran", res is not None, tail):
        return
    seq = res["sequence"]
    regions = [c for c in seq if c.startswith("Torch-Compiled Region: ")]
    check("allocations inside compiled regions carry the region's marker",
          "Torch-Compiled Region: 0/0" in regions and "Torch-Compiled Region: 1/0" in regions,
          f"{len(seq)} allocations: {sorted(set(seq))}")
    check("an allocation outside compiled code carries 'N/A'",
          res["by_addr"]["input"] == ["N/A"], str(res["by_addr"]))
    check("the compiled function computed the same result", res["close"])
    check("compile_context=False: entries carry 'N/A'", res["off"] == ["N/A"], str(res["off"]))


ANNOTATIONS = """
t0 = time.time()
torch.cuda.memory._record_memory_history("all")
with torch.profiler.record_function("cachealloc_region"):
    z = torch.empty(1 << 20, device="cuda")
del z
s1 = torch.cuda.memory._snapshot()
s2 = torch.cuda.memory._snapshot()
t1 = time.time()
torch.cuda.memory._record_memory_history(None)
out["annotations"] = [{k: v for k, v in a.items() if k != "time_us"}
                      for a in s1["external_annotations"] if a.get("name") == "cachealloc_region"]
times = [a["time_us"] for a in s1["external_annotations"]] + \\
        [e["time_us"] for e in s1["device_traces"][0]]
out["times"] = [min(times), max(times), int(t0 * 1e6), int(t1 * 1e6)] if times else []
out["snapshots"] = [sum(e["action"] == "snapshot" for e in s["device_traces"][0]) for s in (s1, s2)]
print("RESULT " + json.dumps(out))
"""


def annotation_checks():
    res, tail = child(ANNOTATIONS)
    if not check("annotations child ran", res is not None, tail):
        return
    names = sorted((a.get("stage"), a.get("device")) for a in res["annotations"])
    check("record_function annotations appear in external_annotations (START and END)",
          names == [("END", 0), ("START", 0)], str(res["annotations"]))
    t = res["times"]
    check("time_us of entries and annotations is microseconds since the epoch",
          bool(t) and t[2] - 60_000_000 <= t[0] <= t[1] <= t[3] + 60_000_000, str(t))
    check("a snapshot adds a 'snapshot' entry that the next snapshot shows",
          res["snapshots"] == [0, 1], str(res["snapshots"]))


KEYS = """
import gc
torch.cuda.memory._record_memory_history("all")
a = torch.empty(1 << 20, device="cuda")
b = torch.empty(300, device="cuda")
with torch.profiler.record_function("cachealloc_keys"):
    c = torch.empty(5000, device="cuda")
del b
torch.cuda.synchronize()
s = torch.cuda.memory._snapshot()
s = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(None)
keys = {"top": sorted(s)}
keys["segment"] = sorted({k for seg in s["segments"] for k in seg})
keys["block"] = sorted({k for seg in s["segments"] for bl in seg["blocks"] for k in bl})
keys["block_states"] = sorted({bl["state"] for seg in s["segments"] for bl in seg["blocks"]})
keys["settings"] = sorted(s["allocator_settings"])
keys["annotation"] = sorted({k for an in s["external_annotations"] for k in an})
keys["frame"] = sorted({k for seg in s["segments"] for bl in seg["blocks"]
                        for f in bl.get("frames", []) for k in f})
entries = {}
for e in s["device_traces"][0]:
    entries.setdefault(e["action"], set()).update(e)
keys["entries"] = {k: sorted(v) for k, v in entries.items()}
out["keys"] = keys
print("RESULT " + json.dumps(out))
"""


def key_checks():
    mine, tail = child(KEYS)
    native, ntail = child(KEYS, {"NATIVE": "1"})
    if not (check("snapshot keys child ran (cachealloc)", mine is not None, tail)
            and check("snapshot keys child ran (PyTorch's allocator)", native is not None, ntail)):
        return
    m, n = mine["keys"], native["keys"]
    for part in ("top", "segment", "block", "settings", "annotation", "frame"):
        check(f"snapshot {part} keys are PyTorch's", m[part] == n[part],
              f"cachealloc {m[part]} vs PyTorch {n[part]}")
    check("block states are PyTorch's names",
          set(m["block_states"]) <= {"active_allocated", "active_pending_free", "inactive"},
          str(m["block_states"]))
    common = sorted(set(m["entries"]) & set(n["entries"]))
    diff = {a: (m["entries"][a], n["entries"][a]) for a in common
            if m["entries"][a] != n["entries"][a]}
    check("history entries have PyTorch's keys for each action both record",
          {"alloc", "free_requested", "free_completed", "snapshot"} <= set(common) and not diff,
          f"actions {common}; differences {diff}")


VIZ = """
import copy, pickle, tempfile
from torch.cuda import _memory_viz as viz
torch.cuda.memory._record_memory_history("all")
xs = [torch.empty(n << 10, device="cuda") for n in (1, 7, 300, 4096)]
del xs[1]
y = torch.empty(5 << 20, device="cuda")
d = tempfile.mkdtemp()
path = os.path.join(d, "snap.pickle")
torch.cuda.memory._dump_snapshot(path)
torch.cuda.memory._record_memory_history(None)
with open(path, "rb") as f:
    s = pickle.load(f)
html = {
    "trace_plot": viz.trace_plot(copy.deepcopy(s)),
    "trace_plot segments": viz.trace_plot(copy.deepcopy(s), plot_segments=True),
    "trace_plot filter_freed": viz.trace_plot(copy.deepcopy(s), filter_freed=True),
    "segment_plot": viz.segment_plot(copy.deepcopy(s)),
}
out["html"] = {k: len(v) for k, v in html.items() if "MemoryViz" in v}
out["segsum"] = viz.segsum(copy.deepcopy(s)).count("\\n")
out["trace"] = viz.trace(copy.deepcopy(s)).count("\\n")
ident = lambda lines: lines
out["flame"] = [len(viz.memory(copy.deepcopy(s), format_flamegraph=ident)),
                len(viz.segments(copy.deepcopy(s), format_flamegraph=ident))]
cli = subprocess_out = None
import subprocess
r = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", path,
                    "-o", os.path.join(d, "trace.html")], capture_output=True, text=True)
out["cli"] = [r.returncode, os.path.getsize(os.path.join(d, "trace.html"))
              if os.path.exists(os.path.join(d, "trace.html")) else 0, r.stderr[-300:]]
print("RESULT " + json.dumps(out))
"""


def viz_checks():
    res, tail = child(VIZ)
    if not check("memory-viz child ran", res is not None, tail):
        return
    check("trace_plot (plain, segments, filter_freed) and segment_plot render a dumped snapshot",
          len(res["html"]) == 4, str(res["html"]))
    check("segsum and trace print the snapshot", res["segsum"] > 2 and res["trace"] > 5,
          f"{res['segsum']} and {res['trace']} lines")
    check("memory and segments flame-graph lines", all(n > 0 for n in res["flame"]),
          str(res["flame"]))
    check("python -m torch.cuda._memory_viz trace_plot writes the page",
          res["cli"][0] == 0 and res["cli"][1] > 1000, str(res["cli"]))


# PyTorch's viewer's "Allocator State History" (MemoryViz.js: annotate_snapshot
# and simulate_memory), in Python: undoes the history from the snapshot's
# segments back to each earlier event and returns where the viewer would
# break (a block in no segment, a free_requested of no block, a segment
# entry undoing a segment it does not have), or None.
SEGMENT_VIEW = """
def segment_view_breaks(snapshot, device=0):
    segs = []
    blocks = {}
    for seg in snapshot["segments"]:
        if seg["device"] != device:
            continue
        segs.append([seg["address"], seg["total_size"], seg["stream"]])
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] in ("active_allocated", "active_pending_free"):
                blocks[addr] = b["size"]
            addr += b["size"]
    events = []
    for e in snapshot["device_traces"][device]:
        if (e["action"] == "free_completed" and events
                and events[-1]["action"] == "free_requested" and events[-1]["addr"] == e["addr"]):
            events[-1] = dict(events[-1], action="free")
            continue
        events.append(e)

    def inside(addr):
        return any(a <= addr < a + n for a, n, _ in segs)

    def unmap(seg, merge):
        a, n = seg
        for i, (sa, sn, st) in enumerate(segs):
            if (not merge and sa == a) or (merge and sa <= a and a + n <= sa + sn):
                if not merge or (sa == a and sn == n):
                    segs.pop(i)
                elif sa == a:
                    segs[i] = [a + n, sn - n, st]
                elif sa + sn == a + n:
                    segs[i] = [sa, sn - n, st]
                else:
                    segs[i] = [sa, a - sa, st]
                    segs.append([a + n, sa + sn - a - n, st])
                return True
        return False

    for i in range(len(events) - 1, -1, -1):
        bad = [a for a in blocks if not inside(a)]
        if bad:
            return f"before event {i + 1} ({events[i + 1]['action']}): block {bad[0]:#x} in no segment"
        e = events[i]
        act = e["action"]
        if act in ("free", "free_completed"):
            blocks[e["addr"]] = e["size"]
        elif act == "free_requested":
            if e["addr"] not in blocks:
                return f"event {i}: free_requested of {e['addr']:#x}, no such block"
        elif act == "alloc":
            blocks.pop(e["addr"], None)
        elif act in ("segment_free", "segment_unmap"):
            segs.append([e["addr"], e["size"], e["stream"]])
        elif act in ("segment_alloc", "segment_map"):
            if not unmap((e["addr"], e["size"]), act == "segment_map"):
                return f"event {i}: {act} of {e['addr']:#x}, no such segment"
    bad = [a for a in blocks if not inside(a)]
    return f"at the start: block {bad[0]:#x} in no segment" if bad else None
"""

SEGMENTS = SEGMENT_VIEW + """
import gc
torch.cuda.memory._record_memory_history("all")
big = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (1, 3, 30, 50, 90)]
small = [torch.empty(1000, device="cuda") for _ in range(10)]
del big[2], big[3]
del small[2:]
gc.collect()
torch.cuda.empty_cache()
b = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
del b
torch.cuda.empty_cache()
c = torch.empty(12 << 20, dtype=torch.uint8, device="cuda")
s = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(None)
out["actions"] = sorted({e["action"] for e in s["device_traces"][0]})
out["breaks"] = segment_view_breaks(s)
print("RESULT " + json.dumps(out))
"""


def segment_view_checks():
    for label, env in (("PyTorch's allocator", {"NATIVE": "1"}),
                       ("cachealloc, plain segments", {"CACHEALLOC_CONF": "segments"}),
                       ("cachealloc, default", {})):
        res, tail = child(SEGMENTS, env)
        if not check(f"segment history child ran ({label})", res is not None, tail):
            continue
        check(f"{label}: the viewer's Allocator State History undoes the whole history",
              res["breaks"] is None, f"{res['breaks']}; actions {res['actions']}")
        if "plain" in label or "PyTorch" in label:
            check(f"{label}: segment_alloc and segment_free entries are recorded",
                  {"segment_alloc", "segment_free"} <= set(res["actions"]), str(res["actions"]))


RECLAIM = """
n = int(os.environ["SIDE_STREAMS"])
size = 1 << 20
sides = [torch.cuda.Stream() for _ in range(n)]
g = torch.cuda.CUDAGraph()
torch.cuda.synchronize()
with torch.cuda.graph(g):
    cur = torch.cuda.current_stream()
    x = torch.ones(size, device="cuda")
    outs = []
    for s in sides:
        s.wait_stream(cur)
        with torch.cuda.stream(s):
            outs.append(x * 2)
        x.record_stream(s)
    for s in sides:
        cur.wait_stream(s)
    x_ptr = x.data_ptr()
    del x
    y = torch.empty(size, device="cuda")
    joined = y.data_ptr() == x_ptr
    y.fill_(5)
    # Freed while a side stream's use is not yet joined back.
    z = torch.ones(size, device="cuda")
    sides[0].wait_stream(cur)
    with torch.cuda.stream(sides[0]):
        w = z * 3
    z.record_stream(sides[0])
    z_ptr = z.data_ptr()
    del z
    v = torch.empty(size, device="cuda")
    unjoined = v.data_ptr() == z_ptr
    v.fill_(7)
    cur.wait_stream(sides[0])
for _ in range(3):
    g.replay()
torch.cuda.synchronize()
out["reuse"] = [joined, unjoined]
out["values"] = [all(bool((o == 2).all()) for o in outs), bool((w == 3).all()),
                 bool((y == 5).all()), bool((v == 7).all())]
print("RESULT " + json.dumps(out))
"""


def reclaim_checks():
    for n in (2, 4):
        for setting in (True, False):
            env = {"SIDE_STREAMS": str(n)}
            if setting:
                env["PYTORCH_CUDA_ALLOC_CONF"] = "graph_capture_record_stream_reuse:True"
            mine, tail = child(RECLAIM, env)
            native, ntail = child(RECLAIM, dict(env, NATIVE="1"))
            name = f"capture with {n} side streams, graph_capture_record_stream_reuse:{setting}"
            if not (check(f"{name}: ran (cachealloc)", mine is not None, tail)
                    and check(f"{name}: ran (PyTorch's allocator)", native is not None, ntail)):
                continue
            check(f"{name}: blocks reused where PyTorch's allocator reuses them "
                  "(after the join, before it)", mine["reuse"] == native["reuse"],
                  f"cachealloc {mine['reuse']}, PyTorch {native['reuse']}")
            if setting:
                check(f"{name}: the freed block is reused after the join, not before",
                      mine["reuse"] == [True, False], str(mine["reuse"]))
            check(f"{name}: replays compute the right values", all(mine["values"]),
                  str(mine["values"]))


def main():
    global SO
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib")
    a = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        skip(f"PyTorch is not installed ({e})")
    import cachealloc_torch as ca
    try:
        SO = ca.library_path(a.lib)
    except FileNotFoundError as e:
        skip(str(e))
    if not torch.cuda.is_available():
        skip("no CUDA device visible to PyTorch")
    if not hasattr(torch, "accelerator") or not hasattr(torch.accelerator, "memory_stats"):
        skip(f"torch {torch.__version__} has no torch.accelerator.memory_stats")
    print(f"library {SO}; torch {torch.__version__}", flush=True)
    accelerator_checks()
    metadata_checks()
    compile_checks()
    annotation_checks()
    key_checks()
    viz_checks()
    segment_view_checks()
    reclaim_checks()
    print(f"\n{'FAILED: ' + ', '.join(FAILED) if FAILED else 'all checks passed'}", flush=True)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
