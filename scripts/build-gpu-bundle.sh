#!/usr/bin/env bash
# Build every GPU-facing binary with `--features cuda` on a machine without
# CUDA (linking against the stub from make-cuda-stub.sh) and collect them,
# stripped of debug info, into gpu-bundle/ to run on the GPU machine.
#
# Usage: scripts/build-gpu-bundle.sh [--workspace]
#   --workspace   also bundle the other workspace members' tests/benches/bins
#                 (default: the root package only, like a plain `cargo test`)
#
# Environment:
#   BUNDLE_DIR    output folder (default: gpu-bundle at the repo root)
#   GPU_GLIBC     newest glibc the GPU machine has (default 2.39); fails if a
#                 binary needs a newer one
#   BUNDLE_LIMIT_MIB  fail when the bundle reaches this size (default 60)
#   CARGO_TARGET_DIR etc. are honoured (artifact paths come from cargo's JSON)
#
# Layout of the bundle:
#   tests/NAME            integration test `tests/NAME.rs`
#   tests/unit-NAME       unit tests of the lib target NAME
#   tests/unit-bin-NAME   unit tests of the bin target NAME
#   benches/NAME          bench `benches/NAME.rs`
#   examples/NAME         example
#   bin/NAME              binary (the CLI)
#   lib/libNAME.so        cdylib (the C ABI library), if the package has one
#   MANIFEST.txt          build info, sizes and sha256 of every file
# Members other than the root package (with --workspace) go one level deeper:
#   tests/PKG/NAME, benches/PKG/NAME, ...
#
# On a real CUDA box none of this is needed: `cargo test --features cuda`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

SCOPE=package
for arg in "$@"; do
  case "$arg" in
    --workspace) SCOPE=workspace ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

BUNDLE="${BUNDLE_DIR:-$ROOT/gpu-bundle}"
GPU_GLIBC="${GPU_GLIBC:-2.39}"
LIMIT=$((${BUNDLE_LIMIT_MIB:-60} * 1024 * 1024))
FEATURE=cuda

case "$(cd "$(dirname "$BUNDLE")" 2>/dev/null && pwd)/$(basename "$BUNDLE")" in
  /|"$ROOT"|"$ROOT/"|"$HOME") echo "error: refusing BUNDLE_DIR=$BUNDLE" >&2; exit 2 ;;
esac

for tool in python3 strip objdump readelf; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found" >&2; exit 1; }
done

# 1. the stub libcuda.so
STUB="$ROOT/target/cuda-stub"
"$ROOT/scripts/make-cuda-stub.sh" "$STUB"
# find_cuda_helper on Linux reads only CUDA_LIBRARY_PATH (':'-separated
# roots; it links from ROOT/lib64). No cuda.h and no version check are needed.
export CUDA_LIBRARY_PATH="$STUB"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

# 2. workspace layout
cargo metadata --format-version 1 --no-deps > "$TMP/metadata.json"
read -r ROOT_PKG HAS_LIB HAS_EXAMPLES HAS_BENCHES < <(python3 - "$TMP/metadata.json" "$ROOT/Cargo.toml" <<'PY'
import json, os, sys
meta = json.load(open(sys.argv[1]))
manifest = os.path.realpath(sys.argv[2])
root = [p for p in meta["packages"] if os.path.realpath(p["manifest_path"]) == manifest]
if not root:
    sys.exit("error: the workspace root Cargo.toml is not a package")
p = root[0]
kinds = [k for t in p["targets"] for k in t["kind"]]
lib = any(k in ("lib", "rlib", "dylib", "cdylib", "staticlib") for k in kinds)
print(p["name"], int(lib), int("example" in kinds), int("bench" in kinds))
PY
)
[ -n "${ROOT_PKG:-}" ] || { echo "error: could not read the root package from cargo metadata" >&2; exit 1; }

if [ "$SCOPE" = workspace ]; then
  SEL=(--workspace)
else
  SEL=(-p "$ROOT_PKG")
fi
# `pkg/feature` works whether one or all members are selected.
COMMON=("${SEL[@]}" --features "$ROOT_PKG/$FEATURE" --message-format=json-render-diagnostics)

# 3. builds (cargo's progress and diagnostics go to stderr, JSON to stdout)
BUILD_TARGETS=(--bins)
[ "$HAS_LIB" = 1 ] && BUILD_TARGETS+=(--lib)
[ "$HAS_EXAMPLES" = 1 ] && BUILD_TARGETS+=(--examples)
echo "==> cargo build --release ${SEL[*]} --features $ROOT_PKG/$FEATURE ${BUILD_TARGETS[*]}" >&2
cargo build --release "${COMMON[@]}" "${BUILD_TARGETS[@]}" > "$TMP/build.jsonl"

echo "==> cargo test --release --no-run ${SEL[*]} --features $ROOT_PKG/$FEATURE" >&2
cargo test --release --no-run "${COMMON[@]}" > "$TMP/test.jsonl"

: > "$TMP/bench.jsonl"
if [ "$SCOPE" = workspace ] || [ "$HAS_BENCHES" = 1 ]; then
  echo "==> cargo bench --no-run --benches ${SEL[*]} --features $ROOT_PKG/$FEATURE" >&2
  cargo bench --no-run --benches "${COMMON[@]}" > "$TMP/bench.jsonl"
fi

# 4. map artifacts to stable names: "SRC<TAB>REL" lines
python3 - "$TMP" "$ROOT_PKG" > "$TMP/plan.tsv" <<'PY'
import json, os, sys
tmp, root_pkg = sys.argv[1], sys.argv[2]
meta = json.load(open(os.path.join(tmp, "metadata.json")))
members = {os.path.realpath(p["manifest_path"]): p["name"] for p in meta["packages"]}
LIBKINDS = {"lib", "rlib", "dylib", "cdylib", "staticlib", "proc-macro"}

plan = {}  # rel -> src
def add(rel, src):
    old = plan.get(rel)
    if old is not None and os.path.realpath(old) != os.path.realpath(src):
        sys.exit(f"error: two artifacts map to {rel}:\n  {old}\n  {src}")
    plan[rel] = src

for step in ("build", "test", "bench"):
    with open(os.path.join(tmp, step + ".jsonl")) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if msg.get("reason") != "compiler-artifact":
                continue
            pkg = members.get(os.path.realpath(msg.get("manifest_path", "")))
            if pkg is None:  # a dependency
                continue
            t = msg["target"]
            kinds = set(t["kind"])
            name = t["name"]
            is_test = msg["profile"]["test"]
            exe = msg.get("executable")
            sub = "" if pkg == root_pkg else pkg + "/"
            if step == "build":
                if exe and "bin" in kinds and not is_test:
                    add(f"bin/{sub}{name}", exe)
                elif exe and "example" in kinds:
                    add(f"examples/{sub}{name}", exe)
                elif "cdylib" in kinds:
                    for fn in msg["filenames"]:
                        if fn.endswith(".so"):
                            add(f"lib/{sub}{os.path.basename(fn)}", fn)
            elif step == "test" and exe and is_test:
                if "test" in kinds:
                    add(f"tests/{sub}{name}", exe)
                elif "bin" in kinds:
                    add(f"tests/{sub}unit-bin-{name}", exe)
                elif kinds & LIBKINDS:
                    add(f"tests/{sub}unit-{name}", exe)
            elif step == "bench" and exe and "bench" in kinds:
                add(f"benches/{sub}{name}", exe)

for rel in sorted(plan):
    print(f"{plan[rel]}\t{rel}")
PY

if [ ! -s "$TMP/plan.tsv" ]; then
  echo "error: cargo produced no artifacts to bundle" >&2
  exit 1
fi

# 5. copy + strip into a staging folder, then swap it in
STAGE="$TMP/stage"
mkdir -p "$STAGE"

copy_all() {  # $1 = strip option
  local src rel
  while IFS=$'\t' read -r src rel; do
    mkdir -p "$STAGE/$(dirname "$rel")"
    strip "$1" -o "$STAGE/$rel" "$src"
    chmod 755 "$STAGE/$rel"
  done < "$TMP/plan.tsv"
}

total_bytes() {
  find "$STAGE" -type f ! -name MANIFEST.txt -printf '%s\n' | awk '{s += $1} END {print s + 0}'
}

STRIP_MODE=--strip-debug
copy_all "$STRIP_MODE"
TOTAL="$(total_bytes)"
if [ "$TOTAL" -ge "$LIMIT" ]; then
  echo "warning: $(awk -v t="$TOTAL" 'BEGIN {printf "%.1f", t / 1048576}') MiB with --strip-debug; retrying with --strip-all" >&2
  STRIP_MODE=--strip-all
  copy_all "$STRIP_MODE"
  TOTAL="$(total_bytes)"
fi

# 6. checks: glibc requirement, libcuda linkage
ver_gt() { [ "$1" != "$2" ] && [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | tail -1)" = "$1" ]; }
MAX_GLIBC=0
NO_CUDA=()
while IFS=$'\t' read -r _ rel; do
  g="$(objdump -T "$STAGE/$rel" | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -1 || true)"
  if [ -n "$g" ] && ver_gt "$g" "$MAX_GLIBC"; then MAX_GLIBC="$g"; fi
  readelf -d "$STAGE/$rel" | grep -q 'NEEDED.*\[libcuda\.so\.1\]' || NO_CUDA+=("$rel")
done < "$TMP/plan.tsv"
if ver_gt "$MAX_GLIBC" "$GPU_GLIBC"; then
  echo "error: binaries need GLIBC_$MAX_GLIBC, the GPU machine has $GPU_GLIBC" >&2
  exit 1
fi

# 7. manifest
{
  echo "# gpu-bundle built by scripts/build-gpu-bundle.sh"
  echo "# date:      $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "# git:       $(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo unknown)"
  echo "# rustc:     $(rustc --version)"
  echo "# features:  $ROOT_PKG/$FEATURE   scope: $SCOPE   strip: $STRIP_MODE"
  echo "# stub:      $(head -2 "$STUB/stub.c" | tail -1 | sed 's/^ *//; s/ \*\/$//')"
  echo "# max glibc: $MAX_GLIBC (GPU machine: $GPU_GLIBC)"
  if [ "${#NO_CUDA[@]}" -gt 0 ]; then
    echo "# no NEEDED libcuda.so.1 (no cu* calls, runs without a GPU): ${NO_CUDA[*]}"
  fi
  echo "# total:     $TOTAL bytes"
  echo "#"
  echo "# bytes	sha256	path"
  while IFS=$'\t' read -r _ rel; do
    printf '%s\t%s\t%s\n' "$(stat -c %s "$STAGE/$rel")" \
      "$(sha256sum "$STAGE/$rel" | cut -d' ' -f1)" "$rel"
  done < "$TMP/plan.tsv"
} > "$STAGE/MANIFEST.txt"

echo >&2
sed -n '/^# bytes/,$p' "$STAGE/MANIFEST.txt" | tail -n +2 |
  awk -F'\t' '{printf "  %8.2f MiB  %s\n", $1 / 1048576, $3}' >&2
if [ "$TOTAL" -ge "$LIMIT" ]; then
  echo "error: bundle would be $TOTAL bytes, limit is $LIMIT; $BUNDLE left as it was" >&2
  exit 1
fi

rm -rf "$BUNDLE"
mv "$STAGE" "$BUNDLE"
printf 'gpu-bundle: %s files, %s MiB (limit %d MiB), max GLIBC_%s -> %s\n' \
  "$(wc -l < "$TMP/plan.tsv")" "$(awk -v t="$TOTAL" 'BEGIN {printf "%.2f", t / 1048576}')" \
  $((LIMIT / 1048576)) "$MAX_GLIBC" "$BUNDLE"
