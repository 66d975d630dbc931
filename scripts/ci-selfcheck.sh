#!/usr/bin/env bash
# Checks that CI fails when a test fails: copies the repository into a
# scratch directory, adds one test that always panics, runs the copy's
# .ci/run and expects it to exit non-zero with the workspace tests as the
# only failing step, the panicking test reported as failed, and the tests
# after it still run: the workspace's next test binary (--no-fail-fast) and
# the fuzz crate's tests. Prints PASS or FAIL and exits 0 or 1.
#
# Usage: scripts/ci-selfcheck.sh [--quick] [--head]
#   --quick   run only the tests (.ci/run --tests-only), not the checks after them
#   --head    copy the last commit (git archive HEAD) rather than the tracked
#             files as they are in the working tree
# The copy builds from nothing in its own target directories, as on a clean
# checkout (CARGO_TARGET_DIR is ignored: a target directory shared with the
# original tree mixes the two copies' crates). That takes as long as CI on a
# clean checkout. The scratch directory is removed at the end (KEEP=1 keeps it).
set -euo pipefail
unset CARGO_TARGET_DIR
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

quick=0
head=0
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    --head) head=1 ;;
    *) echo "usage: scripts/ci-selfcheck.sh [--quick] [--head]" >&2; exit 2 ;;
  esac
done

scratch="$(mktemp -d /tmp/ci-selfcheck.XXXXXX)"
if [ "${KEEP:-0}" = 1 ]; then
  echo "ci-selfcheck: scratch directory $scratch (kept)"
else
  trap 'rm -rf "$scratch"' EXIT
fi
copy="$scratch/repo"
mkdir -p "$copy"

if [ "$head" -eq 1 ]; then
  git -C "$ROOT" archive HEAD | tar -x -C "$copy"
else
  # Tracked files as they are now (files deleted in the working tree are left out).
  (
    cd "$ROOT"
    git ls-files -z | while IFS= read -r -d '' f; do
      if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi
    done | tar --null -T - -cf -
  ) | tar -x -C "$copy"
fi

# The injected test: formatted as rustfmt would, so that only the tests fail.
target_file="tests/bad_input.rs"
cat >>"$copy/$target_file" <<'EOF'

#[test]
fn ci_selfcheck_must_fail() {
    panic!("this test always fails: CI must report it");
}
EOF

log="$scratch/ci.log"
args=()
[ "$quick" -eq 1 ] && args+=(--tests-only)
echo "ci-selfcheck: running .ci/run ${args[*]:-} on a copy with a failing test in $target_file (log: $log)"
set +e
(cd "$copy" && .ci/run ${args[@]+"${args[@]}"}) >"$log" 2>&1
rc=$?
set -e

problems=()
[ "$rc" -ne 0 ] || problems+=(".ci/run exited 0")
grep -q '^test ci_selfcheck_must_fail \.\.\. FAILED$' "$log" ||
  problems+=("the injected test was not reported as failed")
grep -qx 'ci: FAILED: cargo test' "$log" ||
  problems+=("the failing steps were not exactly the workspace tests: $(grep '^ci: FAILED' "$log" || echo none)")
# --no-fail-fast: the workspace's test binaries after the failing one still ran.
awk '/^test ci_selfcheck_must_fail \.\.\. FAILED$/ { failed = 1 }
     failed && /Running tests\/cli\.rs/ { ran = 1 }
     END { exit !ran }' "$log" ||
  problems+=("the workspace's tests after the failing one did not run")
# The fuzz crate's tests come after the workspace's: they must still have run.
grep -q 'Running tests/bodies\.rs' "$log" ||
  problems+=("the fuzz crate's tests did not run after the failure")

if [ "${#problems[@]}" -eq 0 ]; then
  echo "ci-selfcheck: PASS (.ci/run exited $rc; the injected test failed and the remaining tests still ran)"
  exit 0
fi
echo "ci-selfcheck: FAIL (.ci/run exited $rc)"
printf '  %s\n' "${problems[@]}"
echo "  last lines of the log:"
tail -n 30 "$log" | sed 's/^/    /'
exit 1
