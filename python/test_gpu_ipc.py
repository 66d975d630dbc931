"""GPU test of CUDA IPC on cachealloc (docs/PYTORCH.md): a producer sends
CUDA tensors of many sizes (small pool, large pool, over several pages) to a
consumer through a torch.multiprocessing queue, both processes on
cachealloc; the consumer checks the data and writes to every tensor, the
producer checks the writes; the producer's allocator hands out no block a
consumer still holds (the producer drops its tensors and allocates the same
sizes again); and the memory comes back once both sides dropped them
(torch.cuda statistics, cachealloc_torch.ipc_stats(): handles closed on the
consumer, blocks unpinned and pages released on the producer). Then the same
with PyTorch's own allocator on one side, each way round (PyTorch 2.11's
handle formats). Each under CACHEALLOC_CONF=default (expandable segments:
pages shared as file descriptors) and =segments (plain segments:
cudaIpcMemHandle).

    python3 python/test_gpu_ipc.py [--lib PATH] [--conf default,segments]

Every scenario runs in a process of its own (the parent) that starts the
other side with torch.multiprocessing's spawn. Exit status 0 when every
check passed or was skipped (`skip` lines give the reason: a kernel whose
ptrace rules forbid a child to take its parent's file descriptors cannot
open pages of expandable segments its parent sent), 1 when one failed.
"""

import argparse
import gc
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# Bytes of each tensor sent: small pool (up to 1 MiB; three of 4 KiB on
# one segment or page, so that one handle serves several tensors), large
# pool, and blocks over several pages (pages are up to 8 MiB).
SIZES = [512, 4096, 4096, 4096, 200_000, 1 << 20, (3 << 20) + 12_345, 20 << 20,
         (37 << 20) + 4_321, 130 << 20]

# scenario: (parent's allocator, child's allocator, parent's side, transport)
SCENARIOS = {
    "child-to-parent": ("cachealloc", "cachealloc", "consumer", "queue"),
    "parent-to-child": ("cachealloc", "cachealloc", "producer", "queue"),
    "cachealloc-to-pytorch": ("pytorch", "cachealloc", "consumer", "reduce"),
    "pytorch-to-cachealloc": ("cachealloc", "pytorch", "consumer", "reduce"),
}

TIMEOUT = 300
FAILED = []


def check(name, cond, detail=""):
    """One line per check; `detail` is shown when it failed."""
    print(f"{'ok  ' if cond else 'FAIL'} {name}" + (f": {detail}" if detail and not cond else ""),
          flush=True)
    if not cond:
        FAILED.append(name)
    return cond


def skip_check(name, reason):
    print(f"skip {name}: {reason}", flush=True)


class PeerError(RuntimeError):
    """The other side reported an error."""


class Peer:
    """The two queues to the other side: tagged messages, with a timeout."""

    def __init__(self, out, inbox):
        self.out, self.inbox = out, inbox

    def send(self, tag, payload=None):
        self.out.put((tag, payload))

    def recv(self, tag):
        import queue
        try:
            got, payload = self.inbox.get(timeout=TIMEOUT)
        except queue.Empty:
            raise PeerError(f"nothing from the other side in {TIMEOUT} s (waiting for {tag})")
        if got == "error":
            raise PeerError(payload)
        if got != tag:
            raise PeerError(f"expected {tag}, got {got}")
        return payload


def pattern(n, i, device):
    """n bytes that differ with the position at every scale (an offset or a
    page out of place shows), and with i."""
    import torch
    x = torch.arange(n, dtype=torch.int32, device=device)
    v = (x * 7 + (x >> 12) * 5 + (x >> 20) * 11 + 13 * i) % 251
    return v.to(torch.uint8)


def overlaps(a, b):
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


def producer(peer, cfg):
    """Makes the tensors, sends them, checks the consumer's writes, drops
    them while the consumer holds them and allocates again, then checks
    that everything comes back once the consumer released them."""
    import torch
    ca = cfg["ca"]
    name = cfg["label"] + " producer"
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    base_alloc = torch.cuda.memory_allocated()
    ts = []
    for i, n in enumerate(SIZES):
        t = torch.empty(n, dtype=torch.uint8, device=dev)
        t.copy_(pattern(n, i, dev))
        ts.append(t)
    torch.cuda.synchronize()
    spans = [(t.data_ptr(), t.numel()) for t in ts]
    expandable = bool(ca and ca.info()["expandable"])
    if cfg["transport"] == "queue":
        peer.send("tensors", ts)
        kinds = None
    else:
        from torch.multiprocessing.reductions import reduce_tensor
        reduced = [reduce_tensor(t) for t in ts]
        kinds = [chr(r[1][7][0]) for r in reduced]
        peer.send("reduced", reduced)
    opened = peer.recv("opened")  # per tensor: None, or why it could not be opened
    skipped = [i for i, why in enumerate(opened) if why is not None]
    if len(skipped) == len(SIZES):
        # The consumer opened nothing (it says why, as a failure or a skip);
        # the blocks stay with PyTorch's reference counts: nothing to check here.
        peer.send("done")
        return
    peer.recv("written")
    bad = [SIZES[i] for i, t in enumerate(ts) if i not in skipped
           and not torch.equal(t, pattern(t.numel(), i, dev) + 1)]
    check(f"{name}: sees the consumer's writes to every tensor it opened", not bad,
          f"wrong data in tensors of {bad} bytes")
    if ca is not None:
        st = ca.ipc_stats()
        want = len(SIZES) if expandable else 0
        check(f"{name}: blocks shared are pinned ({'expandable' if expandable else 'plain'})",
              st["pinned_blocks"] == want, str(st))
        if expandable:
            check(f"{name}: pages exported as file descriptors", st["exported_pages"] > 0, str(st))
    # Dropped here while the consumer holds them: PyTorch keeps the blocks
    # (CudaIPCSentData) and the allocator must not hand them out again.
    del ts, t
    gc.collect()
    torch.cuda.ipc_collect()
    again = [torch.zeros(n, dtype=torch.uint8, device=dev) for n in SIZES for _ in range(2)]
    torch.cuda.synchronize()
    reused = [(hex(a.data_ptr()), a.numel()) for a in again
              if any(overlaps((a.data_ptr(), a.numel()), s) for s in spans)]
    check(f"{name}: no block a consumer holds is handed out again", not reused, str(reused[:4]))
    peer.send("reallocated")
    peer.recv("unchanged")
    peer.recv("released")
    del again
    gc.collect()
    torch.cuda.ipc_collect()
    check(f"{name}: memory comes back once both sides dropped the tensors",
          torch.cuda.memory_allocated() == base_alloc,
          f"{torch.cuda.memory_allocated()} bytes allocated, {base_alloc} before")
    if ca is not None:
        st = ca.ipc_stats()
        check(f"{name}: nothing pinned once freed", st["pinned_blocks"] == 0, str(st))
        torch.cuda.empty_cache()
        st = ca.ipc_stats()
        check(f"{name}: empty_cache releases the exported pages",
              st["exported_pages"] == 0 and torch.cuda.memory_reserved() == 0,
              f"{st}; reserved {torch.cuda.memory_reserved()}")
    if kinds is not None:
        print(f"     {name}: handle kinds {''.join(kinds)}", flush=True)
    peer.send("done")


def consumer(peer, cfg):
    """Opens the tensors, checks them and writes to each; checks they are
    unchanged while the producer allocates again; drops them and checks
    that every handle is closed."""
    import torch
    ca = cfg["ca"]
    name = cfg["label"] + " consumer"
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    ts, opened = [], []
    if cfg["transport"] == "queue":
        try:
            ts = peer.recv("tensors")
            opened = [None] * len(ts)
        except Exception as e:  # noqa: BLE001 (opening failed: told to the producer)
            if isinstance(e, PeerError):
                raise
            opened = [f"{type(e).__name__}: {e}"] * len(SIZES)
            ts = [None] * len(SIZES)
    else:
        for i, (rebuild, args) in enumerate(peer.recv("reduced")):
            try:
                ts.append(rebuild(*args))
                opened.append(None)
            except Exception as e:  # noqa: BLE001
                ts.append(None)
                why = f"{type(e).__name__}: {e}"
                opened.append(why)
                # Give the producer its block back: this consumer will not.
                torch.UntypedStorage._release_ipc_counter(args[11], args[12], device=args[6])
                kind = chr(args[7][0])
                if cfg["alloc"] == "pytorch" and kind == "C":
                    skip_check(f"{name}: a tensor of {SIZES[i]} bytes",
                               "its pages are of several sizes: cachealloc's own handle, "
                               "which PyTorch's allocator does not read")
                else:
                    check(f"{name}: opens the tensor of {SIZES[i]} bytes (handle kind "
                          f"{kind!r})", False, why[-300:])
    peer.send("opened", opened)
    if all(w is not None for w in opened):
        if cfg["transport"] == "queue":
            if "pidfd_getfd" in opened[0] and "Operation not permitted" in opened[0]:
                skip_check(f"{name}: opens the tensors",
                           "this kernel forbids taking the producer's file descriptors")
            else:
                check(f"{name}: opens the tensors", False, opened[0][-400:])
        peer.recv("done")
        return
    bad = [SIZES[i] for i, t in enumerate(ts)
           if t is not None and not torch.equal(t, pattern(t.numel(), i, dev))]
    check(f"{name}: reads every tensor's data", not bad, f"wrong data in tensors of {bad} bytes")
    for t in ts:
        if t is not None:
            t.add_(1)
    torch.cuda.synchronize()
    peer.send("written")
    peer.recv("reallocated")
    torch.cuda.synchronize()
    changed = [SIZES[i] for i, t in enumerate(ts)
               if t is not None and not torch.equal(t, pattern(t.numel(), i, dev) + 1)]
    check(f"{name}: its tensors are untouched while the producer allocates again",
          not changed, f"tensors of {changed} bytes changed")
    peer.send("unchanged")
    n = sum(t is not None for t in ts)
    if ca is not None:
        st = ca.ipc_stats()
        check(f"{name}: one handle open per segment or page run, counted per tensor",
              st["users"] == n and 0 < st["open"] <= n
              and (n < len(SIZES) or st["open"] < n), str(st))
    del ts, t
    gc.collect()
    torch.cuda.synchronize()
    if ca is not None:
        st = ca.ipc_stats()
        check(f"{name}: every handle closed once the tensors are dropped",
              st["open"] == 0 and st["users"] == 0 and st["opened"] == st["closed"] > 0,
              str(st))
    peer.send("released")
    peer.recv("done")


def side(role, alloc, transport, label, so, peer):
    """Runs one side: enables cachealloc first where it is the allocator."""
    sys.path.insert(0, HERE)
    ca = None
    if alloc == "cachealloc":
        import cachealloc_torch
        cachealloc_torch.enable(so, mode="cpp")
        ca = cachealloc_torch
    cfg = {"ca": ca, "alloc": alloc, "transport": transport, "label": label}
    try:
        (producer if role == "producer" else consumer)(peer, cfg)
    except Exception as e:  # noqa: BLE001 (reported, and to the other side)
        import traceback
        traceback.print_exc()
        check(f"{label} {role}: ran to the end", False, f"{type(e).__name__}: {e}"[-400:])
        try:
            peer.send("error", f"{label} {role}: {type(e).__name__}: {e}")
        except Exception:  # noqa: BLE001
            pass


def child_main(role, alloc, transport, label, so, to_child, to_parent):
    """The spawned side (its exit status: 1 when one of its checks failed;
    a normal exit, so that the queue's last message is flushed first)."""
    side(role, alloc, transport, label, so, Peer(to_parent, to_child))
    sys.stdout.flush()
    sys.exit(1 if FAILED else 0)


def run_scenario(scenario, so, conf):
    """One scenario, in this process (the parent) and a spawned child."""
    import torch.multiprocessing as mp
    parent_alloc, child_alloc, parent_role, transport = SCENARIOS[scenario]
    child_role = "producer" if parent_role == "consumer" else "consumer"
    label = f"[{conf}] {scenario}"
    ctx = mp.get_context("spawn")
    to_child, to_parent = ctx.Queue(), ctx.Queue()
    # cachealloc first here (before CUDA is used), then the child.
    if parent_alloc == "cachealloc":
        sys.path.insert(0, HERE)
        import cachealloc_torch
        cachealloc_torch.enable(so, mode="cpp")
    p = ctx.Process(target=child_main,
                    args=(child_role, child_alloc, transport, label, so, to_child, to_parent))
    p.start()
    side(parent_role, parent_alloc, transport, label, so, Peer(to_child, to_parent))
    p.join(TIMEOUT)
    if p.is_alive():
        p.kill()
    check(f"{label}: the {child_role} (child) ended cleanly", p.exitcode == 0,
          f"exit code {p.exitcode}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib")
    ap.add_argument("--conf", default="default,segments")
    ap.add_argument("--scenario", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.scenario:
        run_scenario(a.scenario, a.lib, os.environ.get("CACHEALLOC_CONF", ""))
        sys.stdout.flush()
        sys.exit(1 if FAILED else 0)
    try:
        import torch
    except ImportError as e:
        print(f"skipping: PyTorch is not installed ({e})")
        return 0
    sys.path.insert(0, HERE)
    import cachealloc_torch as ca
    try:
        so = ca.library_path(a.lib)
    except FileNotFoundError as e:
        print(f"skipping: {e}")
        return 0
    if not torch.cuda.is_available():
        print("skipping: no CUDA device visible to PyTorch")
        return 0
    print(f"library {so}; torch {torch.__version__}", flush=True)
    failed = 0
    for conf in [c for c in a.conf.split(",") if c]:
        for scenario in SCENARIOS:
            env = dict(os.environ)
            # (CACHEALLOC_TORCH=1 would put the start-up hook's cachealloc
            # under the sides meant to run PyTorch's own allocator.)
            for k in ("CACHEALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
                      "CACHEALLOC_TORCH"):
                env.pop(k, None)
            env["CACHEALLOC_CONF"] = conf
            if conf != "segments":
                # PyTorch's own allocator on the other side: expandable too.
                env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
            t0 = time.time()
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--scenario", scenario,
                                "--lib", so], env=env, capture_output=True, text=True,
                               timeout=4 * TIMEOUT)
            lines = r.stdout.splitlines()
            for line in lines:
                if line.startswith(("ok ", "FAIL", "skip", "     ")):
                    print(line, flush=True)
            fails = sum(line.startswith("FAIL") for line in lines)
            if r.returncode != 0 and fails == 0:
                tail = (r.stdout + r.stderr).strip()[-1500:]
                print(f"FAIL [{conf}] {scenario}: exit code {r.returncode}\n{tail}", flush=True)
                fails = 1
            elif fails:
                print((r.stderr or "").strip()[-1500:], flush=True)
            print(f"     [{conf}] {scenario}: {time.time() - t0:.1f} s", flush=True)
            failed += fails
    print("all passed" if failed == 0 else f"{failed} check(s) failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
