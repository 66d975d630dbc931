#!/usr/bin/env bash
# Fuzz smoke: builds the three fuzz targets and runs each for a bounded time
# from the committed seed corpus; fails on the first crash (the input is
# saved under fuzz/artifacts/TARGET/). For CI and before a push.
#
#   scripts/fuzz-smoke.sh            # 30 s per target
#   FUZZ_SMOKE_SECONDS=60 scripts/fuzz-smoke.sh
#   FUZZ_SMOKE_SEED=1 scripts/fuzz-smoke.sh   # fixed mutation seed (default: random)
#
# From scratch (cargo-fuzz not installed, cold registry and target dir) on
# this 2-core machine it took under 3 minutes, plus a nightly toolchain
# download where there is none; see docs/FUZZING.md for the measured split.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SMOKE_SECONDS:-30}
seed=${FUZZ_SMOKE_SEED:-0}   # libFuzzer: 0 = random
t0=$SECONDS

scripts/fuzz-setup.sh
t1=$SECONDS
# -s none: the core forbids unsafe code (see docs/FUZZING.md); -a keeps
# debug assertions and overflow checks on in the optimized build.
flags=(-O -a -s none)
cargo +nightly fuzz build "${flags[@]}"
t2=$SECONDS

# Fuzz a scratch copy of the seeds, so the run writes nothing into the repository.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
summary=()
for target in ops trace config; do
    mkdir -p "$work/$target"
    cp fuzz/corpus/"$target"/seed-* "$work/$target/"
    log="$work/$target.log"
    dict=()
    [ -f "fuzz/dict/$target.dict" ] && dict=(-dict="$PWD/fuzz/dict/$target.dict")
    echo "fuzz-smoke: $target for ${seconds}s" >&2
    if ! cargo +nightly fuzz run "${flags[@]}" "$target" "$work/$target" -- \
        -max_total_time="$seconds" -seed="$seed" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 "${dict[@]}" >"$log" 2>&1; then
        tail -40 "$log" >&2
        echo "fuzz-smoke: $target FAILED; the input is in fuzz/artifacts/$target/" >&2
        exit 1
    fi
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
    cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$log" | tail -1)
    summary+=("$target: $runs runs, $rate exec/s, $cov")
done
t3=$SECONDS
printf 'fuzz-smoke: %s\n' "${summary[@]}" >&2
echo "fuzz-smoke: ok (setup $((t1 - t0)) s, build $((t2 - t1)) s, fuzzing $((t3 - t2)) s, total $((t3 - t0)) s)" >&2
