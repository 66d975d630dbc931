"""Builds libcachealloc.so with cargo and puts it inside the cachealloc_torch
package with its C header (include/cachealloc.h, which the C++ allocator
includes), plus the start-up hook cachealloc_torch.pth (see pyproject.toml).

Environment:
  CACHEALLOC_PREBUILT_LIB=PATH  use this libcachealloc.so instead of running cargo
  CACHEALLOC_CUDA_STUB=1        link against a stub libcuda.so (scripts/make-cuda-stub.sh):
                                for building on a machine without CUDA; the real
                                driver is found at run time by its soname
  CARGO                         the cargo to run (default: cargo)
"""

import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def build_library():
    prebuilt = os.environ.get("CACHEALLOC_PREBUILT_LIB")
    if prebuilt:
        return prebuilt
    env = dict(os.environ)
    if env.get("CACHEALLOC_CUDA_STUB", "") not in ("", "0"):
        stub = os.path.join(ROOT, "target", "cuda-stub")
        subprocess.check_call([os.path.join(ROOT, "scripts", "make-cuda-stub.sh"), stub])
        env["CUDA_LIBRARY_PATH"] = stub
    cargo = env.get("CARGO", "cargo")
    # pip keeps a build's output to itself unless asked for -v: cargo's
    # progress goes to the terminal when there is one, so a build of a few
    # minutes does not look like a hang.
    progress = _terminal()
    try:
        subprocess.check_call([cargo, "build", "--profile", "wheel", "--features", "cuda", "--lib"],
                              cwd=ROOT, env=env, stderr=progress)
    finally:
        if progress is not None:
            progress.close()
    target = env.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    return os.path.join(target, "wheel", "libcachealloc.so")


def _terminal():
    """The controlling terminal to write to, or None (no terminal: CI, a pipe)."""
    try:
        return open("/dev/tty", "w")
    except OSError:
        return None


class BuildPy(build_py):
    """build_py that also builds and copies the Rust library and the .pth hook."""

    def run(self):
        super().run()
        lib = build_library()
        dest = os.path.join(self.build_lib, "cachealloc_torch", "lib")
        os.makedirs(dest, exist_ok=True)
        shutil.copy2(lib, os.path.join(dest, "libcachealloc.so"))
        include = os.path.join(self.build_lib, "cachealloc_torch", "include")
        os.makedirs(include, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, "include", "cachealloc.h"),
                     os.path.join(include, "cachealloc.h"))
        shutil.copy2(os.path.join(ROOT, "python", "cachealloc_torch.pth"),
                     os.path.join(self.build_lib, "cachealloc_torch.pth"))


class BdistWheel(bdist_wheel):
    """A platform wheel (it carries a native library) usable by any Python 3."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel})
