#!/usr/bin/env bash
# Builds the C++ allocator (python/cachealloc_torch/csrc/) against a real
# torch on a machine without a GPU or a CUDA toolkit, loads it, installs it
# as PyTorch's CUDA allocator through cachealloc_torch.enable(mode="cpp"),
# and drives what needs no device: the run-time settings hook, PyTorch's
# refusals, backend:native in the environment, enable() staying out
# under backend:cudaMallocAsync, torch.accelerator's route to the
# allocator, the user metadata of memory history, and the snapshot's keys
# with PyTorch's memory-viz functions run on it; and compiles the allocator
# that python/test_gpu_mempool.py gives MemPool. A check of C++ changes
# before the GPU run (python/test_gpu.py, test_gpu_torch_api.py and
# test_gpu_mempool.py cover the rest there).
#
# Usage: scripts/torch-extension-check.sh
#
# Environment:
#   TORCH_VERSION   the torch to check against (default 2.11.0)
#
# Downloads torch and its CUDA wheels (about 3 GB) into a virtual
# environment under target/torch-check/ (kept for the next run), plus the
# CUDA C runtime headers the CUDA wheels leave out (nvidia-cuda-crt); builds
# libcachealloc.so with `--features cuda` against the link stub
# (scripts/make-cuda-stub.sh). The CUDA headers and libcudart come from the
# wheels, through a CUDA_HOME made of links.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="$ROOT/target/torch-check"
VENV="$OUT/venv"
TORCH_VERSION="${TORCH_VERSION:-2.11.0}"
mkdir -p "$OUT"

# 1. torch, ninja and the CUDA runtime headers.
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION" ninja
CUDA_MAJOR="$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null |
  tail -1 | cut -d. -f1,2)"
[ -n "$CUDA_MAJOR" ] || { echo "error: torch $TORCH_VERSION is not a CUDA build" >&2; exit 1; }
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
RUNTIME_H="$(find "$SITE/nvidia" -name cuda_runtime_api.h | head -1)"
[ -n "$RUNTIME_H" ] || { echo "error: no cuda_runtime_api.h in the CUDA wheels" >&2; exit 1; }
INCLUDE="$(dirname "$RUNTIME_H")"
if [ ! -f "$INCLUDE/crt/host_config.h" ]; then
  case "$CUDA_MAJOR" in
    12.*) CRT="nvidia-cuda-nvcc-cu12==$CUDA_MAJOR.*" ;;
    *) CRT="nvidia-cuda-crt==$CUDA_MAJOR.*" ;;
  esac
  "$VENV/bin/pip" install -q "$CRT"
fi
CRT_H="$(find "$SITE/nvidia" -path '*crt/host_config.h' | head -1)"
[ -n "$CRT_H" ] || { echo "error: no crt/host_config.h after installing $CRT" >&2; exit 1; }
CUDART="$(find "$SITE/nvidia" -name 'libcudart.so.*' | head -1)"

# A CUDA_HOME of links: include/ (runtime headers plus crt/), lib64/libcudart.so.
CUDA_HOME="$OUT/cuda-home"
rm -rf "$CUDA_HOME"
mkdir -p "$CUDA_HOME/include" "$CUDA_HOME/lib64"
for f in "$INCLUDE"/*; do ln -s "$f" "$CUDA_HOME/include/"; done
[ -e "$CUDA_HOME/include/crt" ] || ln -s "$(dirname "$CRT_H")" "$CUDA_HOME/include/crt"
ln -s "$CUDART" "$CUDA_HOME/lib64/libcudart.so"

# 2. libcachealloc.so against the link stub.
scripts/make-cuda-stub.sh target/cuda-stub >/dev/null
CUDA_LIBRARY_PATH="$ROOT/target/cuda-stub" cargo build --release --features cuda --lib
SO="$ROOT/target/release/libcachealloc.so"

# 3. The checks, each in a process of its own.
export CUDA_HOME TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export TORCH_EXTENSIONS_DIR="$OUT/extensions" PATH="$VENV/bin:$PATH"
export LD_LIBRARY_PATH="$ROOT/target/cuda-stub/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
unset CACHEALLOC_CONF PYTORCH_ALLOC_CONF PYTORCH_CUDA_ALLOC_CONF
failed=0
run() {  # run NAME 'REGEX;;REGEX…' (each must match a line) ENV... -- PYTHON
  local name="$1" want="$2"
  shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local out
  out="$(env "${envs[@]}" CACHEALLOC_TORCH_DEBUG=1 "$VENV/bin/python" -c "
import sys, warnings; sys.path.insert(0, 'python')
import torch, cachealloc_torch as ca
$1" "$SO" 2>&1)" || true
  local ok=1 pattern
  while IFS= read -r pattern; do
    grep -Eq -- "$pattern" <<<"$out" || ok=0
  done <<<"${want//;;/$'\n'}"
  if [ "$ok" -eq 1 ]; then
    echo "ok   $name"
  else
    echo "FAIL $name"; echo "$out" | grep -v '^\[' | tail -15; failed=1
  fi
}

run "enable(mode='cpp') builds, loads and installs the C++ allocator" \
  '^installed True cachealloc$' _X=1 -- '
ca.enable(sys.argv[1], mode="cpp")
print("installed", ca.mode() == "cpp", torch.cuda.get_allocator_backend())'

run "run-time settings reach the allocator; PyTorch's refusals stand" \
  'run-time settings "garbage_collection_threshold:0.5";;^refused ValueError garbage_collect_threshold is invalid' PYTORCH_CUDA_ALLOC_CONF=backend:native,max_split_size_mb:64 -- '
ca.enable(sys.argv[1], mode="cpp")
warnings.simplefilter("ignore")
torch.cuda.memory._set_allocator_settings("garbage_collection_threshold:0.5")
try:
    torch.cuda.memory._set_allocator_settings("garbage_collection_threshold:2")
except ValueError as e:
    print("refused", type(e).__name__, e)'

run "backend:cudaMallocAsync: enable() stays out, saying so" \
  'asks for backend:cudaMallocAsync;;^None False cudaMallocAsync$' PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync -- '
print(ca.enable(sys.argv[1]), ca.is_enabled(), torch.cuda.get_allocator_backend())'

# The CUDAPluggableAllocator of python/test_gpu_mempool.py, compiled as the
# GPU run will compile it (torch.utils.cpp_extension.load_inline).
if out="$("$VENV/bin/python" python/test_gpu_mempool.py --build-only 2>&1)"; then
  echo "ok   the MemPool checks' allocator compiles with load_inline"
else
  echo "FAIL the MemPool checks' allocator compiles with load_inline"
  echo "$out" | tail -15
  failed=1
fi

run "without cachealloc, torch.accelerator asks PyTorch's own allocator (which has no device here)" \
  '^native raises Invalid device argument' _X=1 -- '
try:
    torch._C._accelerator_getDeviceStats(0)
    print("native answered")
except RuntimeError as e:
    print("native raises", str(e).strip())'

run "torch.accelerator's memory functions reach the C++ allocator (c10::GetAllocator(kCUDA))" \
  '^registry True True;;^stats True 0 0;;^resets ok' _X=1 -- '
ca.enable(sys.argv[1], mode="cpp")
print("registry", ca._ext.installed(), ca._ext.device_allocator_installed())
st = torch._C._accelerator_getDeviceStats(0)
print("stats", "allocated_bytes" in st, st["allocated_bytes"]["all"]["current"], st["num_ooms"])
torch._C._accelerator_resetPeakStats(0)
torch._C._accelerator_resetAccumulatedStats(0)
print("resets ok", torch._C._accelerator_isAllocatorInitialized())'

run "user metadata: set, read back, per thread, cleared" \
  "^meta 'step 3' '' ''" _X=1 -- '
import threading
ca.enable(sys.argv[1], mode="cpp")
torch.cuda.memory._set_memory_metadata("step 3")
other = []
t = threading.Thread(target=lambda: other.append(torch.cuda.memory._get_memory_metadata()))
t.start(); t.join()
mine = torch.cuda.memory._get_memory_metadata()
torch.cuda.memory._set_memory_metadata("")
print("meta", repr(mine), repr(other[0]), repr(torch.cuda.memory._get_memory_metadata()))'

run "snapshot: PyTorch's keys and allocator_settings; _memory_viz runs on it" \
  '^keys allocator_settings device_traces external_annotations segments;;^settings 0.6 True -1;;^viz ok' PYTORCH_CUDA_ALLOC_CONF=backend:native,garbage_collection_threshold:0.6,graph_capture_record_stream_reuse:True -- '
import copy, io, pickle
from torch.cuda import _memory_viz as viz
ca.enable(sys.argv[1], mode="cpp")
s = torch._C._cuda_memorySnapshot(None)
print("keys", *sorted(s))
a = s["allocator_settings"]
print("settings", a["garbage_collection_threshold"], a["graph_capture_record_stream_reuse"],
      a["max_split_size"])
s = pickle.loads(pickle.dumps(s))
html = [viz.trace_plot(copy.deepcopy(s)), viz.trace_plot(copy.deepcopy(s), plot_segments=True),
        viz.trace_plot(copy.deepcopy(s), filter_freed=True), viz.segment_plot(s)]
text = viz.segsum(s) + viz.trace(s)
print("viz", "ok" if all("MemoryViz" in h for h in html) else "bad")'

if [ "$failed" -ne 0 ]; then
  echo "torch-extension-check: FAILED" >&2
  exit 1
fi
echo "torch-extension-check: all checks passed (torch $TORCH_VERSION, CUDA $CUDA_MAJOR headers)"
