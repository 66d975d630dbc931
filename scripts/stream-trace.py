#!/usr/bin/env python3
"""Writes a plain trace (docs/TRACE_FORMAT.md) over many streams, each of
which allocates a few blocks and frees them: the per-stream cost of the
allocator, apart from the cost of its blocks.

    scripts/stream-trace.py STREAMS [--blocks B] [--live L] [--gzip] > out.trace
    scripts/stream-trace.py 1000000 --gzip -o /tmp/1m.trace.gz

Stream s (ids 1..STREAMS; 0, the default stream, is not used) allocates B
blocks (default 3): sizes cycle through small-pool (<= 1 MiB) and
large-pool requests (up to 12 MiB), so that every pool kind is touched. The
blocks of stream s are freed after those of stream s + L are allocated (L
streams hold blocks at once; default 4), so blocks of several streams are
live together. Sizes depend on s only: the trace is the same on every run.
"""

import argparse
import gzip
import sys

SIZES = [
    4096,
    100_000,
    786_432,
    1_500_000,
    3 << 20,
    12 << 20,
    512,
    40_000,
]


def events(streams, blocks, live):
    """The trace's lines, one string per event."""
    held = []  # per stream, in order: the ids it holds
    free_ids = []
    next_id = 0
    for s in range(1, streams + 1):
        ids = []
        for b in range(blocks):
            if free_ids:
                i = free_ids.pop()
            else:
                i = next_id
                next_id += 1
            size = SIZES[(s * 3 + b * 5) % len(SIZES)] + 512 * (s % 7)
            yield f"a {i} {size} {s}\n"
            ids.append(i)
        held.append(ids)
        if len(held) > live:
            for i in held.pop(0):
                yield f"f {i}\n"
                free_ids.append(i)
    for ids in held:
        for i in ids:
            yield f"f {i}\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("streams", type=int, help="number of streams (ids 1..STREAMS)")
    p.add_argument("--blocks", type=int, default=3, help="blocks per stream (default 3)")
    p.add_argument("--live", type=int, default=4, help="streams holding blocks at once (default 4)")
    p.add_argument("--gzip", action="store_true", help="gzip the output")
    p.add_argument("-o", "--output", help="output file (default stdout)")
    a = p.parse_args()
    if a.streams < 1 or a.blocks < 1 or a.live < 0:
        p.error("STREAMS and --blocks must be at least 1, --live at least 0")
    raw = open(a.output, "wb") if a.output else sys.stdout.buffer
    out = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6) if a.gzip else raw
    header = f"# {a.streams} streams, {a.blocks} blocks each, {a.live} streams live at once\n"
    out.write(header.encode())
    chunk = []
    for line in events(a.streams, a.blocks, a.live):
        chunk.append(line)
        if len(chunk) >= 65536:
            out.write("".join(chunk).encode())
            chunk.clear()
    out.write("".join(chunk).encode())
    if a.gzip:
        out.close()
    raw.close()


if __name__ == "__main__":
    main()
