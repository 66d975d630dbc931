#!/usr/bin/env bash
# Side-by-side latency rounds on the GPU machine: each round runs PyTorch's
# anchor bench (python/bench/latency_bench.py), then cachealloc's GPU bench
# (benches/gpu_latency) twice, then any extra bench binaries given (e.g. an
# older core's build), so that every ratio is taken within one round and the
# order effect (the first process after PyTorch's) shows. Host timings on
# virtualized GPU hosts move by ±30% between runs, so compare within rounds
# and report every round.
#
# Usage (repo root, after scripts/build-gpu-bundle.sh):
#   scripts/gpu-latency-rounds.sh OUTDIR [ROUNDS] [NAME=BENCH_BINARY ...]
#
# Writes OUTDIR/rounds.tgz (every log and JSON in one file, easy to copy
# back from the GPU machine) and prints, per round, the pair and random-op latencies
# of each bench and cachealloc's ratio to PyTorch.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUTDIR="${1:?usage: $0 OUTDIR [ROUNDS] [NAME=BENCH ...]}"
ROUNDS="${2:-3}"
case "$ROUNDS" in
  ''|*[!0-9]*) echo "error: ROUNDS must be a number, got '$ROUNDS' (usage: $0 OUTDIR [ROUNDS] [NAME=BENCH ...])" >&2; exit 2 ;;
esac
shift $(( $# >= 2 ? 2 : 1 ))
BUNDLE="${BUNDLE_DIR:-gpu-bundle}"
mkdir -p "$OUTDIR/rounds"
R="$OUTDIR/rounds"

# name=binary pairs, run in this order after PyTorch's bench
RUNS=("new=$BUNDLE/benches/gpu_latency" "new_again=$BUNDLE/benches/gpu_latency" "$@")

for r in $(seq 1 "$ROUNDS"); do
  (cd python/bench && python3 latency_bench.py "$R/torch_$r.json" > "$R/torch_$r.log" 2>&1) \
    || echo "round $r: PyTorch bench failed (see torch_$r.log)"
  for run in "${RUNS[@]}"; do
    name="${run%%=*}"; bin="${run#*=}"
    "$bin" --json "$R/${name}_$r.json" > "$R/${name}_$r.log" 2>&1 || echo "round $r: $name failed"
  done
done
tar czf "$OUTDIR/rounds.tgz" -C "$OUTDIR" rounds

python3 - "$R" "$ROUNDS" "${RUNS[@]%%=*}" <<'EOF'
import json, sys, os
d, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
cases = [("pair 512 B", "pair_ns[512]"), ("pair 64 KiB", "pair_ns[65536]"),
         ("pair 1 MiB", "pair_ns[1048576]"), ("pair 16 MiB", "pair_ns[16777216]"),
         ("pair 256 MiB", "pair_ns[268435456]"),
         ("random 256 slots", "mixed_ns[256 slots, <=8MiB]"),
         ("random 4096 slots", "mixed_ns[4096 slots, <=64MiB]")]
def load(name, r, prefix):
    p = os.path.join(d, f"{name}_{r}.json")
    try:
        j = json.load(open(p))
    except Exception:
        return {}
    j = j.get("results", j)
    return {k[len(prefix) + 1:]: v for k, v in j.items() if isinstance(v, (int, float)) and k.startswith(prefix + "_")}
for r in range(1, rounds + 1):
    t = load("torch", r, "torch")
    print(f"round {r}")
    print("| case | PyTorch | " + " | ".join(f"{n} (ratio)" for n in names) + " |")
    for label, key in cases:
        row = [f"{t.get(key, float('nan')):.0f}"]
        for n in names:
            v = load(n, r, "cachealloc").get(key, float("nan"))
            row.append(f"{v:.0f} ({v / t.get(key, float('nan')):.2f})")
        print(f"| {label} | " + " | ".join(row) + " |")
EOF
