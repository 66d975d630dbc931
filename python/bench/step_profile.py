"""Where a step's time goes, per allocator variant: GPU kernel time, the
kernels that take it, and the host's CUDA runtime calls, from torch.profiler
over a few steps after warm-up. Each variant runs in its own process with the
same seed, so two variants that choose different kernels (a convolution
algorithm picked by the workspace it was offered, say) or wait in different
places show it side by side.

    python3 python/bench/step_profile.py --workload detection_frcnn \\
        --variants "native;cachealloc-expandable" --steps 10 --profile-steps 4 --json OUT.json
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = os.path.dirname(HERE)
sys.path.insert(0, PY)
import harness  # noqa: E402  (variant names and environments)

TAG = "STEP_PROFILE "


def worker(variant, workload, steps, profile_steps, seed, top):
    kind, _ = harness.parse_variant(variant)
    import torch
    if kind == "cachealloc":
        import cachealloc_torch as ca
        ca.enable(mode="cpp")
    import workloads
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(seed)
    gen = workloads.WORKLOADS[workload](steps, seed)
    warm = steps - profile_steps
    walls = []
    t = time.perf_counter()
    for _ in range(warm):
        next(gen)
        torch.cuda.synchronize()
        now = time.perf_counter()
        walls.append(now - t)
        t = now
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(profile_steps):
            next(gen)
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / profile_steps
    gen.close()
    kernels, runtime = {}, {}
    for e in prof.key_averages():
        if str(e.device_type).endswith("CUDA"):  # kernels, copies and sets on the GPU
            dev = getattr(e, "self_device_time_total", None)
            if dev is None:
                dev = e.self_cuda_time_total
            kernels[e.key] = (dev / profile_steps / 1e3, e.count / profile_steps)
        elif e.key.startswith("cu"):  # runtime and driver calls on the host
            runtime[e.key] = (e.self_cpu_time_total / profile_steps / 1e3, e.count / profile_steps)
    ktotal = sum(v[0] for v in kernels.values())
    res = dict(variant=variant, workload=workload, wall_ms=wall * 1e3,
               warm_step_ms=[round(w * 1e3, 1) for w in walls], kernel_ms=ktotal,
               top_kernels=sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top],
               runtime=sorted(runtime.items(), key=lambda kv: -kv[1][0])[:top])
    print(TAG + json.dumps(res), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--variants", default="native;cachealloc-expandable",
                    help="semicolon-separated, as python/harness.py names them")
    ap.add_argument("--steps", type=int, default=10, help="steps in all, profiled ones included")
    ap.add_argument("--profile-steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not 0 < a.profile_steps < a.steps:
        raise SystemExit("--profile-steps must be at least 1 and below --steps")
    if a.worker:
        worker(a.worker, a.workload, a.steps, a.profile_steps, a.seed, a.top)
        return
    results = []
    for v in a.variants.split(";"):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", v, "--workload", a.workload,
               "--steps", str(a.steps), "--profile-steps", str(a.profile_steps),
               "--seed", str(a.seed), "--top", str(a.top)]
        try:
            p = subprocess.run(cmd, env=harness.variant_env(v), capture_output=True, text=True,
                               timeout=a.timeout)
            out = p.stdout + p.stderr
        except subprocess.TimeoutExpired:
            print(f"{v}: timed out after {a.timeout} s")
            continue
        line = next((ln for ln in out.splitlines() if ln.startswith(TAG)), None)
        if line is None:
            print(f"{v}: no result; last output:\n{out[-1500:]}")
            continue
        results.append(json.loads(line[len(TAG):]))
    for r in results:
        print(f"\n== {r['workload']} {r['variant']}: {r['wall_ms']:.1f} ms a step, "
              f"GPU kernels {r['kernel_ms']:.1f} ms ({r['kernel_ms'] / r['wall_ms']:.0%})")
        print("  kernels (ms a step, calls a step):")
        for k, (ms, n) in r["top_kernels"]:
            print(f"    {ms:8.2f} {n:7.1f}  {k[:110]}")
        print("  CUDA runtime / driver calls on the host (ms a step, calls a step):")
        for k, (ms, n) in r["runtime"]:
            print(f"    {ms:8.2f} {n:7.1f}  {k[:80]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
