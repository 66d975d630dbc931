"""Converts a PyTorch memory snapshot pickle into the plain trace format.

    python3 -m cachealloc_torch.snapshot_trace SNAPSHOT.pickle OUT.trace[.gz] [--device N]

SNAPSHOT.pickle is what torch.cuda.memory._dump_snapshot() writes after
torch.cuda.memory._record_memory_history() (from PyTorch's own allocator or
from cachealloc's C++ interface). Each `alloc` of the device's trace becomes
`a <id> <bytes> <stream>`, each `free_requested` of a traced allocation
`f <id>` (pairing by address, as traces/*.trace.gz were made); frees of
allocations made before recording started are left out, and so are the
allocations themselves that are still live only from before. The `cachealloc`
CLI also reads such pickles directly (see docs/PYTORCH.md); this converter is
for tools that want the text.
"""

import argparse
import gzip
import pickle
import sys


def events(snapshot, device=None):
    """Yields plain trace lines from a snapshot dict."""
    traces = snapshot.get("device_traces", [])
    if device is None:
        device = next((d for d, t in enumerate(traces) if t), 0)
    trace = traces[device] if device < len(traces) else []
    live = {}
    next_id = 0
    for e in trace:
        action = e.get("action")
        if action == "alloc":
            addr = e["addr"]
            if addr in live:  # a free the trace lost: close the old one
                yield f"f {live.pop(addr)}"
            live[addr] = next_id
            yield f"a {next_id} {int(e['size'])} {int(e.get('stream', 0) or 0)}"
            next_id += 1
        elif action == "free_requested":
            i = live.pop(e["addr"], None)
            if i is not None:
                yield f"f {i}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("snapshot")
    ap.add_argument("out")
    ap.add_argument("--device", type=int, help="device whose trace to convert (default: the first with events)")
    a = ap.parse_args(argv)
    with open(a.snapshot, "rb") as f:
        snap = pickle.load(f)
    opener = gzip.open if a.out.endswith(".gz") else open
    n = 0
    with opener(a.out, "wt") as out:
        for line in events(snap, a.device):
            out.write(line + "\n")
            n += 1
    print(f"{n} events written to {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
