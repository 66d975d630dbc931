"""Side-by-side PyTorch training on native PyTorch allocators and on cachealloc.

One command on the GPU machine runs real workloads (python/workloads.py: nmt,
cnn_multiscale and the corpus programs of python/corpus/) once per allocator
variant, each run in its own process, with the same seeds and steps, and prints
tables: per run the median step time, peak reserved, peak allocated, their ratio,
flush-and-retries, OOMs and how the run ended; the step time paired by step
against a baseline's; whether torch.cuda.empty_cache() after training gave
memory back to the driver, and its time per GiB returned; with --stats, paired
step-time ratios with bootstrap confidence intervals and driver calls a step.

    python3 python/harness.py                                    # default variants, nmt and cnn_multiscale
    python3 python/harness.py --variants native,cachealloc --steps nmt=60,cnn_multiscale=60
    python3 python/harness.py --workloads gpt2_finetune,gpt2_finetune+ec --steps 30
    python3 python/harness.py --stats --gpus 4 --workloads gpt2_finetune,moe_train --steps 25
    python3 python/harness.py --stats --share-process --gpus 2 --results R.jsonl ...   # one process
                                                        # per variant and round, results kept as they come
    python3 python/harness.py --analyze R1.jsonl R2.jsonl --stats   # the tables of earlier calls
    python3 python/harness.py --cap-bytes 13780000000            # + capped nmt runs
    python3 python/harness.py --smoke                            # a few steps, to catch errors
    python3 python/harness.py --dry-run --stats --gpus 4 ...     # the plan and its time estimate only
    python3 python/harness.py --selftest                         # checks of the statistics, no torch

Workloads (--workloads, comma-separated): the names of python/workloads.py's WORKLOADS.
NAME+ec runs NAME's steps with gc.collect() and torch.cuda.empty_cache() at the end of
every step, inside the timed step (before the synchronize that ends it); each step's
gc.collect() time is kept in the results (gc_seconds).
Steps (--steps): NAME=N items, comma-separated, and a bare N for every workload not
named; NAME+ec takes NAME's count unless it is given its own. Defaults: nmt 120,
cnn_multiscale 80, a corpus program its step cap in python/corpus/; --smoke: 8 each.

Variants (--variants and --cap-variants, comma-separated, or `;`-separated when a CONF has commas; order kept):
    native                  PyTorch's caching allocator, default settings
    native-expandable       PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    cachealloc              libcachealloc.so through PyTorch's C++ allocator interface,
                            CACHEALLOC_CONF=default (the default preset: expandable segments, CUDA VMM)
    cachealloc-segments     the same, CACHEALLOC_CONF=segments (the plain-segment policy)
    cachealloc-expandable   the same, CACHEALLOC_CONF=expandable
    cachealloc-pluggable    libcachealloc.so through CUDAPluggableAllocator, CACHEALLOC_CONF=default
    native:CONF             PyTorch with PYTORCH_CUDA_ALLOC_CONF=CONF
    cachealloc:CONF         cachealloc with CACHEALLOC_CONF=CONF (e.g. cachealloc:pytorch)
Default: native, native-expandable, cachealloc, cachealloc-segments.

Capped runs (--cap-bytes N): the --cap-workload (nmt) also runs once per
--cap-variants (native,cachealloc) with torch.cuda.set_per_process_memory_fraction(
N / total device memory), the fraction computed in the process from
torch.cuda.mem_get_info(). cachealloc receives it through its memory-fraction hook.

Step time: torch.cuda.synchronize() at the end of each step, perf_counter, median
over the steps after --warmup. With --rounds N each variant runs N times per
workload, every other round in reverse order (run order matters: a process's GPU
and host warm up differently); the paired table divides each step's time by the
baseline runs' mean time for the same step (the seed fixes the shapes) and takes
the median, pooled over the rounds. Peak reserved/allocated: torch.cuda.max_memory_*()
(PyTorch's own functions; for cachealloc-pluggable, where they raise, the
cachealloc_torch module's mirrors of them).

Statistics (--stats; --rounds defaults to 5 and must be at least 5): for every
workload and variant, ratio(r, i) = step i's time in round r / native's step i in
round r (same shapes; round r of every variant ran close in time), over the steps
after the warm-up of the completed runs. Reported: the median of the pooled ratios
and a 95% interval from a two-level bootstrap (rounds drawn with replacement, then
the steps within each drawn round; --bootstrap resamples, default 2000, fixed seed);
the same against native-expandable when it ran; medians over the rounds of peak
reserved / peak allocated and of device allocations and frees a run; and, a step
after the warm-up, cachealloc's map, unmap, page-release and page-create calls and
the device allocations + frees (num_device_alloc + num_device_free; for native
variants from torch.cuda.memory_stats()), each counter read at the end of the
warm-up and at the end of training.

Several GPUs (--gpus N): up to N runs at once, one per GPU, each process with
CUDA_VISIBLE_DEVICES set to one index (taken from the inherited CUDA_VISIBLE_DEVICES
list, else 0..N-1; with N = 1 the environment is left as it is). Every run of one
workload (all rounds and variants, capped runs too) goes to the same GPU and runs
there in the order above; workloads are spread over the GPUs by estimated cost
(a rough model of a run's time), largest first onto the least loaded GPU.
With --spread-rounds the unit is one round of a workload instead: every variant of
round r still runs on one GPU, one after the other, so the pairing by round holds,
while the rounds of a long workload run on several GPUs at once (the bootstrap
over rounds then also spans the GPUs' differences).
Each result records its GPU. Workers' lines carry their run's tag on stdout and in
--log; one line per finished run gives the time elapsed and an estimate of the time left.

Output: the tables on stdout and in --markdown; --json: the list of results, or with
--stats an object {"results": [...], "stats": [...]}. Exit status 1 when a run fails
(an OOM of a capped run does not count).
"""

import argparse
import ast
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT_TAG = "HARNESS_RESULT "
# figures() entries that count events from the process's start: a batch's later workloads
# report them counted from their own start.
COUNT_FIGURES = ("retries", "ooms", "device_allocs", "device_frees", "maps", "unmaps",
                 "page_releases", "syncs", "marker_waits", "event_waits", "stream_waits",
                 "borrowed", "revived", "releases_paused", "other_kind_fits", "segments_paged",
                 "pages_rebacked", "pages_shared")
DEFAULT_VARIANTS = "native,native-expandable,cachealloc,cachealloc-segments"
DEFAULT_STEPS = {"nmt": 120, "cnn_multiscale": 80}  # the lengths of the shared traces
SMOKE_STEPS = 8
STATS_MIN_ROUNDS = 5
EC_SUFFIX = "+ec"

ALIASES = {
    "native": ("native", None),
    "native-expandable": ("native", "expandable_segments:True"),
    "cachealloc": ("cachealloc", "default"),
    "cachealloc-segments": ("cachealloc", "segments"),
    "cachealloc-expandable": ("cachealloc", "expandable"),
    "cachealloc-pluggable": ("cachealloc", "default"),
}

# The allocator counters read at the end of the warm-up and at the end of training
# (whichever of them the allocator in use reports).
COUNTER_KEYS = ("num_map", "num_unmap", "num_page_release", "num_page_create",
                "num_device_alloc", "num_device_free", "num_sync_all_streams",
                "num_alloc_retries", "num_marker_waits", "num_event_waits")

# A rough cost model of one run, only used to spread workloads over GPUs and for the first
# estimate of the time left: a worker process's time outside the steps, the first step (it
# builds the model), and the later steps' mean time. Figures of native runs on H200s
# (torch 2.11, 25-100 steps); a workload not listed counts as EST_FIRST_STEP_UNKNOWN and
# EST_STEP_UNKNOWN. NAME+ec steps: x EST_EC_FACTOR + EST_EC_SECONDS (gc.collect() alone
# took about 0.09 s in these processes).
EST_PROCESS_SECONDS = 7.0
EST_FIRST_STEP_SECONDS = dict(gpt2_finetune=18.0, moe_train=11.0, detection_frcnn=8.0,
                              speech_ctc=7.0, cnn_multiscale=7.0, multistream_infer=7.0,
                              kv_cat_generate=6.0, llm_serving=5.0)
EST_FIRST_STEP_UNKNOWN = 8.0
EST_STEP_SECONDS = dict(nmt=0.45, cnn_multiscale=0.035, gpt2_finetune=0.24, llm_serving=0.05,
                        moe_train=0.34, detection_frcnn=0.25, speech_ctc=0.22,
                        multistream_infer=0.065, kv_cat_generate=3.2, lstm_lm=0.045,
                        seq2seq_beam=5.0, dit_sampling=0.075, ppo_rollout=0.26)
EST_STEP_UNKNOWN = 0.2
EST_EC_FACTOR = 1.5
EST_EC_SECONDS = 0.1


def parse_variant(name):
    """'native' / 'cachealloc-expandable' / 'cachealloc:pytorch' -> (kind, conf)."""
    if name in ALIASES:
        return ALIASES[name]
    kind, sep, conf = name.partition(":")
    if kind not in ("native", "cachealloc") or not sep or not conf:
        raise SystemExit(f"unknown variant {name!r} (known: {', '.join(ALIASES)}, native:CONF, "
                         "cachealloc:CONF)")
    return kind, conf


def variant_env(name, gpu=None):
    """The worker's environment for a variant; gpu: CUDA_VISIBLE_DEVICES for the process."""
    kind, conf = parse_variant(name)
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("CACHEALLOC_CONF", None)
    env["PYTHONUNBUFFERED"] = "1"
    if kind == "native" and conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    if kind == "cachealloc":
        env["CACHEALLOC_CONF"] = conf
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


def parse_workload(name):
    """'gpt2_finetune+ec' -> ('gpt2_finetune', True); 'nmt' -> ('nmt', False)."""
    if name.endswith(EC_SUFFIX) and len(name) > len(EC_SUFFIX):
        return name[:-len(EC_SUFFIX)], True
    return name, False


def corpus_step_caps():
    """{program: step cap} of python/corpus/'s FAMILIES, HOLDOUT and HOLDOUT2, read from the
    source (no torch needed), and whether all three were found."""
    caps, complete = {}, True
    for fname, var in (("families.py", "FAMILIES"), ("holdout.py", "HOLDOUT"),
                       ("holdout2.py", "HOLDOUT2")):
        found = False
        try:
            with open(os.path.join(HERE, "corpus", fname)) as f:
                tree = ast.parse(f.read())
        except (OSError, SyntaxError):
            complete = False
            continue
        for node in tree.body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and any(isinstance(t, ast.Name) and t.id == var for t in node.targets)):
                for kw in node.value.keywords:
                    v = kw.value
                    if (kw.arg and isinstance(v, ast.Tuple) and len(v.elts) == 2
                            and isinstance(v.elts[1], ast.Constant)):
                        caps[kw.arg] = int(v.elts[1].value)
                        found = True
        complete = complete and found
    return caps, complete


def parse_steps(text):
    """'30,llm_serving=100' -> ({'llm_serving': 100}, 30): named counts and the bare one."""
    named, bare = {}, None
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        k, sep, v = item.partition("=")
        try:
            if sep:
                named[k.strip()] = int(v)
            else:
                bare = int(k)
        except ValueError:
            raise SystemExit(f"--steps: cannot read {item!r} (NAME=N or N)")
    return named, bare


def steps_for(workload, named, bare, defaults):
    """The step count of a workload: its own item, its base's (for NAME+ec), the bare
    count, then the default of the workload or of its base; None if none applies."""
    base, _ = parse_workload(workload)
    for k in (workload, base):
        if k in named:
            return named[k]
    if bare is not None:
        return bare
    for k in (workload, base):
        if k in defaults:
            return defaults[k]
    return None


def est_run_seconds(spec):
    """A rough cost of one run, for spreading workloads over GPUs and the time left."""
    base, ec = parse_workload(spec["workload"])
    step = EST_STEP_SECONDS.get(base, EST_STEP_UNKNOWN)
    if ec:
        step = step * EST_EC_FACTOR + EST_EC_SECONDS
    return (EST_PROCESS_SECONDS + EST_FIRST_STEP_SECONDS.get(base, EST_FIRST_STEP_UNKNOWN)
            + max(0, spec["steps"] - 1) * step)


def assign_gpus(costs, n):
    """{group: cost} -> {group: lane 0..n-1}: largest first onto the least loaded lane
    (ties: the lower lane; groups of equal cost keep their order)."""
    load = [0.0] * max(1, n)
    out = {}
    for g in sorted(costs, key=lambda g: -costs[g]):
        j = min(range(len(load)), key=lambda i: (load[i], i))
        out[g] = j
        load[j] += costs[g]
    return out


def per_step(c0, c1, steps):
    """Counter increments a step between two readings; keys missing from either are left out."""
    if not c0 or not c1 or not steps or steps <= 0:
        return {}
    return {k: (c1[k] - c0[k]) / steps for k in c1
            if k in c0 and c0[k] is not None and c1[k] is not None}


def empty_cache_ms_per_gib(r):
    """empty_cache milliseconds per GiB of reserved memory returned; None if nothing was."""
    e, s = r.get("empty_cache"), r.get("empty_cache_seconds")
    if not e or s is None:
        return None
    freed = (e.get("reserved_before") or 0) - (e.get("reserved_after") or 0)
    return s * 1e3 / (freed / 2**30) if freed > 0 else None


def gib(b):
    return "–" if b is None else f"{b / 2**30:.2f} GiB"


def median_after_warmup(times, warmup):
    t = times[warmup:] if len(times) > warmup else times
    return statistics.median(t) if t else None


def duration(s):
    s = max(0, int(round(s)))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# ---------------------------------------------------------------- worker

_ENABLED_LIB = []  # the library cachealloc was enabled from in this worker process


def worker(spec):
    """Runs one workload under one allocator variant in this process -> its result. A process
    may run several (worker_batch): a later one starts after the earlier one's model and
    cache are gone, with the peak statistics reset, and its counters count from its start."""
    kind, conf = parse_variant(spec["variant"])
    base, ec = parse_workload(spec["workload"])
    res = dict(spec, kind=kind, conf=conf, empty_cache_every_step=ec, status="not started")
    t_import = time.perf_counter()
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import torch
    ca = None
    if kind == "cachealloc":
        import cachealloc_torch as ca
        mode = "pluggable" if spec["variant"].startswith("cachealloc-pluggable") else "cpp"
        if not _ENABLED_LIB:
            _ENABLED_LIB.append(ca.enable(spec.get("lib"), mode=mode))
        res["lib"] = _ENABLED_LIB[0]
        res["mode"] = ca.mode()
    import workloads
    torch.cuda.init()
    later = spec.get("batch_index", 0) > 0
    if later:
        torch.cuda.reset_peak_memory_stats()
    free0, total = torch.cuda.mem_get_info()
    res.update(device=torch.cuda.get_device_name(), torch=torch.__version__,
               device_total=total, device_free_at_start=free0)
    if spec.get("cap_bytes"):
        frac = spec["cap_bytes"] / total
        res["cap_fraction"] = frac
        torch.cuda.set_per_process_memory_fraction(frac)
        print(f"capped: {spec['cap_bytes']} bytes = fraction {frac:.6f} of {total}", flush=True)
    if ca is not None:
        inf = ca.info()
        res.update(cachealloc_config=inf["config"], notices=inf["notices"],
                   expandable=inf["expandable"], memory_cap=inf["memory_cap"])
        for n in inf["notices"]:
            print(f"cachealloc notice: {n}", flush=True)

    def counters():
        # The driver-call counters: cachealloc's own (num_map, ...) where it is installed,
        # else PyTorch's memory_stats(); any key may be missing.
        try:
            if ca is None:
                st, extra = torch.cuda.memory_stats(), {}
            elif ca.mode() == "cpp":
                st, extra = torch.cuda.memory_stats(), ca.cachealloc_stats()
            else:
                st = extra = ca.memory_stats()
        except Exception as e:  # the figures are optional; the run's result is not
            print(f"counters not read: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return {}
        out = {}
        for k in COUNTER_KEYS:
            v = extra.get(k, st.get(k))
            if v is not None:
                out[k] = v
        return out

    def figures():
        # PyTorch's own functions, unless cachealloc is installed through the
        # pluggable interface, where they raise (then the module's mirrors).
        if ca is None or ca.mode() == "cpp":
            st = torch.cuda.memory_stats()
            extra = ca.cachealloc_stats() if ca is not None else {}
            return dict(reserved=torch.cuda.memory_reserved(),
                        allocated=torch.cuda.memory_allocated(),
                        peak_reserved=torch.cuda.max_memory_reserved(),
                        peak_allocated=torch.cuda.max_memory_allocated(),
                        retries=st.get("num_alloc_retries", 0), ooms=st.get("num_ooms", 0),
                        device_allocs=st.get("num_device_alloc"),
                        device_frees=st.get("num_device_free"),
                        maps=extra.get("num_map"), unmaps=extra.get("num_unmap"),
                        page_releases=extra.get("num_page_release"),
                        syncs=st.get("num_sync_all_streams"),
                        marker_waits=extra.get("num_marker_waits"),
                        event_waits=extra.get("num_event_waits"),
                        stream_waits=extra.get("num_stream_waits"),
                        borrowed=extra.get("num_blocks_borrowed"),
                        revived=extra.get("num_pages_revived"),
                        releases_paused=extra.get("num_releases_paused"),
                        other_kind_fits=extra.get("num_other_kind_fits"),
                        segments_paged=extra.get("num_segments_paged"),
                        pages_rebacked=extra.get("num_pages_rebacked"),
                        pages_shared=extra.get("num_pages_shared"))
        st = ca.memory_stats()
        return dict(reserved=st["reserved_bytes.all.current"],
                    allocated=st["allocated_bytes.all.current"],
                    peak_reserved=st["reserved_bytes.all.peak"],
                    peak_allocated=st["allocated_bytes.all.peak"],
                    retries=st["num_alloc_retries"], ooms=st["num_ooms"],
                    device_allocs=st["num_device_alloc"], device_frees=st["num_device_free"],
                    maps=st.get("num_map"), unmaps=st.get("num_unmap"),
                    page_releases=st.get("num_page_release"),
                    syncs=st.get("num_sync_all_streams"),
                    marker_waits=st.get("num_marker_waits"),
                    event_waits=st.get("num_event_waits"),
                    stream_waits=st.get("num_stream_waits"),
                    borrowed=st.get("num_blocks_borrowed"),
                    revived=st.get("num_pages_revived"),
                    releases_paused=st.get("num_releases_paused"),
                    other_kind_fits=st.get("num_other_kind_fits"),
                    segments_paged=st.get("num_segments_paged"),
                    pages_rebacked=st.get("num_pages_rebacked"),
                    pages_shared=st.get("num_pages_shared"))

    start = figures()  # the counters before this workload (a batch's later ones)

    torch.manual_seed(spec["seed"])
    gen = workloads.WORKLOADS[base](spec["steps"], spec["seed"])
    warmup = spec["warmup"]
    times, gc_times = [], []
    c_warm = counters() if warmup <= 0 else None
    c_end = None
    res["status"] = "completed"
    t_start = time.perf_counter()
    t = t_start
    try:
        for _ in gen:
            if ec:
                t_gc = time.perf_counter()
                gc.collect()
                gc_times.append(time.perf_counter() - t_gc)
                torch.cuda.empty_cache()
            torch.cuda.synchronize()
            now = time.perf_counter()
            times.append(now - t)
            if len(times) == warmup:  # end of the warm-up: read outside the timed steps
                c_warm = counters()
                now = time.perf_counter()
            t = now
    except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError
        msg = str(e)
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in msg.lower()
        res["status"] = (f"OOM at step {len(times) + 1}/{spec['steps']}" if oom else
                         f"{type(e).__name__} at step {len(times) + 1}/{spec['steps']}")
        res["error"] = msg[:1500]
        print(f"{res['status']}: {msg[:600]}", flush=True)
    finally:
        c_end = counters()
        gen.close()
    res["seconds_training"] = time.perf_counter() - t_start
    res["seconds_since_import"] = time.perf_counter() - t_import
    res["steps_done"] = len(times)
    res["step_times"] = [round(x, 7) for x in times]
    if ec:  # the host time of each step's gc.collect(), a part of its step time
        res["gc_seconds"] = [round(x, 7) for x in gc_times]
        res["gc_median"] = median_after_warmup(gc_times, warmup)
    res["median_step"] = median_after_warmup(times, warmup)
    res["mean_step"] = (statistics.mean(times[warmup:]) if len(times) > warmup else None)
    n_after = len(times) - max(0, warmup)
    res["counters_after_warmup"] = c_warm
    res["counters_end"] = c_end
    res["steps_after_warmup"] = max(0, n_after)
    res["per_step_after_warmup"] = per_step(c_warm, c_end, n_after)
    del gen
    gc.collect()
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:  # a sticky CUDA error: nothing more can be read
        res["after_error"] = str(e)[:500]
        return res

    before = figures()
    before_raw = dict(before)
    for k in COUNT_FIGURES:
        if before.get(k) is not None and start.get(k) is not None:
            before[k] -= start[k]
    res.update({k: v for k, v in before.items() if k not in ("reserved", "allocated")})
    res["ratio"] = (before["peak_reserved"] / before["peak_allocated"]
                    if before["peak_allocated"] else None)
    # empty_cache: does the driver get the memory back, and do the stats say so?
    free_before = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    res["empty_cache_seconds"] = time.perf_counter() - t0
    free_after = torch.cuda.mem_get_info()[0]
    after = figures()
    res["empty_cache"] = dict(reserved_before=before["reserved"], reserved_after=after["reserved"],
                              allocated_after=after["allocated"],
                              driver_free_before=free_before, driver_free_after=free_after,
                              driver_free_gain=free_after - free_before)
    res["empty_cache"]["ms_per_gib_returned"] = empty_cache_ms_per_gib(res)
    # The driver calls empty_cache made (where the allocator counts them).
    res["empty_cache"]["calls"] = {k: after[k] - before_raw[k]
                                   for k in ("unmaps", "page_releases", "device_frees", "syncs")
                                   if after.get(k) is not None and before_raw.get(k) is not None}
    if ca is not None:
        res["abi_errors"] = ca.error_count()
        res["fragmentation_after"] = ca.fragmentation_stats()
    return res


# ---------------------------------------------------------------- parent

class Runner:
    """Runs specs in worker processes, one lane of specs per GPU at a time; keeps the
    output of concurrent lanes in whole, tagged lines and reports progress."""

    def __init__(self, timeout, log, total, est, results_file=None):
        self.timeout, self.log, self.total = timeout, log, total
        self.results_file = results_file  # each finished run's result, a JSON line each
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.done, self.actual, self.estimated = 0, 0.0, 0.0
        self.est = est              # spec index -> estimated seconds
        self.lane_left = {}         # lane -> estimated seconds of its runs not finished
        self.procs = set()

    def say(self, line, to_log=False):
        with self.lock:
            print(line, flush=True)
            if to_log and self.log:
                self.log.write(line + "\n")
                self.log.flush()

    def finished(self, idx, lane, wall):
        """The progress note of a finished run: elapsed, and the time left estimated from the
        lanes' remaining runs, scaled by the runs so far (actual / estimated seconds)."""
        with self.lock:
            self.done += 1
            self.actual += wall
            self.estimated += self.est[idx]
            self.lane_left[lane] -= self.est[idx]
            scale = self.actual / self.estimated if self.estimated > 0 else 1.0
            left = max(self.lane_left.values()) * scale if self.done < self.total else 0.0
            return (f"{self.done}/{self.total} runs done, {duration(time.perf_counter() - self.t0)} "
                    f"elapsed, about {duration(left)} left")

    def run_job(self, idxs, specs, lane):
        """Runs specs[idxs] (one variant; several workloads with --share-process) one after
        the other in one worker process -> their results."""
        job = [dict(specs[i], batch_index=k) for k, i in enumerate(idxs)]
        spec = job[0]
        env = variant_env(spec["variant"], spec.get("cuda_visible_devices"))
        names = "+".join(s["workload"] for s in job) if len(job) > 1 else spec["workload"]
        tag = (f"[{'gpu' + str(spec['gpu']) + ' ' if spec.get('gpu') is not None else ''}"
               f"{names}/{spec['variant']}"
               f"{'/capped' if spec.get('cap_bytes') else ''} r{spec.get('round', 1)}]")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker",
               json.dumps(job if len(job) > 1 else specs[idxs[0]])]
        self.say(f"==> {tag} {', '.join(str(s['steps']) for s in job)} steps, seed {spec['seed']}"
                 + (f", CACHEALLOC_CONF={env['CACHEALLOC_CONF']}" if "CACHEALLOC_CONF" in env else "")
                 + (f", PYTORCH_CUDA_ALLOC_CONF={env['PYTORCH_CUDA_ALLOC_CONF']}"
                    if "PYTORCH_CUDA_ALLOC_CONF" in env else ""), to_log=True)
        t0 = time.perf_counter()
        results, killed, status = {}, [], None
        try:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, bufsize=1)
        except OSError as e:
            proc, status = None, f"process not started: {e}"
        if proc is not None:
            with self.lock:
                self.procs.add(proc)

            def kill():
                killed.append(True)
                proc.kill()
            timer = threading.Timer(self.timeout * len(job), kill)
            timer.start()
            t_last = t0
            try:
                for line in proc.stdout:
                    if line.startswith(RESULT_TAG):
                        try:
                            r = json.loads(line[len(RESULT_TAG):])
                        except ValueError:
                            self.say(f"  {tag} unreadable result line", to_log=True)
                            continue
                        k = r.get("batch_index", 0)
                        now = time.perf_counter()
                        r["process_seconds"] = now - t_last  # this workload's share
                        t_last = now
                        results[k] = r
                        self.report(idxs[k], lane, tag, r)
                    else:
                        self.say(f"  {tag} {line.rstrip()}", to_log=True)
                proc.wait()
            finally:
                timer.cancel()
                with self.lock:
                    self.procs.discard(proc)
            status = (f"timed out after {self.timeout * len(job):.0f} s" if killed
                      else f"process failed (exit {proc.returncode})")
        out = []
        for k, i in enumerate(idxs):
            r = results.get(k)
            if r is None:
                r = dict(specs[i], status=status, process_seconds=0.0)
                self.report(i, lane, tag, r)
            r["exit_code"] = proc.returncode if proc is not None else None
            out.append(r)
        return out

    def report(self, idx, lane, tag, result):
        progress = self.finished(idx, lane, result.get("process_seconds", 0.0))
        if self.results_file:
            with self.lock:
                self.results_file.write(json.dumps(result) + "\n")
                self.results_file.flush()
        self.say(f"<== {tag} {result['workload']}: {result['status']} in "
                 f"{result.get('process_seconds', 0.0):.1f} s"
                 + (f", median step {result['median_step']:.4f} s" if result.get("median_step") else "")
                 + f"  ({progress})", to_log=True)

    def run(self, specs, lanes):
        """lanes: lists of jobs, each a list of spec indices run in one process; a lane's
        jobs run in order by its own thread."""
        results = [None] * len(specs)
        for j, jobs in enumerate(lanes):
            self.lane_left[j] = sum(self.est[i] for job in jobs for i in job)

        def lane(j, jobs):
            for job in jobs:
                try:
                    for i, r in zip(job, self.run_job(job, specs, j)):
                        results[i] = r
                except Exception as e:  # keep the other runs of the lane going
                    for i in job:
                        results[i] = dict(specs[i], status=f"harness error: {type(e).__name__}: {e}")
                    self.say(f"<== {specs[job[0]]['variant']}: {results[job[0]]['status']}")
        threads = [threading.Thread(target=lane, args=(j, idxs), daemon=True)
                   for j, idxs in enumerate(lanes) if idxs]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.5)
        except KeyboardInterrupt:
            with self.lock:
                procs = list(self.procs)
            for p in procs:  # only the worker processes this harness started
                p.kill()
            raise
        return results


def gpu_group(spec, spread_rounds=False):
    """The runs that share a GPU: a workload's, or with spread_rounds one round's of it."""
    if spread_rounds:
        return (spec["workload"], spec.get("round", 1), bool(spec.get("cap_bytes")))
    return spec["workload"]


def jobs_of(specs, idxs, share_process, order):
    """A lane's spec indices -> its jobs (lists of indices, each run by one process). With
    share_process, one job per (cap, round, variant): the lane's workloads in `order`,
    the rounds in turn, and within a round the variants in the order they were planned."""
    if not share_process:
        return [[i] for i in idxs]

    def group(i):
        s = specs[i]
        return (bool(s.get("cap_bytes")), s.get("round", 1), s["variant"])
    first = {}
    for k, i in enumerate(idxs):  # a group's place: where its first run was planned
        first.setdefault(group(i), k)
    rank = {w: k for k, w in enumerate(order)}

    def key(i):
        g = group(i)
        return (g[0], g[1], first[g], rank.get(specs[i]["workload"], len(rank)))
    jobs = []
    for i in sorted(idxs, key=key):
        if jobs and group(jobs[-1][0]) == group(i):
            jobs[-1].append(i)
        else:
            jobs.append([i])
    return jobs


def plan(specs, n_gpus, visible, spread_rounds=False, share_process=False, order=()):
    """Assigns every spec a GPU (all runs of one workload, or with spread_rounds of one
    round of it, on one) and a process -> (lanes: per GPU its jobs, est, text)."""
    est = [est_run_seconds(s) for s in specs]
    costs = {}
    for s, e in zip(specs, est):
        g = gpu_group(s, spread_rounds)
        costs[g] = costs.get(g, 0.0) + e
    lane_of = assign_gpus(costs, n_gpus)
    lanes = [[] for _ in range(n_gpus)]
    for i, s in enumerate(specs):
        j = lane_of[gpu_group(s, spread_rounds)]
        lanes[j].append(i)
        s["gpu"] = visible[j]
        if n_gpus > 1:
            s["cuda_visible_devices"] = visible[j]
    lanes = [jobs_of(specs, idxs, share_process, list(order)) for idxs in lanes]
    for jobs in lanes:
        for job in jobs:
            for i in job[1:]:  # started in a process already running
                est[i] = max(1.0, est[i] - EST_PROCESS_SECONDS)
    lines = []
    for j, jobs in enumerate(lanes):
        idxs = [i for job in jobs for i in job]
        ws = list(dict.fromkeys(specs[i]["workload"] for i in idxs))
        lines.append(f"  gpu {visible[j]}: {len(idxs)} runs in {len(jobs)} processes, about "
                     f"{duration(sum(est[i] for i in idxs))} (estimated): "
                     + (", ".join(ws) if ws else "nothing"))
    longest = max((sum(est[i] for job in jobs for i in job) for jobs in lanes), default=0.0)
    text = (f"plan: {len(specs)} runs on {n_gpus} GPU{'s' if n_gpus > 1 else ''}, "
            f"about {duration(longest)} by a rough estimate\n" + "\n".join(lines))
    return lanes, est, text


def table(results):
    multi = len({r.get("gpu") for r in results}) > 1
    head = (["workload", "allocator", "round"] + (["gpu"] if multi else [])
            + ["cap", "steps", "median step (s)", "peak reserved", "peak allocated",
               "reserved/allocated", "retries", "OOMs", "status"])
    rows = []
    for r in results:
        cap = f"{gib(r['cap_bytes'])} ({r.get('cap_fraction', 0):.4f})" if r.get("cap_bytes") else "–"
        ms = r.get("median_step")
        rows.append([r["workload"], r["variant"], str(r.get("round", 1))]
                    + ([str(r.get("gpu"))] if multi else [])
                    + [cap, f"{r.get('steps_done', 0)}/{r['steps']}",
                       f"{ms:.4f}" if ms else "–", gib(r.get("peak_reserved")),
                       gib(r.get("peak_allocated")),
                       f"{r['ratio']:.3f}" if r.get("ratio") else "–",
                       str(r.get("retries", "–")), str(r.get("ooms", "–")), r["status"]])
    return markdown(head, rows)


def paired(results, warmup):
    """Per workload and variant: the median, over the steps after the warm-up of every run,
    of the step's time over the mean time of the same step in the baseline's runs (native
    if it ran, else the first variant). The seed fixes every step's shapes, so step i is
    the same work in every run: pairing by step takes out the step-to-step spread that
    the medians of single runs keep."""
    runs = [r for r in results if r.get("step_times") and not r.get("cap_bytes")]
    rows = []
    for w in dict.fromkeys(r["workload"] for r in runs):
        mine = [r for r in runs if r["workload"] == w]
        variants = list(dict.fromkeys(r["variant"] for r in mine))
        base_v = "native" if "native" in variants else variants[0]
        base = [r["step_times"] for r in mine if r["variant"] == base_v]
        if not base:
            continue
        n = min(len(t) for t in base)
        mean = [statistics.mean(t[i] for t in base) for i in range(n)]
        for v in variants:
            vr = [r for r in mine if r["variant"] == v]
            ratios = [r["step_times"][i] / mean[i] for r in vr
                      for i in range(warmup, min(n, len(r["step_times"]))) if mean[i] > 0]
            medians = ", ".join(f"{r['median_step']:.4f}" for r in vr if r.get("median_step"))
            rows.append([w, v, base_v, str(len(vr)),
                         f"{statistics.median(ratios):.3f}" if ratios else "–", medians])
    head = ["workload", "allocator", "baseline", "runs", "step / baseline's (paired median)",
            "median step of each run (s)"]
    return markdown(head, rows)


def empty_cache_table(results):
    head = ["workload", "allocator", "cap", "reserved before", "reserved after",
            "driver free before", "driver free after", "returned to driver", "empty_cache (ms)",
            "ms per GiB returned", "device allocs / frees"]
    rows = []
    for r in results:
        e = r.get("empty_cache")
        if not e:
            continue
        per = empty_cache_ms_per_gib(r)
        rows.append([r["workload"], r["variant"], gib(r.get("cap_bytes")) if r.get("cap_bytes") else "–",
                     gib(e["reserved_before"]), gib(e["reserved_after"]),
                     gib(e["driver_free_before"]), gib(e["driver_free_after"]),
                     gib(e["driver_free_gain"]), f"{r['empty_cache_seconds'] * 1e3:.1f}",
                     f"{per:.1f}" if per is not None else "–",
                     f"{r.get('device_allocs')} / {r.get('device_frees')}"])
    return markdown(head, rows)


# ---------------------------------------------------------------- statistics

def ratio_clusters(runs, base_runs, warmup):
    """Per round that both ran: [step i's time / the baseline's step i of the same round,
    for the steps after the warm-up both ran]."""
    base = {r.get("round", 1): r for r in base_runs}
    out = []
    for r in sorted(runs, key=lambda r: r.get("round", 1)):
        b = base.get(r.get("round", 1))
        if b is None:
            continue
        tv, tb = r["step_times"], b["step_times"]
        c = [tv[i] / tb[i] for i in range(max(0, warmup), min(len(tv), len(tb))) if tb[i] > 0]
        if c:
            out.append(c)
    return out


def percentile(xs, q):
    """q-th percentile (0-100) of the sorted list xs, interpolated linearly."""
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def bootstrap_median(clusters, resamples=2000, seed="0"):
    """Median of the pooled ratios and its 95% interval from a two-level (cluster)
    bootstrap: draw the rounds with replacement, then within each drawn round its steps
    with replacement, and take the median of the pooled draw. A fixed seed: the same
    input gives the same interval."""
    pooled = [x for c in clusters for x in c]
    if not pooled:
        return None
    rng = random.Random(seed)
    meds = []
    for _ in range(max(1, resamples)):
        draw = []
        for c in rng.choices(clusters, k=len(clusters)):
            draw.extend(rng.choices(c, k=len(c)))
        meds.append(statistics.median(draw))
    meds.sort()
    return dict(median=statistics.median(pooled), lo=percentile(meds, 2.5),
                hi=percentile(meds, 97.5), rounds=len(clusters), ratios=len(pooled),
                resamples=max(1, resamples))


def median_of(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def stats(results, warmup, resamples=2000, seed=0):
    """One row per workload and variant (uncapped, completed runs): step / native's and
    step / native-expandable's (paired by round and step, bootstrap interval), medians
    over the rounds of reserved / allocated, device allocs and frees a run, and the
    counters' increments a step after the warm-up."""
    runs = [r for r in results if r.get("step_times") and not r.get("cap_bytes")
            and r.get("status") == "completed"]
    rows = []
    for w in dict.fromkeys(r["workload"] for r in runs):
        mine = [r for r in runs if r["workload"] == w]
        by_v = {}
        for r in mine:
            by_v.setdefault(r["variant"], []).append(r)
        for v, vr in by_v.items():
            row = dict(workload=w, variant=v, runs=len(vr),
                       rounds=sorted(r.get("round", 1) for r in vr))
            for key, base_v in (("vs_native", "native"), ("vs_native_expandable", "native-expandable")):
                if base_v not in by_v:
                    row[key] = None
                elif v == base_v:
                    row[key] = "baseline"
                else:
                    row[key] = bootstrap_median(ratio_clusters(vr, by_v[base_v], warmup), resamples,
                                                f"{seed}/{w}/{v}/{base_v}")
            row["reserved_over_allocated"] = median_of(r.get("ratio") for r in vr)
            row["device_allocs_per_run"] = median_of(r.get("device_allocs") for r in vr)
            row["device_frees_per_run"] = median_of(r.get("device_frees") for r in vr)
            keys = list(dict.fromkeys(k for r in vr for k in (r.get("per_step_after_warmup") or {})))
            row["per_step_after_warmup"] = {
                k: median_of((r.get("per_step_after_warmup") or {}).get(k) for r in vr) for k in keys}
            row["median_step_per_run"] = [r.get("median_step") for r in vr]
            rows.append(row)
    return rows


def fmt_ci(x):
    if x is None:
        return "–"
    if x == "baseline":
        return "1 (baseline)"
    return f"{x['median']:.3f} [{x['lo']:.3f}, {x['hi']:.3f}]"


def fmt_num(x, digits=2):
    return "–" if x is None else f"{x:.{digits}f}"


def calls_text(ps):
    """'maps / unmaps / page releases / page creates / device allocs+frees' a step."""
    dev = (ps["num_device_alloc"] + ps["num_device_free"]
           if ps.get("num_device_alloc") is not None and ps.get("num_device_free") is not None
           else None)
    return " / ".join(fmt_num(ps.get(k)) for k in
                      ("num_map", "num_unmap", "num_page_release", "num_page_create")) \
        + f" / {fmt_num(dev)}"


def stats_table(rows):
    head = ["workload", "allocator", "rounds", "step / native: median [95% CI]",
            "step / PyTorch expandable: median [95% CI]", "peak reserved / peak allocated",
            "device allocs / frees a run", "a step after warm-up: maps / unmaps / page releases "
            "/ page creates / device allocs+frees"]
    out = []
    for r in rows:
        a, f = r.get("device_allocs_per_run"), r.get("device_frees_per_run")
        out.append([r["workload"], r["variant"], str(r["runs"]), fmt_ci(r.get("vs_native")),
                    fmt_ci(r.get("vs_native_expandable")), fmt_num(r.get("reserved_over_allocated"), 3),
                    f"{fmt_num(a, 0)} / {fmt_num(f, 0)}", calls_text(r.get("per_step_after_warmup") or {})])
    return markdown(head, out)


def markdown(head, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    fmt = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [fmt(r) for r in rows])


def split_variants(text):
    """A variant list: `;` separates variants whose CONF has commas
    ("native;cachealloc:expandable,expandable_page_mb:2"), else `,` does."""
    return text.split(";" if ";" in text else ",")


# ---------------------------------------------------------------- self-test (no torch, no GPU)

def selftest():
    """Checks of the pure functions on made-up results."""
    # Two workloads x three variants x five rounds; cachealloc's steps take 1.10 x native's,
    # native-expandable's 0.95 x, with 2% noise a step and a drift between rounds that
    # every variant of a round shares (pairing by round takes it out).
    rng = random.Random(7)
    results, warmup, steps = [], 5, 30
    for w in ("wa", "wb"):
        shape = [0.05 + 0.02 * ((i * 7) % 5) for i in range(steps)]
        for rnd in range(1, 6):
            drift = 1 + 0.05 * (rnd - 3)
            for v, f in (("native", 1.0), ("native-expandable", 0.95), ("cachealloc", 1.10)):
                times = [s * drift * f * rng.gauss(1, 0.02) for s in shape]
                c0 = {"num_map": 100, "num_unmap": 40, "num_device_alloc": 10, "num_device_free": 2}
                c1 = {"num_map": 100 + 3 * (steps - warmup), "num_unmap": 40 + (steps - warmup),
                      "num_device_alloc": 10 + 2 * (steps - warmup), "num_device_free": 2}
                if v.startswith("native"):
                    c0 = {k: c0[k] for k in ("num_device_alloc", "num_device_free")}
                    c1 = {k: c1[k] for k in ("num_device_alloc", "num_device_free")}
                results.append(dict(
                    workload=w, variant=v, round=rnd, steps=steps, steps_done=steps, seed=0,
                    warmup=warmup, gpu=0 if w == "wa" else 1, status="completed",
                    step_times=times, median_step=median_after_warmup(times, warmup),
                    peak_reserved=3 * 2**30, peak_allocated=2 * 2**30, ratio=1.5,
                    retries=0, ooms=0, device_allocs=60, device_frees=2,
                    per_step_after_warmup=per_step(c0, c1, steps - warmup),
                    empty_cache_seconds=0.01,
                    empty_cache=dict(reserved_before=4 * 2**30, reserved_after=2 * 2**30 if rnd > 1
                                     else 4 * 2**30, allocated_after=0, driver_free_before=0,
                                     driver_free_after=2 * 2**30, driver_free_gain=2 * 2**30)))
    t0 = time.perf_counter()
    rows = stats(results, warmup, 2000, 0)
    took = time.perf_counter() - t0
    assert len(rows) == 6, rows
    for r in rows:
        if r["variant"] == "cachealloc":
            s = r["vs_native"]
            assert abs(s["median"] - 1.10) < 0.01, s
            assert s["lo"] <= 1.10 <= s["hi"], s
            assert 1.10 * 0.95 < s["lo"] and s["hi"] < 1.10 * 1.05, s
            assert s["rounds"] == 5 and s["ratios"] == 5 * (steps - warmup), s
            e = r["vs_native_expandable"]
            assert abs(e["median"] - 1.10 / 0.95) < 0.015 and e["lo"] <= 1.10 / 0.95 <= e["hi"], e
            ps = r["per_step_after_warmup"]
            assert ps["num_map"] == 3 and ps["num_unmap"] == 1, ps
            assert ps["num_device_alloc"] == 2 and ps["num_device_free"] == 0, ps
            assert calls_text(ps) == "3.00 / 1.00 / – / – / 2.00", calls_text(ps)
        if r["variant"] == "native":
            assert r["vs_native"] == "baseline" and "num_map" not in r["per_step_after_warmup"]
            assert calls_text(r["per_step_after_warmup"]) == "– / – / – / – / 2.00"
        if r["variant"] == "native-expandable":
            assert r["vs_native_expandable"] == "baseline"
            assert abs(r["vs_native"]["median"] - 0.95) < 0.01
    # Same input, same interval (fixed seed); the bootstrap draws rounds, so one round
    # far off widens the interval.
    assert stats(results, warmup, 2000, 0)[2]["vs_native"] == rows[2]["vs_native"]
    clusters = [[1.0] * 20, [1.0] * 20, [1.0] * 20, [1.0] * 20, [1.5] * 20]
    b = bootstrap_median(clusters, 500, "x")
    assert b["median"] == 1.0 and b["lo"] == 1.0 and b["hi"] == 1.5, b
    assert percentile([1, 2, 3, 4, 5], 50) == 3 and percentile([1, 2], 25) == 1.25
    # A round that failed is left out of the pairing; a variant without native has no ratio.
    bad = [dict(r) for r in results if r["workload"] == "wa"]
    bad[0]["status"] = "OOM at step 3/30"  # native, round 1
    rows_bad = stats(bad, warmup, 200, 0)
    ca_row = next(r for r in rows_bad if r["variant"] == "cachealloc")
    assert ca_row["vs_native"]["rounds"] == 4, ca_row
    assert stats([r for r in results if r["variant"] != "native"], warmup, 100)[0]["vs_native"] is None
    # Counters a step.
    assert per_step({"num_map": 10, "num_unmap": 4}, {"num_map": 70, "num_unmap": 4,
                                                        "num_device_alloc": 5}, 20) \
        == {"num_map": 3.0, "num_unmap": 0.0}
    assert per_step({"num_map": 1}, {"num_map": 2}, 0) == {} and per_step(None, {"a": 1}, 5) == {}
    # empty_cache per GiB returned.
    assert abs(empty_cache_ms_per_gib(results[-1]) - 5.0) < 1e-9
    assert empty_cache_ms_per_gib(results[0]) is None  # round 1: nothing returned
    assert empty_cache_ms_per_gib({"status": "x"}) is None
    # Workload names and step counts.
    assert parse_workload("gpt2_finetune+ec") == ("gpt2_finetune", True)
    assert parse_workload("gpt2_finetune") == ("gpt2_finetune", False)
    assert parse_workload("+ec") == ("+ec", False)
    named, bare = parse_steps("30,llm_serving=100,gpt2_finetune+ec=12")
    assert bare == 30 and named == {"llm_serving": 100, "gpt2_finetune+ec": 12}
    assert steps_for("llm_serving+ec", named, bare, {}) == 100
    assert steps_for("gpt2_finetune+ec", named, bare, {}) == 12
    assert steps_for("moe_train", named, bare, {}) == 30
    assert steps_for("moe_train+ec", {}, None, {"moe_train": 60}) == 60
    assert steps_for("nope", {}, None, {"moe_train": 60}) is None
    caps, complete = corpus_step_caps()
    if complete:
        assert caps.get("gpt2_finetune") and caps.get("kv_cat_generate"), caps
    # Variants.
    assert parse_variant("cachealloc-segments") == ("cachealloc", "segments")
    assert parse_variant("cachealloc") == ("cachealloc", "default")
    assert parse_variant("cachealloc-expandable") == ("cachealloc", "expandable")
    assert parse_variant("native:expandable_segments:True") == ("native", "expandable_segments:True")
    assert split_variants("native;cachealloc:a,b") == ["native", "cachealloc:a,b"]
    env = variant_env("native-expandable", "3")
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "CACHEALLOC_CONF" not in env
    # GPUs: every run of a workload on one GPU, the load spread.
    ws = ["gpt2_finetune", "gpt2_finetune+ec", "llm_serving", "moe_train", "cnn_multiscale",
          "detection_frcnn", "speech_ctc", "multistream_infer", "kv_cat_generate"]
    specs = [dict(workload=w, variant=v, round=r, steps=25, seed=0, warmup=5)
             for w in ws for r in range(1, 6) for v in ("native", "cachealloc")]
    lanes, est, _ = plan(specs, 4, ["0", "1", "2", "3"])
    assert all(len(job) == 1 for jobs in lanes for job in jobs)  # a process per run
    lanes = [[job[0] for job in jobs] for jobs in lanes]
    assert sorted(i for l in lanes for i in l) == list(range(len(specs)))
    gpu_of = {}
    for j, l in enumerate(lanes):
        assert l == sorted(l)  # the interleaved order kept within a GPU
        for i in l:
            assert gpu_of.setdefault(specs[i]["workload"], j) == j
            assert specs[i]["gpu"] == str(j) and specs[i]["cuda_visible_devices"] == str(j)
    assert len(set(gpu_of.values())) == 4
    loads = [sum(est[i] for i in l) for l in lanes]
    assert max(loads) - min(loads) <= max(est) * 10 + 1e-9, loads  # within one workload's runs
    assert assign_gpus({"a": 5, "b": 4, "c": 3, "d": 3}, 2) == {"a": 0, "b": 1, "c": 1, "d": 0}
    lanes1, _, _ = plan([dict(s) for s in specs], 1, ["0"])
    assert lanes1 == [[[i] for i in range(len(specs))]]
    # One process per variant and round with --share-process: all of a GPU's workloads
    # in it, in the order given, rounds in turn, variants in each round's planned order.
    sp = [dict(s) for s in specs]
    lanes_p, est_p, _ = plan(sp, 2, ["0", "1"], share_process=True, order=ws)
    assert sorted(i for jobs in lanes_p for job in jobs for i in job) == list(range(len(sp)))
    for jobs in lanes_p:
        ws_lane = list(dict.fromkeys(sp[i]["workload"] for job in jobs for i in job))
        assert len(jobs) == 5 * 2  # rounds x variants
        for k, job in enumerate(jobs):
            assert [sp[i]["workload"] for i in job] == sorted(ws_lane, key=ws.index)
            assert len({(sp[i]["variant"], sp[i]["round"]) for i in job}) == 1
            assert sp[job[0]]["round"] == k // 2 + 1
            assert all(est_p[i] < est[i] for i in job[1:]) and est_p[job[0]] == est[job[0]]
    sp = [dict(s) for s in specs]
    lanes_s, _, _ = plan(sp, 4, ["0", "1", "2", "3"], spread_rounds=True)
    lanes_s = [[job[0] for job in jobs] for jobs in lanes_s]
    where, gpus_of = {}, {}
    for j, l in enumerate(lanes_s):
        assert l == sorted(l)
        for i in l:
            assert where.setdefault((sp[i]["workload"], sp[i]["round"]), j) == j
            gpus_of.setdefault(sp[i]["workload"], set()).add(j)
    assert all(len(g) > 1 for g in gpus_of.values()), gpus_of
    # Results kept as JSON lines (--results) and as --json read back the same.
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        lines, whole = os.path.join(d, "r.jsonl"), os.path.join(d, "r.json")
        with open(lines, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
        with open(whole, "w") as f:
            json.dump(dict(results=results[:3], stats=[]), f)
        back = read_results([lines, whole])
        assert back == results + results[:3], (len(back), len(results))
        assert stats(back[:len(results)], warmup, 200, 0)[2]["vs_native"] == \
            stats(results, warmup, 200, 0)[2]["vs_native"]
    # The tables render.
    for text in (table(results), paired(results, warmup), empty_cache_table(results),
                 stats_table(rows)):
        assert text.count("\n") >= 2
    assert "ms per GiB returned" in empty_cache_table(results) and "5.0" in empty_cache_table(results)
    print(stats_table(rows))
    print(f"\nselftest passed (bootstrap of 6 rows x 2 baselines, 2000 resamples: {took:.2f} s)")


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--workloads", default="nmt,cnn_multiscale",
                    help="comma-separated; NAME+ec empties the cache every step (default nmt,cnn_multiscale)")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"(default {DEFAULT_VARIANTS})")
    ap.add_argument("--steps", help="NAME=N items and a bare N for the rest, e.g. 30,llm_serving=100 "
                    "(default: nmt 120, cnn_multiscale 80, a corpus program its step cap)")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median (default 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int,
                    help="runs of each variant per workload, every other round in reverse order "
                         f"(default 1; {STATS_MIN_ROUNDS} with --stats, which needs at least "
                         f"{STATS_MIN_ROUNDS}); the paired table pools them")
    ap.add_argument("--stats", action="store_true",
                    help="paired step / native (and / native-expandable) with bootstrap 95%% intervals, "
                         "driver calls a step after the warm-up")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (default 2000)")
    ap.add_argument("--gpus", type=int, default=1,
                    help="GPUs used at once, one workload's runs on one GPU (default 1)")
    ap.add_argument("--spread-rounds", action="store_true",
                    help="with --gpus: one round's runs of a workload on one GPU, its rounds spread "
                         "over the GPUs")
    ap.add_argument("--share-process", action="store_true",
                    help="one process per variant and round runs all of a GPU's workloads, one "
                         "after the other (saves each later workload's start-up)")
    ap.add_argument("--cap-bytes", type=int, help="also run capped: this many bytes of device memory")
    ap.add_argument("--cap-workload", default="nmt")
    ap.add_argument("--cap-variants", default="native,cachealloc")
    ap.add_argument("--cap-steps", type=int, help="steps of the capped runs (default: the workload's)")
    ap.add_argument("--lib", help="libcachealloc.so (default: see cachealloc_torch.library_path)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per process (default 300)")
    ap.add_argument("--smoke", action="store_true", help=f"short runs ({SMOKE_STEPS} steps, warm-up 2)")
    ap.add_argument("--dry-run", action="store_true", help="print the runs' plan and exit")
    ap.add_argument("--selftest", action="store_true", help="check the statistics and tables (no torch)")
    ap.add_argument("--json", help="write all results here (with --stats, the statistics too)")
    ap.add_argument("--markdown", help="write the tables here")
    ap.add_argument("--log", help="append the workers' output here")
    ap.add_argument("--results", help="append each run's result here as it finishes (JSON lines), "
                    "so that a cut run keeps what it finished")
    ap.add_argument("--analyze", nargs="+", metavar="FILE",
                    help="no runs: the tables (with --stats, the statistics) of results read from "
                         "--results files or --json files, several calls' results together")
    a = ap.parse_args()

    if a.analyze:
        results = read_results(a.analyze)
        if not results:
            ap.error("no results in " + ", ".join(a.analyze))
        warmups = {r.get("warmup") for r in results if r.get("warmup") is not None}
        if len(warmups) > 1:
            ap.error(f"the results have different warm-ups: {sorted(warmups)}")
        a.rounds = len({r.get("round", 1) for r in results})
        report(a, results, warmups.pop() if warmups else a.warmup, time.perf_counter())
        return
    if a.worker:
        job = json.loads(a.worker)
        for spec in (job if isinstance(job, list) else [job]):
            res = worker(spec)
            print(RESULT_TAG + json.dumps(res), flush=True)
        return
    if a.selftest:
        selftest()
        return

    if a.rounds is None:
        a.rounds = STATS_MIN_ROUNDS if a.stats else 1
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if a.stats and a.rounds < STATS_MIN_ROUNDS:
        ap.error(f"--stats needs --rounds of at least {STATS_MIN_ROUNDS}")
    if a.gpus < 1:
        ap.error("--gpus must be at least 1")
    if a.bootstrap < 1:
        ap.error("--bootstrap must be at least 1")
    visible = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    if not visible:
        visible = [str(i) for i in range(a.gpus)]
    elif len(visible) < a.gpus:
        ap.error(f"--gpus {a.gpus} but CUDA_VISIBLE_DEVICES names {len(visible)}")
    visible = visible[:a.gpus]

    caps, complete = corpus_step_caps()
    known = dict(caps, **DEFAULT_STEPS)
    named, bare = parse_steps(a.steps)
    if a.smoke and a.steps is None:
        bare = SMOKE_STEPS
    warmup = 2 if a.smoke and a.warmup == 5 else a.warmup
    workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    for w in workloads + ([a.cap_workload] if a.cap_bytes else []):
        if complete and parse_workload(w)[0] not in known:
            ap.error(f"unknown workload {w!r} (known: {', '.join(sorted(known))}; NAME+ec)")
    steps = {}
    for w in workloads:
        steps[w] = steps_for(w, named, bare, known)
        if steps[w] is None:
            ap.error(f"no step count for {w}: give --steps {w}=N")
    variants = split_variants(a.variants)
    cap_variants = split_variants(a.cap_variants)
    for v in variants + cap_variants:
        parse_variant(v)
    specs = []
    for w in workloads:
        for r in range(a.rounds):
            for v in (variants if r % 2 == 0 else variants[::-1]):
                specs.append(dict(workload=w, variant=v, round=r + 1, steps=int(steps[w]), seed=a.seed,
                                  warmup=warmup, lib=a.lib))
    if a.cap_bytes:
        n = a.cap_steps or steps_for(a.cap_workload, named, bare, known) or 120
        for v in cap_variants:
            specs.append(dict(workload=a.cap_workload, variant=v, steps=int(n), seed=a.seed,
                              warmup=warmup, lib=a.lib, cap_bytes=a.cap_bytes))
    if a.share_process and a.spread_rounds:
        ap.error("--share-process and --spread-rounds do not go together")
    lanes, est, plan_text = plan(specs, a.gpus, visible, a.spread_rounds,
                                 share_process=a.share_process,
                                 order=[w for w in workloads])
    print(plan_text, flush=True)
    if a.dry_run:
        for j, jobs in enumerate(lanes):
            for job in jobs:
                for i in job:
                    s = specs[i]
                    print(f"  gpu {visible[j]}: {s['workload']}/{s['variant']}"
                          f"{'/capped' if s.get('cap_bytes') else ''} r{s.get('round', 1)}, "
                          f"{s['steps']} steps, ~{est[i]:.0f} s"
                          + (" (same process as the line above)" if i != job[0] else ""))
        return
    log = open(a.log, "a") if a.log else None
    rfile = open(a.results, "a") if a.results else None
    t0 = time.perf_counter()
    try:
        results = Runner(a.timeout, log, len(specs), est, rfile).run(specs, lanes)
    finally:
        for f in (log, rfile):
            if f:
                f.close()
    report(a, results, warmup, t0)


def read_results(paths):
    """Results from --results (JSON lines) and --json files (a list, or a dict with results)."""
    out = []
    for path in paths:
        with open(path) as f:
            text = f.read()
        try:
            data = json.loads(text)
        except ValueError:
            out += [json.loads(line) for line in text.splitlines() if line.strip()]
            continue
        out += data["results"] if isinstance(data, dict) else data
    return out


def report(a, results, warmup, t0):
    """Prints (and writes with --markdown / --json) the tables of results."""
    for r in results:
        if r.get("empty_cache"):
            r["empty_cache"]["ms_per_gib_returned"] = empty_cache_ms_per_gib(r)
    dev = next((r["device"] for r in results if r.get("device")), "unknown device")
    tv = next((r["torch"] for r in results if r.get("torch")), "?")
    gpus_used = sorted({str(r.get("gpu")) for r in results})
    out = [f"## PyTorch training, side by side ({dev}, torch {tv}, seed {a.seed}, "
           f"median over steps after a warm-up of {warmup}"
           + (f", GPUs {', '.join(gpus_used)}" if len(gpus_used) > 1 else "") + ")", "",
           table(results), "",
           "### Step time paired by step (same seed, same shapes)", "", paired(results, warmup), "",
           "### torch.cuda.empty_cache() after training (model and optimizer freed)", "",
           empty_cache_table(results)]
    rows = None
    if a.stats:
        tb = time.perf_counter()
        rows = stats(results, warmup, a.bootstrap, a.seed)
        out += ["", f"### Step time against PyTorch's, paired by round and step ({a.rounds} rounds; "
                f"95% intervals from a bootstrap over rounds and steps, {a.bootstrap} resamples; "
                f"{time.perf_counter() - tb:.1f} s)", "", stats_table(rows)]
    notes = sorted({f"{r['variant']}: {n}" for r in results for n in r.get("notices", [])})
    if notes:
        out += ["", "Notices:"] + [f"- {n}" for n in notes]
    errs = [f"{r['workload']}/{r['variant']}: {r['abi_errors']} C ABI errors"
            for r in results if r.get("abi_errors")]
    if errs:
        out += ["", "C ABI errors recorded:"] + [f"- {e}" for e in errs]
    out += ["", f"(total {time.perf_counter() - t0:.0f} s)"]
    text = "\n".join(out)
    print("\n" + text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results if rows is None else
                      dict(results=results, stats=rows, warmup=warmup, rounds=a.rounds,
                           bootstrap=a.bootstrap, seed=a.seed), f, indent=1)
    bad = [r for r in results if not (r["status"] == "completed" or r.get("cap_bytes") and "OOM" in r["status"])]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
