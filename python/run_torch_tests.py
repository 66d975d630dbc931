#!/usr/bin/env python3
"""Runs PyTorch's own test/test_cuda.py twice, on PyTorch's allocator and on
cachealloc, and prints which tests pass natively but not with cachealloc.

PyTorch's wheels do not ship test/, so the file is given with --test-file
(a copy of test/test_cuda.py from PyTorch's source). Tests are selected with
pytest's -k (default: names about memory, caching, allocation, OOM, graphs,
streams, snapshots and pools). The cachealloc run sets CACHEALLOC_TORCH=1, so
the wheel's start-up hook installs cachealloc in every Python process (pytest
itself, its workers, and the subprocesses some tests start) before CUDA is
first used.

    python3 python/run_torch_tests.py --test-file test_cuda.py \\
        [--wheel cachealloc_torch-*.whl] [--out DIR] [--budget 200]

Writes DIR/native.xml, DIR/cachealloc.xml (junit), DIR/*.log and
DIR/compare.md; exits 0 when every test that passed natively passed with
cachealloc, 1 otherwise, 2 when a run could not start.
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

DEFAULT_K = "memory or cach or alloc or oom or graph or stream or snapshot or pool"

# Written next to the copy of the test file. A test file from another
# PyTorch version may import a helper this torch.testing._internal lacks;
# a no-op stands in so the module still imports (a test needing the real
# helper then fails in both runs alike).
CONFTEST = r'''
import importlib
import sys


class _Missing:
    """Stands for a helper this torch.testing._internal lacks: false as a
    flag, a no-op as a decorator or decorator factory."""

    def __init__(self, name):
        self.name = name

    def __bool__(self):
        return False

    def __call__(self, *a, **k):
        if len(a) == 1 and callable(a[0]) and not k:
            return a[0]
        return self


def _fallbacks():
    for m in ("common_utils", "common_cuda", "common_device_type", "common_optimizers",
              "autocast_test_lists"):
        mod = importlib.import_module("torch.testing._internal." + m)

        def missing(name, _m=m):
            if name.startswith("__"):
                raise AttributeError(name)
            print(f"run_torch_tests: torch.testing._internal.{_m}.{name} missing, "
                  "a no-op stands in", file=sys.stderr)
            return _Missing(name)

        if not hasattr(mod, "__getattr__"):
            mod.__getattr__ = missing


_fallbacks()


def pytest_report_header(config):
    import torch
    import torch.cuda
    mode = "native"
    try:
        import cachealloc_torch
        if cachealloc_torch.is_enabled():
            mode = "cachealloc " + cachealloc_torch.mode()
    except Exception as e:  # noqa: BLE001
        mode = f"native (cachealloc_torch not importable: {e})"
    return [f"torch {torch.__version__}, allocator: {mode}, "
            f"backend {torch.cuda.get_allocator_backend() if torch.cuda.is_available() else '-'}"]
'''

WARMUP = r'''
import cachealloc_torch, torch
assert cachealloc_torch.is_enabled(), "the start-up hook did not enable cachealloc"
x = torch.ones(1 << 20, device="cuda")
print("cachealloc mode:", cachealloc_torch.mode(), "allocated:", torch.cuda.memory_allocated())
assert cachealloc_torch.mode() == "cpp", cachealloc_torch.mode()
'''

LINE = re.compile(r"(?:\[gw\d+\]\s+(?:\[\s*\d+%\]\s+)?)?(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
                  r"\s+(\S+::\S+)|(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def outcomes_from_xml(path):
    """{test id: (outcome, message)} from a junit XML file."""
    res = {}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return res
    for tc in root.iter("testcase"):
        cls = tc.get("classname", "").split(".")[-1]
        tid = f"{cls}::{tc.get('name')}"
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                msg = (el.get("message") or el.text or "").strip()
                break
        res[tid] = (outcome, msg)
    return res


def outcomes_from_log(path):
    """{test id: (outcome, "")} from pytest -v output (when no XML was written)."""
    res = {}
    try:
        text = open(path, errors="replace").read()
    except OSError:
        return res
    for m in LINE.finditer(text):
        word, node = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
        tid = "::".join(node.split("::")[-2:])
        res[tid] = (word.lower().replace("xpass", "passed").replace("xfail", "skipped"), "")
    return res


def have(module):
    return subprocess.run([sys.executable, "-c", f"import {module}"],
                          capture_output=True).returncode == 0


def run_variant(name, env_extra, args, workdir):
    xml = os.path.join(args.out, f"{name}.xml")
    log = os.path.join(args.out, f"{name}.log")
    cmd = [sys.executable, "-m", "pytest", "test_cuda.py", "-k", args.k, "-v",
           "-p", "no:cacheprovider", f"--junitxml={xml}", "-o", "junit_family=xunit1",
           "--tb=line", "-rN"]
    if args.per_test_timeout and have("pytest_timeout"):
        cmd.append(f"--timeout={args.per_test_timeout}")
    if args.workers and have("xdist"):
        # One worker: a test that crashes the process takes only itself down.
        cmd += ["-n", str(args.workers), "--max-worker-restart", "1000"]
    env = dict(os.environ)
    env.pop("CACHEALLOC_TORCH", None)
    env.update(env_extra)
    env["PYTHONUNBUFFERED"] = "1"
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=args.budget)
        except subprocess.TimeoutExpired:
            # SIGINT first: pytest then still writes its XML.
            os.killpg(p.pid, signal.SIGINT)
            try:
                rc = p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                rc = p.wait()
            f.write(f"\nrun_torch_tests: stopped after {args.budget} s\n")
    res = outcomes_from_xml(xml)
    from_log = outcomes_from_log(log)
    for tid, o in from_log.items():
        res.setdefault(tid, o)
    print(f"{name}: rc {rc}, {time.time() - t0:.0f} s, {len(res)} tests reported", flush=True)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--test-file", required=True, help="PyTorch's test/test_cuda.py")
    ap.add_argument("--wheel", help="install this cachealloc_torch wheel first (offline)")
    ap.add_argument("--out", default="torch-tests-out")
    ap.add_argument("-k", default=DEFAULT_K, help="pytest -k expression")
    ap.add_argument("--budget", type=float, default=200, help="seconds per run")
    ap.add_argument("--per-test-timeout", type=int, default=60)
    ap.add_argument("--workers", type=int, default=1, help="pytest-xdist workers (0: none)")
    ap.add_argument("--variants", default="native,cachealloc")
    ap.add_argument("--skip-warmup", action="store_true",
                    help="do not check that cachealloc can be enabled first")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    if args.wheel:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                               "--no-index", "--force-reinstall", args.wheel])
    workdir = tempfile.mkdtemp(prefix="torch-tests-")
    shutil.copy(args.test_file, os.path.join(workdir, "test_cuda.py"))
    with open(os.path.join(workdir, "conftest.py"), "w") as f:
        f.write(CONFTEST)

    variants = args.variants.split(",")
    if "cachealloc" in variants and not args.skip_warmup:
        # Builds the C++ extension once (cached for the test processes) and
        # checks the start-up hook installs it.
        env = dict(os.environ, CACHEALLOC_TORCH="1")
        w = subprocess.run([sys.executable, "-c", WARMUP], env=env, capture_output=True,
                           text=True)
        print((w.stdout + w.stderr).strip()[-2000:], flush=True)
        if w.returncode != 0:
            print("cachealloc could not be enabled; not running the tests")
            return 2

    results = {}
    for v in variants:
        extra = {"CACHEALLOC_TORCH": "1"} if v == "cachealloc" else {}
        results[v] = run_variant(v, extra, args, workdir)

    if not any(results.values()):
        print("no test reported a result")
        return 2
    if len(variants) < 2:
        return 0
    nat, cac = results[variants[0]], results[variants[1]]
    both_ran = sorted(set(nat) & set(cac))
    npass = [t for t in both_ran if nat[t][0] == "passed"]
    cpass = [t for t in both_ran if cac[t][0] == "passed"]
    lost = [t for t in npass if cac[t][0] != "passed"]
    gained = [t for t in cpass if nat[t][0] != "passed"]
    lines = [
        f"tests reported by both runs: {len(both_ran)} "
        f"(native only: {len(set(nat) - set(cac))}, cachealloc only: {len(set(cac) - set(nat))})",
        f"pass natively: {len(npass)}; pass with cachealloc: {len(cpass)}; "
        f"pass with both: {len(npass) - len(lost)}",
        f"pass natively, not with cachealloc: {len(lost)}",
    ]
    lines += [f"  {t}: {cac[t][0]}: {cac[t][1][:300]!r}" for t in lost]
    lines.append(f"pass with cachealloc, not natively: {len(gained)}")
    lines += [f"  {t}: native {nat[t][0]}: {nat[t][1][:200]!r}" for t in gained]
    lines.append("")
    lines.append("| test | native | cachealloc |")
    lines.append("|---|---|---|")
    lines += [f"| {t} | {nat[t][0]} | {cac[t][0]} |" for t in both_ran]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(text)
    print("\n".join(lines[: 5 + len(lost) + len(gained)]))
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
