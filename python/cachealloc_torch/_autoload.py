"""Start-up hook: with CACHEALLOC_TORCH=1 in the environment, every Python
process installs cachealloc before CUDA is used (the wheel's
cachealloc_torch.pth imports this module at interpreter start). Unset or 0:
nothing happens and torch is not imported."""

import os

if os.environ.get("CACHEALLOC_TORCH", "") not in ("", "0"):
    try:
        from cachealloc_torch import enable as _enable

        _enable()
    except Exception as _e:  # noqa: BLE001 - a start-up hook must not stop the interpreter
        import sys

        print(f"cachealloc_torch: CACHEALLOC_TORCH is set but enable() failed: {_e}",
              file=sys.stderr)
