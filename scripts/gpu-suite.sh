#!/usr/bin/env bash
# Run every GPU check of the bundle in one go on the GPU machine: the GPU
# tests (tests/gpu_*), the variable-batch example, the latency benchmark and
# PyTorch's anchor benchmark (python/bench/latency_bench.py) in the same
# process tree, then print the side-by-side table and a summary of the steps.
#
# Usage (from the repo root, on a machine with an NVIDIA GPU, after
# scripts/build-gpu-bundle.sh has built gpu-bundle/ — here or elsewhere):
#   scripts/gpu-suite.sh [OUTDIR]          (default: /tmp/gpu-suite)
#
# Writes OUTDIR/rust_latency.json, OUTDIR/torch_latency.json, OUTDIR/table.md.
# Environment: BUNDLE_DIR (default gpu-bundle), SKIP_TORCH=1 to leave out
# PyTorch, EXAMPLE_STEPS (default 300). Exit status: 1 if any step failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUNDLE="${BUNDLE_DIR:-gpu-bundle}"
OUTDIR="${1:-/tmp/gpu-suite}"
mkdir -p "$OUTDIR"
[ -d "$BUNDLE" ] || { echo "error: $BUNDLE not found (run scripts/build-gpu-bundle.sh)" >&2; exit 2; }

echo "==> GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "(nvidia-smi not available)"
head -3 "$BUNDLE/MANIFEST.txt" 2>/dev/null | tail -2

NAMES=(); RCS=(); SECS=()
step() {
  local name="$1"; shift
  echo
  echo "==> $name: $*"
  local t0 rc
  t0=$(date +%s.%N)
  "$@"
  rc=$?
  NAMES+=("$name"); RCS+=("$rc")
  SECS+=("$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')")
  echo "<== $name: exit $rc"
}

# PyTorch's benchmark compiles a C++ extension (a minute or so of CPU):
# build it in the background while the tests run, so its run later finds it
# in the torch extensions cache. It is waited for before any timing starts.
PRECOMPILE_PID=
if [ "${SKIP_TORCH:-0}" != 1 ]; then
  (cd python/bench && python3 -c '
import latency_bench as lb
from torch.utils.cpp_extension import load_inline
load_inline("anchor_lat", cpp_sources=lb.SRC, functions=lb.FUNCS, with_cuda=True,
            extra_ldflags=["-lcudart"], verbose=False)
print("torch extension precompiled")' > "$OUTDIR/precompile.log" 2>&1) &
  PRECOMPILE_PID=$!
fi

for t in "$BUNDLE"/tests/gpu_*; do
  step "test $(basename "$t")" "$t" --test-threads=1 --nocapture
done
step "example variable_batch" "$BUNDLE/examples/variable_batch" "${EXAMPLE_STEPS:-300}"

if [ -n "$PRECOMPILE_PID" ]; then
  wait "$PRECOMPILE_PID" || { echo "torch extension precompile failed:"; cat "$OUTDIR/precompile.log"; }
fi
step "bench gpu_latency" "$BUNDLE/benches/gpu_latency" --json "$OUTDIR/rust_latency.json"
if [ "${SKIP_TORCH:-0}" != 1 ]; then
  step "pytorch latency_bench.py" env PYTHONUNBUFFERED=1 python3 python/bench/latency_bench.py "$OUTDIR/torch_latency.json"
fi

echo
echo "==> side by side"
if [ -f "$OUTDIR/rust_latency.json" ]; then
  TORCH_JSON=()
  [ -f "$OUTDIR/torch_latency.json" ] && TORCH_JSON=("$OUTDIR/torch_latency.json")
  python3 scripts/gpu-bench-table.py "$OUTDIR/rust_latency.json" "${TORCH_JSON[@]}" | tee "$OUTDIR/table.md"
fi

echo
echo "==> summary"
printf '| %-32s | %4s | %8s |\n' step exit seconds
printf '|%s|%s|%s|\n' "----------------------------------" "------" "----------"
FAILED=0
for i in "${!NAMES[@]}"; do
  printf '| %-32s | %4s | %8s |\n' "${NAMES[$i]}" "${RCS[$i]}" "${SECS[$i]}"
  [ "${RCS[$i]}" = 0 ] || FAILED=1
done
exit "$FAILED"
