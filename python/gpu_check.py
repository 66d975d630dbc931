"""What the GPU test scripts (python/test_gpu*.py) share: one `ok`/`FAIL`
line per check, the names of the failed ones in FAILED, and a skip that
exits 0 with its reason."""

import sys

FAILED = []


def check(name, cond, detail=""):
    print(f"{'ok  ' if cond else 'FAIL'} {name}" + (f": {detail}" if detail else ""), flush=True)
    if not cond:
        FAILED.append(name)
    return cond


def skip(reason):
    print(f"skipping: {reason}", flush=True)
    sys.exit(0)
