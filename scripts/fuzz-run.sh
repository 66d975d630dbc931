#!/usr/bin/env bash
# Runs one fuzz target for a while on one core, keeping on after crashes.
#
#   scripts/fuzz-run.sh TARGET [SECONDS] [extra libFuzzer flags...]
#
# TARGET: ops, trace or config (see docs/FUZZING.md); SECONDS: default 900.
# The corpus grows in fuzz/corpus/TARGET (only seed-* files are committed),
# crashes land in fuzz/artifacts/TARGET/, the libFuzzer log in
# fuzz/artifacts/TARGET.log; fuzz/dict/TARGET.dict, if there, is the
# libFuzzer dictionary. One worker process (-fork=1) with
# -ignore_crashes=1, so a crash is recorded and the run goes on; run one
# target at a time on a shared machine.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:?usage: scripts/fuzz-run.sh TARGET [SECONDS] [libFuzzer flags...]}
seconds=${2:-900}
shift $(( $# >= 2 ? 2 : 1 ))

scripts/fuzz-setup.sh
# The core forbids unsafe code, so AddressSanitizer adds cost and finds
# nothing there; debug assertions and overflow checks stay on (-a).
flags=(-O -a -s none)
cargo +nightly fuzz build "${flags[@]}" "$target"
mkdir -p "fuzz/corpus/$target" "fuzz/artifacts/$target"
log="fuzz/artifacts/$target.log"
dict=()
[ -f "fuzz/dict/$target.dict" ] && dict=(-dict="$PWD/fuzz/dict/$target.dict")
echo "fuzz-run: $target for ${seconds}s, log in $log" >&2
cargo +nightly fuzz run "${flags[@]}" "$target" -- \
    -max_total_time="$seconds" -fork=1 -ignore_crashes=1 \
    -max_len=4096 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 "${dict[@]}" "$@" \
    >"$log" 2>&1 || true
grep -E '^#[0-9]+: cov' "$log" | tail -1 >&2 || true
ls "fuzz/artifacts/$target" | grep -E '^(crash|timeout|oom|leak)-' >&2 || echo "fuzz-run: no crashes" >&2
