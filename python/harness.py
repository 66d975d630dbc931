"""Side-by-side PyTorch training on native PyTorch allocators and on cachealloc.

One command on the GPU machine runs the shared workloads (python/workloads.py:
nmt, cnn_multiscale) once per allocator variant, each in its own process, with
the same seeds and steps, and prints one table: median step time, peak
reserved, peak allocated, their ratio, flush-and-retries, OOMs and how the run
ended; then whether torch.cuda.empty_cache() gave memory back to the driver.

    python3 python/harness.py                                    # all variants, both workloads
    python3 python/harness.py --variants native,cachealloc --steps nmt=60,cnn_multiscale=60
    python3 python/harness.py --cap-bytes 13780000000            # + capped nmt runs
    python3 python/harness.py --smoke                            # a few steps, to catch errors

Variants (--variants and --cap-variants, comma-separated, or `;`-separated when a CONF has commas; order kept):
    native                  PyTorch's caching allocator, default settings
    native-expandable       PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    cachealloc              libcachealloc.so through PyTorch's C++ allocator interface, CACHEALLOC_CONF=default
    cachealloc-expandable   the same, CACHEALLOC_CONF=expandable
    cachealloc-pluggable    libcachealloc.so through CUDAPluggableAllocator, CACHEALLOC_CONF=default
    native:CONF             PyTorch with PYTORCH_CUDA_ALLOC_CONF=CONF
    cachealloc:CONF         cachealloc with CACHEALLOC_CONF=CONF (e.g. cachealloc:pytorch)

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
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT_TAG = "HARNESS_RESULT "
DEFAULT_VARIANTS = "native,native-expandable,cachealloc,cachealloc-expandable"
DEFAULT_STEPS = "nmt=120,cnn_multiscale=80"  # the lengths of the shared traces
SMOKE_STEPS = "nmt=8,cnn_multiscale=8"

ALIASES = {
    "native": ("native", None),
    "native-expandable": ("native", "expandable_segments:True"),
    "cachealloc": ("cachealloc", "default"),
    "cachealloc-expandable": ("cachealloc", "expandable"),
    "cachealloc-pluggable": ("cachealloc", "default"),
}


def parse_variant(name):
    """'native' / 'cachealloc-expandable' / 'cachealloc:pytorch' -> (kind, conf)."""
    if name in ALIASES:
        return ALIASES[name]
    kind, sep, conf = name.partition(":")
    if kind not in ("native", "cachealloc") or not sep or not conf:
        raise SystemExit(f"unknown variant {name!r} (known: {', '.join(ALIASES)}, native:CONF, "
                         "cachealloc:CONF)")
    return kind, conf


def variant_env(name):
    kind, conf = parse_variant(name)
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("CACHEALLOC_CONF", None)
    env["PYTHONUNBUFFERED"] = "1"
    if kind == "native" and conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    if kind == "cachealloc":
        env["CACHEALLOC_CONF"] = conf
    return env


def gib(b):
    return "–" if b is None else f"{b / 2**30:.2f} GiB"


def median_after_warmup(times, warmup):
    t = times[warmup:] if len(times) > warmup else times
    return statistics.median(t) if t else None


# ---------------------------------------------------------------- worker

def worker(spec):
    """Runs one workload under one allocator variant in this process; prints RESULT_TAG + JSON."""
    kind, conf = parse_variant(spec["variant"])
    res = dict(spec, kind=kind, conf=conf, status="not started")
    t_import = time.perf_counter()
    sys.path.insert(0, HERE)
    import torch
    ca = None
    if kind == "cachealloc":
        import cachealloc_torch as ca
        mode = "pluggable" if spec["variant"].startswith("cachealloc-pluggable") else "cpp"
        res["lib"] = ca.enable(spec.get("lib"), mode=mode)
        res["mode"] = ca.mode()
    import workloads
    torch.cuda.init()
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
    torch.manual_seed(spec["seed"])
    gen = workloads.WORKLOADS[spec["workload"]](spec["steps"], spec["seed"])
    times = []
    res["status"] = "completed"
    t_start = time.perf_counter()
    t = t_start
    try:
        for _ in gen:
            torch.cuda.synchronize()
            now = time.perf_counter()
            times.append(now - t)
            t = now
    except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError
        msg = str(e)
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in msg.lower()
        res["status"] = (f"OOM at step {len(times) + 1}/{spec['steps']}" if oom else
                         f"{type(e).__name__} at step {len(times) + 1}/{spec['steps']}")
        res["error"] = msg[:1500]
        print(f"{res['status']}: {msg[:600]}", flush=True)
    finally:
        gen.close()
    res["seconds_training"] = time.perf_counter() - t_start
    res["seconds_since_import"] = time.perf_counter() - t_import
    res["steps_done"] = len(times)
    res["step_times"] = [round(x, 5) for x in times]
    res["median_step"] = median_after_warmup(times, spec["warmup"])
    res["mean_step"] = (statistics.mean(times[spec["warmup"]:])
                        if len(times) > spec["warmup"] else None)
    del gen
    gc.collect()
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:  # a sticky CUDA error: nothing more can be read
        res["after_error"] = str(e)[:500]
        return res

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

    before = figures()
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
    if ca is not None:
        res["abi_errors"] = ca.error_count()
        res["fragmentation_after"] = ca.fragmentation_stats()
    return res


# ---------------------------------------------------------------- parent

def run_one(spec, timeout, log):
    env = variant_env(spec["variant"])
    tag = f"[{spec['workload']}/{spec['variant']}{'/capped' if spec.get('cap_bytes') else ''}]"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    print(f"\n==> {tag} {spec['steps']} steps, seed {spec['seed']}"
          + (f", CACHEALLOC_CONF={env['CACHEALLOC_CONF']}" if "CACHEALLOC_CONF" in env else "")
          + (f", PYTORCH_CUDA_ALLOC_CONF={env['PYTORCH_CUDA_ALLOC_CONF']}"
             if "PYTORCH_CUDA_ALLOC_CONF" in env else ""), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    result = None
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            if line.startswith(RESULT_TAG):
                result = json.loads(line[len(RESULT_TAG):])
            else:
                print(f"  {tag} {line.rstrip()}", flush=True)
                if log:
                    log.write(line)
        proc.wait()
    finally:
        timed_out = not timer.is_alive() and proc.returncode != 0
        timer.cancel()
    wall = time.perf_counter() - t0
    if result is None:
        result = dict(spec, status=(f"timed out after {timeout:.0f} s" if timed_out
                                    else f"process failed (exit {proc.returncode})"))
    result["process_seconds"] = wall
    result["exit_code"] = proc.returncode
    print(f"<== {tag} {result['status']} in {wall:.1f} s"
          + (f", median step {result['median_step']:.4f} s" if result.get("median_step") else ""),
          flush=True)
    return result


def table(results):
    head = ["workload", "allocator", "round", "cap", "steps", "median step (s)", "peak reserved",
            "peak allocated", "reserved/allocated", "retries", "OOMs", "status"]
    rows = []
    for r in results:
        cap = f"{gib(r['cap_bytes'])} ({r.get('cap_fraction', 0):.4f})" if r.get("cap_bytes") else "–"
        ms = r.get("median_step")
        rows.append([r["workload"], r["variant"], str(r.get("round", 1)), cap,
                     f"{r.get('steps_done', 0)}/{r['steps']}",
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
            "device allocs / frees"]
    rows = []
    for r in results:
        e = r.get("empty_cache")
        if not e:
            continue
        rows.append([r["workload"], r["variant"], gib(r.get("cap_bytes")) if r.get("cap_bytes") else "–",
                     gib(e["reserved_before"]), gib(e["reserved_after"]),
                     gib(e["driver_free_before"]), gib(e["driver_free_after"]),
                     gib(e["driver_free_gain"]), f"{r['empty_cache_seconds'] * 1e3:.1f}",
                     f"{r.get('device_allocs')} / {r.get('device_frees')}"])
    return markdown(head, rows)


def markdown(head, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    fmt = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [fmt(r) for r in rows])


def split_variants(text):
    """A variant list: `;` separates variants whose CONF has commas
    ("native;cachealloc:expandable,expandable_page_mb:2"), else `,` does."""
    return text.split(";" if ";" in text else ",")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--workloads", default="nmt,cnn_multiscale")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--steps", help=f"per workload, e.g. nmt=60,cnn_multiscale=60 (default {DEFAULT_STEPS})")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median (default 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of each variant per workload, every other round in reverse order "
                         "(default 1); the paired table pools them")
    ap.add_argument("--cap-bytes", type=int, help="also run capped: this many bytes of device memory")
    ap.add_argument("--cap-workload", default="nmt")
    ap.add_argument("--cap-variants", default="native,cachealloc")
    ap.add_argument("--cap-steps", type=int, help="steps of the capped runs (default: the workload's)")
    ap.add_argument("--lib", help="libcachealloc.so (default: see cachealloc_torch.library_path)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per process (default 300)")
    ap.add_argument("--smoke", action="store_true", help=f"short runs ({SMOKE_STEPS}, warm-up 2)")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--markdown", help="write the tables here")
    ap.add_argument("--log", help="append the workers' output here")
    a = ap.parse_args()

    if a.worker:
        res = worker(json.loads(a.worker))
        print(RESULT_TAG + json.dumps(res), flush=True)
        return

    steps = dict(kv.split("=") for kv in (a.steps or (SMOKE_STEPS if a.smoke else DEFAULT_STEPS)).split(","))
    warmup = 2 if a.smoke and a.warmup == 5 else a.warmup
    workloads = a.workloads.split(",")
    variants = split_variants(a.variants)
    cap_variants = split_variants(a.cap_variants)
    for v in variants + cap_variants:
        parse_variant(v)
    specs = []
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    for w in workloads:
        for r in range(a.rounds):
            for v in (variants if r % 2 == 0 else variants[::-1]):
                specs.append(dict(workload=w, variant=v, round=r + 1, steps=int(steps[w]), seed=a.seed,
                                  warmup=warmup, lib=a.lib))
    if a.cap_bytes:
        for v in cap_variants:
            n = a.cap_steps or int(steps.get(a.cap_workload, steps.get("nmt", 120)))
            specs.append(dict(workload=a.cap_workload, variant=v, steps=n, seed=a.seed,
                              warmup=warmup, lib=a.lib, cap_bytes=a.cap_bytes))
    log = open(a.log, "a") if a.log else None
    t0 = time.perf_counter()
    results = [run_one(s, a.timeout, log) for s in specs]
    if log:
        log.close()
    dev = next((r["device"] for r in results if r.get("device")), "unknown device")
    tv = next((r["torch"] for r in results if r.get("torch")), "?")
    out = [f"## PyTorch training, side by side ({dev}, torch {tv}, seed {a.seed}, "
           f"median over steps after a warm-up of {warmup})", "", table(results), "",
           "### Step time paired by step (same seed, same shapes)", "", paired(results, warmup), "",
           "### torch.cuda.empty_cache() after training (model and optimizer freed)", "",
           empty_cache_table(results)]
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
            json.dump(results, f, indent=1)
    bad = [r for r in results if not (r["status"] == "completed" or r.get("cap_bytes") and "OOM" in r["status"])]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
