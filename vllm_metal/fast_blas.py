"""Gives MLX's CPU device an optimized BLAS on Linux.

The `mlx-cpu` wheel links a bundled *reference* BLAS (~3 GFLOP/s for sgemm on
this class of machine). Loading an optimized OpenBLAS with RTLD_GLOBAL before
`mlx.core` is first imported makes the dynamic linker bind MLX's cblas/LAPACK
symbols to it instead (measured 30-50x faster matmul). It must run before
anything imports mlx.core; once MLX is loaded the bindings are fixed.
`import vllm_metal` arms a hook that runs it just before `mlx.core` loads,
so the order of vllm_metal's own imports does not matter; importing
`mlx.core` before any vllm_metal module does, and `vllm_metal.ops` then warns.

Which library: VLLM_METAL_BLAS=auto (default) tries Debian/Ubuntu's
libopenblas0-pthread, then any libopenblas the loader finds; a path loads that
file; "reference" keeps MLX's bundled BLAS. macOS uses Accelerate/Metal and
needs none of this.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
)

# What happened, for `vllm-metal doctor` and the docs: (library or None, note).
status: tuple[str | None, str] = (None, "not attempted")
_handle = None


def preload() -> tuple[str | None, str]:
    """Load an optimized BLAS globally if possible. Idempotent; never raises."""
    global status, _handle
    if _handle is not None or status[1] != "not attempted":
        return status
    if not sys.platform.startswith("linux"):
        status = (None, "not needed on this OS")
        return status
    choice = os.environ.get("VLLM_METAL_BLAS", "auto").strip() or "auto"
    if choice == "reference":
        status = (None, "VLLM_METAL_BLAS=reference: keeping MLX's bundled reference BLAS")
        return status
    if "mlx.core" in sys.modules:
        status = (None, TOO_LATE + "; MLX keeps its reference BLAS")
        return status
    if choice == "auto":
        found = ctypes.util.find_library("openblas")
        candidates = [*_CANDIDATES, *([found] if found else [])]
    else:
        candidates = [choice]
    errors = []
    for path in candidates:
        if "/" in path and not os.path.exists(path):
            continue
        try:
            _handle = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        status = (path, "loaded with RTLD_GLOBAL before mlx.core")
        return status
    hint = "install Debian's libopenblas0-pthread (apt-get install libopenblas0-pthread)"
    status = (None, "no OpenBLAS found; MLX uses its slow reference BLAS; " + hint
              + ("; " + "; ".join(errors) if errors else ""))
    return status


TOO_LATE = "mlx.core was imported before vllm_metal"


def warn_if_too_late() -> None:
    """A loud warning when MLX was loaded before the fast BLAS could be."""
    if status[0] is None and status[1].startswith(TOO_LATE):
        import warnings

        warnings.warn("vllm_metal: mlx.core was imported before vllm_metal, so MLX keeps the mlx-cpu "
                      "wheel's reference BLAS (matmuls 30-50x slower). Import vllm_metal (or "
                      "vllm_metal.ops) before mlx.", RuntimeWarning, stacklevel=3)
