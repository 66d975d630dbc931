"""Run PyTorch on cachealloc: a drop-in CUDA allocator for PyTorch.

    import cachealloc_torch
    cachealloc_torch.enable()        # before CUDA is first used
    import torch
    ...                               # torch.cuda.memory_stats(), graphs, MemPool, ... as usual

Or without touching the program: `CACHEALLOC_TORCH=1 python train.py` (the
wheel installs a start-up hook that calls enable() when that variable is set).

enable() compiles a small C++ extension against the installed torch (once;
cached in the torch extensions directory) that implements PyTorch's whole
C++ allocator interface (c10::cuda::CUDACachingAllocator::CUDAAllocator) and
installs it: torch.cuda.memory_stats() and all its relatives, cudnn.benchmark
(cacheInfo), CUDA graphs, torch.compile(mode="reduce-overhead"),
torch.cuda.MemPool / use_mem_pool, memory snapshots and history, and
torch.OutOfMemoryError work unchanged. Every memory decision is made by the
Rust core in libcachealloc.so. Without a C++ compiler (or with
enable(mode="pluggable")) it falls back to torch.cuda.memory.CUDAPluggableAllocator,
which supports allocation, freeing, empty_cache, memory fractions and
record_stream only; it warns and names what does not work then.

Configure the allocator with CACHEALLOC_CONF (same syntax as
PYTORCH_CUDA_ALLOC_CONF, optionally starting with a preset name: `default`,
`pytorch`, `expandable`, ...), set before the first allocation. PyTorch's own
PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF applies too, read with PyTorch's
rules, for every key CACHEALLOC_CONF does not set; with the C++ interface,
torch.cuda.memory._set_allocator_settings() reaches the allocator at run time.
backend:cudaMallocAsync there makes enable() stay out.

The functions memory_stats(), max_memory_reserved(), ... of this module are
aliases of torch.cuda's once the C++ interface is installed (and read the
library directly on the pluggable path); info(), notices(), fragmentation()
and record_trace() are cachealloc's own. See docs/PYTORCH.md.
"""

import ctypes
import json
import os
from collections import OrderedDict

__all__ = [
    "enable", "is_enabled", "library_path", "memory_stats", "memory_summary",
    "memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved",
    "reset_peak_memory_stats", "fragmentation", "fragmentation_stats", "snapshot",
    "record_trace", "stop_trace", "empty_cache", "cachealloc_stats", "info", "notices", "last_error",
    "error_count", "CacheallocError", "mode", "PLUGGABLE_LIMITS", "cache_info", "ipc_stats",
]

_PKG = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_PKG))
_lib = None
_mode = None
_ext = None
_lib_path = None
_allocator = None
_oom_exceptions = False

# c10::detail::torchCheckFail(const char* func, const char* file, uint32_t line, const char* msg):
# throws c10::Error, which Python sees as RuntimeError. Exported by libc10.so for years.
_TORCH_CHECK_FAIL = "_ZN3c106detail14torchCheckFailEPKcS2_jS2_"


class CacheallocError(RuntimeError):
    """A cachealloc call failed; the message is the library's last error."""


def _candidates(path):
    if path:
        yield path, "argument"
        return
    env = os.environ.get("CACHEALLOC_LIB")
    if env:
        yield env, "CACHEALLOC_LIB"
        return
    yield os.path.join(_PKG, "lib", "libcachealloc.so"), "installed package"
    yield os.path.join(_REPO, "gpu-bundle", "lib", "libcachealloc.so"), "gpu-bundle"
    yield os.path.join(_REPO, "target", "release", "libcachealloc.so"), "target/release"


def library_path(path=None):
    """The .so enable() would load: `path`, else $CACHEALLOC_LIB, else the
    installed package's lib/libcachealloc.so, else (in a checkout)
    gpu-bundle/lib/libcachealloc.so, else target/release/libcachealloc.so."""
    tried = []
    for p, where in _candidates(path):
        if os.path.isfile(p):
            return os.path.abspath(p)
        tried.append(f"{p} ({where})")
    raise FileNotFoundError(
        "libcachealloc.so not found; tried: " + ", ".join(tried)
        + ". Build it with `cargo build --release --features cuda` or scripts/build-gpu-bundle.sh, "
        "or pass enable(path=...) / set CACHEALLOC_LIB.")


# The C functions this package calls, as ctypes (return type, argument
# types). Their C declarations are include/cachealloc.h, generated from the
# Rust source; a Rust test (src/abi_tests.rs) checks every entry here against
# it, so write each type in full (ctypes.c_int, not an alias). Strings the
# library returns are c_void_p, not c_char_p: they must go back to
# cachealloc_string_free, which needs the pointer.
_SIGNATURES = {
    "cachealloc_alloc": (ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]),
    "cachealloc_free": (None, [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]),
    "cachealloc_init": (None, [ctypes.c_int]),
    "cachealloc_reset": (None, []),
    "cachealloc_set_memory_fraction": (None, [ctypes.c_double, ctypes.c_int]),
    "cachealloc_record_stream": (None, [ctypes.c_void_p, ctypes.c_void_p]),
    "cachealloc_empty_cache": (ctypes.c_int64, [ctypes.c_int]),
    "cachealloc_reset_peak_stats": (ctypes.c_int, [ctypes.c_int]),
    "cachealloc_stats_json": (ctypes.c_void_p, [ctypes.c_int]),
    "cachealloc_fragmentation": (ctypes.c_void_p, [ctypes.c_int]),
    "cachealloc_fragmentation_json": (ctypes.c_void_p, [ctypes.c_int]),
    "cachealloc_snapshot_json": (ctypes.c_void_p, [ctypes.c_int]),
    "cachealloc_info_json": (ctypes.c_void_p, [ctypes.c_int]),
    "cachealloc_record_trace_start": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p]),
    "cachealloc_record_trace_stop": (ctypes.c_int64, [ctypes.c_int]),
    "cachealloc_last_error": (ctypes.c_void_p, []),
    "cachealloc_clear_error": (None, []),
    "cachealloc_error_count": (ctypes.c_uint64, []),
    "cachealloc_string_free": (None, [ctypes.c_void_p]),
    "cachealloc_set_oom_handler": (None, [ctypes.c_void_p]),
    "cachealloc_torch_device": (ctypes.c_void_p, [ctypes.c_int]),
    "cachealloc_torch_stats": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64),
                                              ctypes.c_size_t]),
    "cachealloc_torch_ipc_stats": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_int64),
                                                  ctypes.c_size_t]),
}


def _declare(lib):
    missing = [n for n in _SIGNATURES if not hasattr(lib, n)]
    if missing:
        raise CacheallocError(
            f"{_lib_path} lacks {', '.join(missing)}: it was built without `--features cuda`")
    for name, (res, args) in _SIGNATURES.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args


def _addr(fn):
    return ctypes.cast(fn, ctypes.c_void_p).value


def _install_oom_handler(torch, lib):
    """Makes a failed allocation raise RuntimeError in Python (see docs/PYTORCH.md)."""
    c10 = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    try:
        fn = getattr(ctypes.CDLL(c10), _TORCH_CHECK_FAIL)
    except (OSError, AttributeError) as e:
        return f"no OOM exceptions ({type(e).__name__}: {e}); a failed allocation returns NULL"
    lib.cachealloc_set_oom_handler(_addr(fn))
    return None


PLUGGABLE_LIMITS = (
    "torch.cuda.memory_stats() and every torch.cuda.memory_* statistic (and torch.accelerator's, "
    "which report PyTorch's own allocator there), memory snapshots and "
    "_record_memory_history, cudnn.benchmark (cacheInfo), CUDA graphs, "
    "torch.compile(mode='reduce-overhead'), torch.cuda.MemPool / use_mem_pool, and "
    "torch.OutOfMemoryError (a failed allocation raises RuntimeError) do not work on the "
    "pluggable path; use this module's memory_stats() etc. instead")


def _include_dir():
    """The folder of cachealloc.h, the C ABI's header: inside the installed
    package (setup.py copies it there), else the checkout's include/."""
    for d in (os.path.join(_PKG, "include"), os.path.join(_REPO, "include")):
        if os.path.isfile(os.path.join(d, "cachealloc.h")):
            return d
    raise FileNotFoundError(
        "cachealloc.h not found in " + os.path.join(_PKG, "include") + " or "
        + os.path.join(_REPO, "include") + ": reinstall the package")


def _sources():
    """The C++ allocator's sources (csrc/*.cpp), in a fixed order."""
    csrc = os.path.join(_PKG, "csrc")
    return sorted(os.path.join(csrc, f) for f in os.listdir(csrc) if f.endswith(".cpp"))


def _build_extension(torch, so):
    """Compiles (or loads from the torch extensions cache) the C++ allocator,
    linked against `so`. Returns the extension module."""
    from torch.utils import cpp_extension
    import hashlib
    include = _include_dir()
    libdir = os.path.dirname(so)
    # The name carries the library's path and the torch version, so that a
    # different build of either never loads a stale module; and the header,
    # so that a module built against another ABI is never loaded either.
    with open(os.path.join(include, "cachealloc.h"), "rb") as f:
        header = hashlib.sha1(f.read()).hexdigest()
    key = hashlib.sha1(f"{so}|{torch.__version__}|{header}".encode()).hexdigest()[:12]
    verbose = os.environ.get("CACHEALLOC_TORCH_VERBOSE", "") not in ("", "0")
    return cpp_extension.load(
        name=f"cachealloc_torch_cpp_{key}", sources=_sources(), with_cuda=True,
        extra_include_paths=[include, os.path.join(_PKG, "csrc")],
        extra_cflags=["-O2"], extra_ldflags=[f"-L{libdir}", "-lcachealloc", f"-Wl,-rpath,{libdir}"],
        verbose=verbose)


def _backend_asked():
    """The allocator backend PyTorch's configuration asks for ("native",
    "cudaMallocAsync", ...), or None: the `backend` key of
    PYTORCH_CUDA_ALLOC_CONF, else of PYTORCH_ALLOC_CONF (the order in which
    PyTorch chooses its backend), read as PyTorch tokenizes it."""
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = os.environ.get(var)
        if conf is None:
            continue
        for item in "".join(conf.split()).split(","):
            key, _, value = item.partition(":")
            if key == "backend":
                return var, value
        return None
    return None


def _core_stats(device=None):
    """The statistics vector of the device's allocator (the core's own, the
    one the C++ allocator converts to PyTorch's DeviceStats), each slot named
    by its memory_stats() key through the generated table _abi.py (Note [The
    statistics vector] in src/capi_torch.rs). Private pools are not included."""
    from . import _abi
    lib = _need()
    h = lib.cachealloc_torch_device(_device(device))
    if not h:
        _fail("cachealloc_torch_device")
    out = (ctypes.c_int64 * _abi.STATS_LEN)()
    if lib.cachealloc_torch_stats(h, out, _abi.STATS_LEN) != 0:
        _fail("cachealloc_torch_stats")
    return OrderedDict(zip(_abi.STAT_NAMES, out))


def enable(path=None, oom_exceptions=True, mode="auto"):
    """Installs cachealloc as PyTorch's CUDA allocator.

    Must run before CUDA is first used in the process (before any tensor is
    put on the GPU, torch.cuda.init(), torch.cuda.mem_get_info(), ...).
    `path`: the .so (default: see library_path()). `mode`: "cpp" (PyTorch's
    whole C++ allocator interface, through a small extension compiled against
    the installed torch), "pluggable" (torch.cuda.memory.CUDAPluggableAllocator:
    allocation only, see PLUGGABLE_LIMITS), or "auto" (cpp, else pluggable
    with a warning when the extension cannot be built). `oom_exceptions`
    (pluggable path only): a failed allocation raises RuntimeError instead of
    returning NULL. Returns the path of the library loaded. Calling it again
    is a no-op.

    When PyTorch's configuration asks for another allocator
    (`backend:cudaMallocAsync` in PYTORCH_CUDA_ALLOC_CONF or
    PYTORCH_ALLOC_CONF), cachealloc stays out: one line on stderr says so,
    nothing is installed, and None is returned.
    """
    global _lib, _lib_path, _allocator, _oom_exceptions, _mode, _ext
    import torch
    if mode not in ("auto", "cpp", "pluggable"):
        raise ValueError(f"mode must be 'auto', 'cpp' or 'pluggable', not {mode!r}")
    asked = _backend_asked()
    if asked is not None and asked[1] != "native":
        import sys
        print(f"cachealloc_torch: {asked[0]} asks for backend:{asked[1]}; cachealloc is not "
              "installed and PyTorch's choice is used", file=sys.stderr, flush=True)
        return None
    so = library_path(path)
    if _lib is not None:
        if so != _lib_path:
            raise CacheallocError(f"cachealloc is already enabled from {_lib_path}")
        return _lib_path
    if torch.cuda.is_initialized():
        raise CacheallocError(
            "cachealloc_torch.enable() must run before CUDA is first used in this process "
            "(PyTorch cannot swap its allocator once CUDA is initialised): call it at the "
            "top of the program, before creating any CUDA tensor or calling torch.cuda.init().")
    # RTLD_GLOBAL: the extension links the same library instance.
    lib = ctypes.CDLL(so, mode=ctypes.RTLD_GLOBAL)
    _lib_path = so
    _declare(lib)
    if mode in ("auto", "cpp"):
        try:
            ext = _build_extension(torch, so)
        except Exception as e:  # no compiler, no ninja, headers missing, ...
            if mode == "cpp":
                raise CacheallocError(f"building cachealloc's C++ allocator failed: {e}") from e
            import warnings
            warnings.warn(
                "cachealloc: the C++ allocator could not be built "
                f"({type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}); "
                "falling back to the pluggable allocator: " + PLUGGABLE_LIMITS, stacklevel=2)
        else:
            ext.install()
            _lib, _ext, _mode = lib, ext, "cpp"
            return so
    _enable_pluggable(torch, lib, so, oom_exceptions)
    _mode = "pluggable"
    return so


def _enable_pluggable(torch, lib, so, oom_exceptions):
    """Installs the library through torch.cuda.memory.CUDAPluggableAllocator."""
    global _lib, _allocator, _oom_exceptions
    alloc = torch.cuda.memory.CUDAPluggableAllocator(so, "cachealloc_alloc", "cachealloc_free")
    raw = alloc.allocator()
    raw.set_init_fn(_addr(lib.cachealloc_init))
    raw.set_reset_fn(_addr(lib.cachealloc_reset))
    raw.set_memory_fraction_fn(_addr(lib.cachealloc_set_memory_fraction))
    raw.set_record_stream_fn(_addr(lib.cachealloc_record_stream))
    torch.cuda.memory.change_current_allocator(alloc)
    _oom_exceptions = False
    if oom_exceptions:
        why = _install_oom_handler(torch, lib)
        if why:
            import warnings
            warnings.warn("cachealloc: " + why)
        else:
            _oom_exceptions = True
    _lib, _allocator = lib, alloc


def mode():
    """How cachealloc is installed: "cpp" (PyTorch's whole C++ allocator
    interface), "pluggable" (CUDAPluggableAllocator), or None (not enabled)."""
    return _mode


def is_enabled():
    """Whether enable() has installed cachealloc in this process."""
    return _lib is not None


def _need():
    if _lib is None:
        raise CacheallocError("cachealloc is not enabled: call cachealloc_torch.enable() first")
    return _lib


def _device(device):
    import torch
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, torch.device):
        return device.index if device.index is not None else torch.cuda.current_device()
    if isinstance(device, str):
        return _device(torch.device(device))
    return int(device)


def cache_info(device=None):
    """The largest block a request could get now, in bytes: the largest cached
    free block or the device's free memory within the memory fraction,
    whichever is larger. It is what PyTorch's ``cacheInfo`` answers, and what
    cuDNN's benchmark mode (``torch.backends.cudnn.benchmark``) sizes its
    workspace by. Asked through PyTorch's allocator interface, so it needs the
    C++ mode (``mode() == "cpp"``)."""
    _need()
    if _ext is None:
        raise CacheallocError("cache_info() needs the C++ mode; this process runs the "
                              "pluggable allocator: " + PLUGGABLE_LIMITS)
    return int(_ext.cache_info(_device(device)))


def ipc_stats(device=None):
    """CUDA IPC (torch.multiprocessing sharing CUDA tensors) on the device:
    ``open`` handles of other processes mapped here and their ``users``
    (storages), ``opened`` and ``closed`` so far (all devices); of this
    process's own blocks shared with others, those not freed yet
    (``pinned_blocks``, ``pinned_bytes``: blocks of expandable segments,
    whose pages stay where they are until freed), the pages exported as
    file descriptors (``exported_pages``), and whether pages of expandable
    segments are created shareable (``pages_shareable``: 1, 0, or -1 before
    the device is used or without expandable segments). See docs/PYTORCH.md."""
    from . import _abi
    lib = _need()
    out = (ctypes.c_int64 * _abi.IPC_STATS_LEN)()
    if lib.cachealloc_torch_ipc_stats(_device(device), out, _abi.IPC_STATS_LEN) != 0:
        _fail("cachealloc_torch_ipc_stats")
    names = {"open": _abi.IPC_STATS_OPEN, "users": _abi.IPC_STATS_USERS,
             "opened": _abi.IPC_STATS_OPENED, "closed": _abi.IPC_STATS_CLOSED,
             "pinned_blocks": _abi.IPC_STATS_PINNED_BLOCKS,
             "pinned_bytes": _abi.IPC_STATS_PINNED_BYTES,
             "exported_pages": _abi.IPC_STATS_EXPORTED_PAGES,
             "pages_shareable": _abi.IPC_STATS_PAGES_SHAREABLE}
    return {k: int(out[i]) for k, i in names.items()}


def last_error():
    """The calling thread's last cachealloc error message, or None."""
    lib = _need()
    p = lib.cachealloc_last_error()
    if not p:
        return None
    try:
        return ctypes.string_at(p).decode("utf-8", "replace")
    finally:
        lib.cachealloc_string_free(p)


def error_count():
    """Errors cachealloc recorded so far (all threads): bad frees, OOMs, ..."""
    return int(_need().cachealloc_error_count())


def _fail(what):
    raise CacheallocError(f"{what} failed: {last_error() or 'unknown error'}")


def _string(fn, device, what):
    lib = _need()
    p = fn(_device(device))
    if not p:
        _fail(what)
    try:
        return ctypes.string_at(p).decode("utf-8", "replace")
    finally:
        lib.cachealloc_string_free(p)


def cachealloc_stats(device=None):
    """The core's statistics with PyTorch's keys plus cachealloc's own
    counters (num_map, num_unmap, num_marker_waits, ...), read from the
    library (the device's allocator; private pools are not included)."""
    d = json.loads(_string(_need().cachealloc_stats_json, device, "memory_stats"))
    return OrderedDict(sorted(d.items()))


def memory_stats(device=None):
    """torch.cuda.memory_stats() (an alias once the C++ interface is
    installed; on the pluggable path the library's figures, same keys)."""
    _need()
    if _mode == "cpp":
        import torch
        return torch.cuda.memory_stats(device)
    return cachealloc_stats(device)


def memory_allocated(device=None):
    """torch.cuda.memory_allocated()."""
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device=None):
    """torch.cuda.max_memory_allocated()."""
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device=None):
    """torch.cuda.memory_reserved()."""
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device=None):
    """torch.cuda.max_memory_reserved()."""
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device=None):
    """torch.cuda.reset_peak_memory_stats()."""
    _need()
    if _mode == "cpp":
        import torch
        return torch.cuda.reset_peak_memory_stats(device)
    if _need().cachealloc_reset_peak_stats(_device(device)) != 0:
        _fail("reset_peak_memory_stats")


def fragmentation(device=None):
    """The fragmentation report as text (reserved - allocated, inactive split
    bytes, largest free block, external fragmentation, least used segments)."""
    return _string(_need().cachealloc_fragmentation, device, "fragmentation")


def fragmentation_stats(device=None):
    """The fragmentation figures as a dict."""
    return json.loads(_string(_need().cachealloc_fragmentation_json, device, "fragmentation"))


def snapshot(device=None):
    """Every segment and block, shaped like torch.cuda.memory._snapshot()["segments"]."""
    return json.loads(_string(_need().cachealloc_snapshot_json, device, "snapshot"))


def info(device=None):
    """Configuration in force, notices (e.g. an expandable fallback), cap, device name."""
    return json.loads(_string(_need().cachealloc_info_json, device, "info"))


def notices(device=None):
    """Things to know about the configuration in force (e.g. a fallback)."""
    return info(device)["notices"]


def empty_cache(device=None):
    """Releases every entirely free segment; returns bytes released. With
    device=None, every device in use (torch.cuda.empty_cache() does the same)."""
    lib = _need()
    devices = [_device(device)] if device is not None else info()["devices_in_use"]
    total = 0
    for d in devices:
        n = lib.cachealloc_empty_cache(d)
        if n < 0:
            _fail(f"empty_cache(device {d})")
        total += n
    return total


def record_trace(path, device=None):
    """Starts recording the device's allocations and frees into a trace file
    (the plain trace format; gzip if `path` ends in .gz) for `cachealloc replay`."""
    if _need().cachealloc_record_trace_start(_device(device), os.fsencode(path)) != 0:
        _fail("record_trace")


def stop_trace(device=None):
    """Stops the recording; returns the number of events written."""
    n = _need().cachealloc_record_trace_stop(_device(device))
    if n < 0:
        _fail("stop_trace")
    return n


def _fmt_bytes(n):
    units = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"]
    v, i = float(n), 0
    while abs(v) >= 99999.5 and i + 1 < len(units):
        v /= 1024
        i += 1
    return f"{v:6.0f} {units[i]}"


def _fmt_count(n):
    units = ["   ", "K  ", "M  ", "G  "]
    v, i = float(n), 0
    while abs(v) >= 99999.5 and i + 1 < len(units):
        v /= 1000
        i += 1
    return f"{v:6.0f} {units[i]}"


def memory_summary(device=None, abbreviated=False):
    """A readable table of memory_stats(), laid out like torch.cuda.memory_summary()."""
    d = _device(device)
    s = dict(memory_stats(d))
    for k, v in cachealloc_stats(d).items():
        s.setdefault(k, v)
    w = 75  # inner width: a 23-wide name column and four 12-wide value columns

    def row(name, cells):
        return "|" + f" {name:<22}" + "|" + "|".join(f" {c:>10} " for c in cells) + "|"

    line = "|" + "-" * w + "|"
    dline = "|" + "=" * w + "|"
    out = [dline, "|" + f"cachealloc CUDA memory summary, device ID {d}".center(w) + "|", line,
           "|" + f"CUDA OOMs: {s['num_ooms']}".center(37) + "|"
           + f"flush-and-retry: {s['num_alloc_retries']}".center(w - 38) + "|",
           dline,
           "|" + "Metric".center(23) + "|"
           + "|".join(h.center(12) for h in ("Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"))
           + "|"]
    rows = [
        ("allocated_bytes", "Allocated memory", _fmt_bytes),
        ("active_bytes", "Active memory", _fmt_bytes),
        ("requested_bytes", "Requested memory", _fmt_bytes),
        ("reserved_bytes", "GPU reserved memory", _fmt_bytes),
        ("inactive_split_bytes", "Non-releasable memory", _fmt_bytes),
        ("allocation", "Allocations", _fmt_count),
        ("active", "Active allocs", _fmt_count),
        ("segment", "GPU reserved segments", _fmt_count),
        ("inactive_split", "Non-releasable allocs", _fmt_count),
    ]
    pools = [("all", None)] if abbreviated else [
        ("all", None), ("large_pool", "      from large pool"), ("small_pool", "      from small pool")]
    fields = ("current", "peak", "allocated", "freed")
    for key, title, fmt in rows:
        out.append(line)
        for pool, label in pools:
            out.append(row(title if label is None else label,
                           [fmt(s[f"{key}.{pool}.{f}"]) for f in fields]))
    out.append(line)
    for key, title in (("oversize_allocations", "Oversize allocations"),
                       ("oversize_segments", "Oversize GPU segments")):
        out.append(row(title, [_fmt_count(s[f"{key}.{f}"]) for f in fields]))
    out.append(line)
    extra = (f"device allocs {s['num_device_alloc']}, frees {s['num_device_free']}, "
             f"syncs {s['num_sync_all_streams']}, maps {s.get('num_map', 0)}, "
             f"unmaps {s.get('num_unmap', 0)}")
    out.append("| " + f"{extra:<{w - 1}}" + "|")
    out.append(dline)
    return "\n".join(out)
