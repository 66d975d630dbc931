# Records the corpus: runs each workload of families.py on the GPU under PyTorch's default
# allocator with torch.cuda.memory._record_memory_history and writes the plain trace format
# (docs/TRACE_FORMAT.md), with a comment line "# step N" at every step boundary.
#
#   python3 python/corpus/record.py --out DIR [--set holdout|holdout2] [--only a,b] [--lanes 3]
#                                   [--timeout 150]
#       runs every workload of the set (families.py, or holdout.py / holdout2.py) in its own
#       process (LANES at a time, each with a timeout) and writes DIR/NAME.trace.gz,
#       DIR/NAME.json and DIR/summary.json
#   python3 python/corpus/record.py --one NAME --out DIR [--steps N] [--seed S] [--max-seconds T]
#       records one workload in this process
#
# Step boundaries: after each step the recorder allocates and frees one 1-byte tensor on a
# stream of its own. Those two events are dropped from the trace and become "# step N".
# Streams are renumbered 0 (the default stream), 1, 2, ... in order of first use.
import argparse
import gzip
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def write_trace(snap, path, marker_stream, max_events):
    """Pairs alloc with free_requested by address; returns (events, steps, truncated)."""
    ids, next_id, n, steps = {}, 0, 0, 0
    streams = {0: 0}
    truncated = False
    lines = []
    last_step_len = 0
    in_release = False
    for e in snap["device_traces"][0]:
        act = e["action"]
        s = e.get("stream", 0)
        # Segments go back to the driver only in torch.cuda.empty_cache() (called by the
        # program or by PyTorch itself, e.g. around cuDNN's autotuner) and in the retry
        # after an out-of-memory; one run of segment frees is one such call: an "e" line.
        if act == "segment_free":
            if not in_release:
                lines.append("e\n")
                in_release = True
            continue
        in_release = False
        if s == marker_stream:
            if act == "alloc":
                lines.append(f"# step {steps}\n")
                steps += 1
                last_step_len = len(lines)
                if n >= max_events:
                    truncated = True
                    break
            continue
        if act == "alloc":
            ids[e["addr"]] = next_id
            sid = streams.setdefault(s, len(streams))
            lines.append(f"a {next_id} {e['size']} {sid}\n")
            next_id += 1
            n += 1
        elif act == "free_requested":
            i = ids.pop(e["addr"], None)
            if i is not None:
                lines.append(f"f {i}\n")
                n += 1
    if truncated:
        lines = lines[:last_step_len]
        n = sum(1 for x in lines if x[0] in "af")
    with gzip.open(path, "wt", compresslevel=9) as f:
        f.write("# plain allocation trace v1: 'a <id> <bytes> <stream>' allocates, 'f <id>' frees,"
                " 'e' empties the cache\n")
        f.writelines(lines)
    return n, steps, truncated


def workloads(name):
    """The workloads of a set: the corpus (families.py) or the held-out ones (holdout.py,
    holdout2.py)."""
    if name == "holdout":
        from holdout import HOLDOUT
        return HOLDOUT
    if name == "holdout2":
        from holdout2 import HOLDOUT2
        return HOLDOUT2
    from families import FAMILIES
    return FAMILIES


def record_one(a):
    import torch
    gen, cap = workloads(a.set)[a.one]
    steps = a.steps or cap
    torch.cuda.init()
    marker = torch.cuda.Stream()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             max_entries=6_000_000)
    t0 = time.perf_counter()
    done = 0
    for _ in gen(steps, a.seed):
        done += 1
        with torch.cuda.stream(marker):
            m = torch.empty(1, dtype=torch.uint8, device="cuda")
            del m
        if time.perf_counter() - t0 > a.max_seconds:
            break
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    path = os.path.join(a.out, a.one + ".trace.gz")
    events, marked, truncated = write_trace(snap, path, marker.cuda_stream, a.max_events)
    res = dict(name=a.one, seed=a.seed, steps_run=done, steps_in_trace=marked, events=events,
               truncated=truncated, raw_entries=len(snap["device_traces"][0]),
               seconds=round(secs, 1), torch=torch.__version__, cuda=torch.version.cuda,
               gpu=torch.cuda.get_device_name(),
               max_allocated=torch.cuda.max_memory_allocated(),
               max_reserved=torch.cuda.max_memory_reserved(),
               bytes=os.path.getsize(path))
    res["ratio"] = round(res["max_reserved"] / max(1, res["max_allocated"]), 4)
    json.dump(res, open(os.path.join(a.out, a.one + ".json"), "w"), indent=1)
    print(json.dumps(res), flush=True)


def record_all(a):
    known = workloads(a.set)
    names = a.only.split(",") if a.only else list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"unknown workloads in set {a.set}: {', '.join(unknown)}")
    queue, running, results = list(names), [], {}
    os.makedirs(a.out, exist_ok=True)
    while queue or running:
        while queue and len(running) < a.lanes:
            name = queue.pop(0)
            log = open(os.path.join(a.out, name + ".log"), "w")
            cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--out", a.out,
                   "--set", a.set,
                   "--seed", str(a.seed), "--max-seconds", str(a.max_seconds)]
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            running.append((name, p, time.time(), log))
            print(f"start {name}", flush=True)
        time.sleep(1)
        for r in list(running):
            name, p, t, log = r
            rc = p.poll()
            if rc is None and time.time() - t > a.timeout:
                p.kill()
                rc = "timeout"
            if rc is not None:
                p.wait()
                log.close()
                running.remove(r)
                results[name] = rc
                print(f"done {name} rc={rc} after {time.time() - t:.0f}s", flush=True)
    rows = []
    for name in names:
        try:
            rows.append(json.load(open(os.path.join(a.out, name + ".json"))))
        except OSError:
            rows.append(dict(name=name, failed=str(results.get(name))))
    json.dump(rows, open(os.path.join(a.out, "summary.json"), "w"), indent=1)
    print(f"{'name':<20}{'steps':>6}{'events':>9}{'peak alloc MiB':>15}{'ratio':>7}{'KB':>7}{'s':>6}")
    for r in rows:
        if "failed" in r:
            print(f"{r['name']:<20} FAILED {r['failed']}")
        else:
            print(f"{r['name']:<20}{r['steps_in_trace']:>6}{r['events']:>9}"
                  f"{r['max_allocated'] / 2**20:>15.0f}{r['ratio']:>7.3f}{r['bytes'] // 1024:>7}"
                  f"{r['seconds']:>6}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--one")
    ap.add_argument("--set", choices=["corpus", "holdout", "holdout2"], default="corpus")
    ap.add_argument("--only")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lanes", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=150)
    ap.add_argument("--max-seconds", type=float, default=45)
    ap.add_argument("--max-events", type=int, default=900_000)
    a = ap.parse_args()
    if a.one:
        record_one(a)
    else:
        record_all(a)


if __name__ == "__main__":
    main()
