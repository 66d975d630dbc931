#!/usr/bin/env bash
# Runs the stable fuzz driver as N processes with seeds 1..N for SECONDS each
# and sums their final JSON lines: inputs per target, allocator operations,
# crashes. Exits 1 when any process crashed or failed.
#
# Usage: fuzz/run-parallel.sh N SECONDS OUTDIR [BINARY]
#   BINARY  a built stable_fuzz (default: build it with cargo, release)
#   CACHEALLOC_FUZZ_DIR  folder with corpus/ (default: this folder); crashes
#                        are saved under its artifacts/stable/
#   FUZZ_SEED0           seeds are FUZZ_SEED0+1 .. FUZZ_SEED0+N (default 0), so
#                        that a second run tries other inputs
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ $# -ge 3 ] || { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
n="$1"; secs="$2"; out="$3"; bin="${4:-}"
case "$n$secs" in *[!0-9]*|"") echo "error: N and SECONDS must be whole numbers" >&2; exit 2 ;; esac
if [ -z "$bin" ]; then
  (cd "$here" && cargo build --release --example stable_fuzz >&2)
  bin="$here/target/release/examples/stable_fuzz"
fi
export CACHEALLOC_FUZZ_DIR="${CACHEALLOC_FUZZ_DIR:-$here}"
mkdir -p "$out"
pids=()
seed0="${FUZZ_SEED0:-0}"
case "$seed0" in *[!0-9]*|"") echo "error: FUZZ_SEED0 must be a whole number" >&2; exit 2 ;; esac
for s in $(seq $((seed0 + 1)) $((seed0 + n))); do
  "$bin" "$secs" "$s" > "$out/seed-$s.out" 2> "$out/seed-$s.err" & pids+=($!)
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
python3 - "$out" "$n" "$fail" <<'PY'
import json, pathlib, sys
out, n, fail = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rows = []
for f in sorted(out.glob("seed-*.out")):
    lines = [l for l in f.read_text().splitlines() if l.startswith("{")]
    if lines:
        rows.append(json.loads(lines[-1]))
keys = ["ops_inputs", "trace_inputs", "config_inputs", "ops", "crashes"]
tot = {k: sum(r[k] for r in rows) for k in keys}
tot["processes"] = len(rows)
print(json.dumps(tot))
sys.exit(1 if fail or tot["crashes"] or len(rows) != n else 0)
PY
