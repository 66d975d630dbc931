#!/usr/bin/env bash
# Runs the stable fuzz driver (examples/stable_fuzz.rs) as N processes with
# seeds BASE+1 .. BASE+N for SECONDS each, then sums their final JSON lines.
#
#   fuzz/run-parallel.sh N SECONDS OUTDIR
#
# OUTDIR receives seed-K.json (each process's final line), seed-K.log (its
# crash messages), crashes/ (the crashing inputs, each with a .txt message)
# and total.json (the sum), which is also printed as the last line.
# Environment: STABLE_FUZZ_BIN (default: fuzz/target/release/examples/stable_fuzz,
# built by `cd fuzz && cargo build --release --example stable_fuzz`),
# SEED_BASE (default 0), STABLE_FUZZ_CORPUS and STABLE_FUZZ_PRESET (see the
# driver; total.json names the preset).
set -euo pipefail

if [ $# -ne 3 ]; then
    echo "usage: $0 N SECONDS OUTDIR" >&2
    exit 2
fi
n=$1 seconds=$2 out=$3
here=$(cd "$(dirname "$0")" && pwd)
bin=${STABLE_FUZZ_BIN:-$here/target/release/examples/stable_fuzz}
base=${SEED_BASE:-0}
if [ ! -x "$bin" ]; then
    echo "$bin not found: cd fuzz && cargo build --release --example stable_fuzz" >&2
    exit 2
fi
# The seeds, wherever the driver was built.
export STABLE_FUZZ_CORPUS=${STABLE_FUZZ_CORPUS:-$here/corpus}
mkdir -p "$out/crashes"

pids=()
for k in $(seq $((base + 1)) $((base + n))); do
    "$bin" "$seconds" "$k" "$out/crashes" >"$out/seed-$k.out" 2>"$out/seed-$k.log" &
    pids+=($!)
done
failed=0
for p in "${pids[@]}"; do
    wait "$p" || failed=$((failed + 1))
done
for k in $(seq $((base + 1)) $((base + n))); do
    tail -n 1 "$out/seed-$k.out" >"$out/seed-$k.json"
    rm -f "$out/seed-$k.out"
done

python3 - "$out" "$n" "$failed" <<'PY'
import glob, json, os, sys
out, n, failed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
total = {"processes": n, "processes_failed": failed, "processes_reported": 0,
         "runs": 0, "ops": 0, "crashes": 0, "targets": {}, "ops_per_s": 0.0}
for path in sorted(glob.glob(os.path.join(out, "seed-*.json"))):
    try:
        r = json.loads(open(path).read())
    except (ValueError, OSError):
        continue  # a process that died before its final line counts as failed
    total["processes_reported"] += 1
    total["preset"] = r.get("preset")
    for k in ("runs", "ops", "crashes", "ops_per_s"):
        total[k] += r[k]
    for t, v in r["targets"].items():
        acc = total["targets"].setdefault(t, {"runs": 0, "ops": 0, "crashes": 0})
        for k in acc:
            acc[k] += v[k]
total["ops_per_s"] = round(total["ops_per_s"])
total["crash_files"] = len([f for f in os.listdir(os.path.join(out, "crashes"))
                            if not f.endswith(".txt")])
line = json.dumps(total, separators=(",", ":"))
open(os.path.join(out, "total.json"), "w").write(line + "\n")
print(line)
PY
