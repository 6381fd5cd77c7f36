"""Gives MLX's CPU device an optimized BLAS on Linux.

The `mlx-cpu` wheel links a bundled *reference* BLAS (~3 GFLOP/s for sgemm on
this class of machine). Loading optimized libraries with RTLD_GLOBAL before
`mlx.core` is first imported makes the dynamic linker bind MLX's cblas/LAPACK
symbols to them instead. It must run before anything imports mlx.core; once
MLX is loaded the bindings are fixed. `import vllm_metal` arms a hook that
runs it just before `mlx.core` loads, so the order of vllm_metal's own
imports does not matter; importing `mlx.core` before any vllm_metal module
does, and `vllm_metal.native.ops` then warns.

MLX's CPU backend imports three BLAS routines, `cblas_sgemm`, `cblas_dgemm`
and `cblas_cgemm` (every matmul, one-row decode products included, is an
sgemm), plus some LAPACK routines (linalg only). With VLLM_METAL_BLAS=auto
(the default) two libraries are loaded, in this order:

1. vllm-metal's BLAS shim (`libvllm_metal_blas_shim.so`, csrc/blas_shim.c,
   built with the extension): it exports those three LP64 cblas routines and
   forwards them to the OpenBLAS numpy bundles (numpy.libs/
   libscipy_openblas64_*.so: OpenBLAS 0.3.30 with numpy 2.3, where Debian 12
   ships 0.3.21; its symbols are renamed and take 64-bit integers, so MLX
   cannot bind to it directly). An sgemm of one or two rows, i.e. a decode product
   x[M,K] @ W^T at batch 1 or 2, is forwarded as one sgemv per row (and a
   one-column sgemm as one sgemv): OpenBLAS's sgemm packs W first and streams
   it at a fraction of memory bandwidth, its sgemv does not (at 4 and more
   rows, reading W once per row costs more). A row-major sgemm of 3 to 32 rows
   and at least 64 columns is computed as its transpose (OpenBLAS runs few
   rows 2-3x faster as its column dimension). Loaded first, the shim wins the
   binding.
2. Debian/Ubuntu's libopenblas0-pthread (or any libopenblas the loader
   finds), for everything else MLX imports (LAPACK).

Measured on the 2-core AMD EPYC (Zen 4) this was developed on, against
Debian's OpenBLAS 0.3.21 alone (docs/benchmarks.md, "BLAS shim"): SmolLM2's
linear layers for one decode step at batch 1 take ~32 ms instead of ~45 (the
sgemv forwarding; Debian's own sgemv would do as well on this CPU), a whole
decode step at batch 8 141 -> 118 ms with the transposed path, a 1024-token prefill
~150 GFLOP/s instead of ~140 (both libraries run AVX-512 kernels here; on
CPUs newer than OpenBLAS 0.3.21 knows, numpy's 0.3.30 picks better ones).
Either part may be missing: without the shim (not built, or numpy without
its OpenBLAS) the system OpenBLAS does everything, as before the shim
existed; without a system OpenBLAS the shim does the matmuls and MLX's
bundled LAPACK the rest.

VLLM_METAL_BLAS: `auto` as above; `system` only the system OpenBLAS (no
shim); a path loads that file instead; `reference` keeps MLX's bundled BLAS.
`status` says what happened (`vllm-metal doctor` prints `summary()`). macOS
uses Accelerate/Metal and needs none of this.

Few-row products (1 to 64 rows times a weight, 33-64 only for weights up to 16 MB; 16 on AVX2-only
CPUs: decode rows) run the shim's
own kernels (AVX2, and AVX-512 where the CPU has it), which read the weight
once at close to memory bandwidth and give a row the same bits whatever the
row count, on their own small thread pool (VLLM_METAL_CPU_THREADS, or the
usable cores), where OpenBLAS packs the weight first (csrc/blas_few_rows.c).
Products of 33 rows and more (prefill) go to Intel MKL on Intel CPUs, on the
same pool (mkl_gemm.py, VLLM_METAL_SGEMM); `large` says what happened.

Threads: numpy's OpenBLAS sizes its pool to the cores (OPENBLAS_NUM_THREADS
overrides it, for both libraries; the system one only serves LAPACK now, so
its pool stays idle). MLX calls BLAS from its one CPU stream thread, and the
paged-attention kernel's pool (VLLM_METAL_CPU_THREADS) runs between BLAS
calls, not during them, though OpenBLAS's workers keep polling (with
sched_yield) for a while after each call, as they did with the system
library alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import sys

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
)
SHIM_NAME = "libvllm_metal_blas_shim.so"

# What happened, for `vllm-metal doctor` and the docs: (library doing MLX's
# matmuls, or None; note).
status: tuple[str | None, str] = (None, "not attempted")
# Every library loaded globally, by role: "shim", "gemm" (what the shim
# forwards to), "system" (the system OpenBLAS).
libraries: dict[str, str] = {}
_handles: list[ctypes.CDLL] = []
_shim: ctypes.CDLL | None = None
_gemm_info = ""  # e.g. "OpenBLAS 0.3.30, SkylakeX kernels"
# The large products' library (mkl_gemm.py): (MKL's version or None, where / why not).
large: tuple[str | None, str] = (None, "not attempted")


def numpy_openblas() -> str | None:
    """numpy's bundled ILP64 OpenBLAS (numpy.libs/), found without importing numpy."""
    try:
        spec = importlib.util.find_spec("numpy")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        libs = os.path.join(os.path.dirname(location), "numpy.libs")
        for pattern in ("libscipy_openblas64_*.so*", "libopenblas64_*.so*"):
            found = sorted(glob.glob(os.path.join(libs, pattern)))
            if found:
                return found[0]
    return None


def shim_path() -> str | None:
    """The built shim library next to vllm_metal's extension, if any."""
    import vllm_metal

    for directory in vllm_metal.__path__:
        path = os.path.join(directory, SHIM_NAME)
        if os.path.exists(path):
            return path
    return None


def _bind_shim() -> str | None:
    """Load the shim, point it at numpy's OpenBLAS, make it global. Returns why not, or None."""
    global _shim, _gemm_info
    shim, target = shim_path(), numpy_openblas()
    if shim is None:
        return f"{SHIM_NAME} is not built (pip install -e . builds it with the extension)"
    if target is None:
        return "numpy's bundled OpenBLAS (numpy.libs/libscipy_openblas64_*.so) not found"
    try:
        lib = ctypes.CDLL(shim, mode=os.RTLD_NOW | os.RTLD_LOCAL)
        lib.vllm_metal_blas_shim_init.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.vllm_metal_blas_shim_init.restype = ctypes.c_int
        lib.vllm_metal_blas_shim_target.restype = ctypes.c_char_p
        lib.vllm_metal_blas_shim_calls.argtypes = [ctypes.c_int]
        lib.vllm_metal_blas_shim_calls.restype = ctypes.c_longlong
        lib.vllm_metal_blas_shim_set_gemv_max_rows.argtypes = [ctypes.c_int]
        lib.vllm_metal_blas_shim_set_gemv_max_rows.restype = ctypes.c_int
        lib.vllm_metal_blas_shim_set_transpose_max_rows.argtypes = [ctypes.c_int]
        lib.vllm_metal_blas_shim_set_transpose_max_rows.restype = ctypes.c_int
        lib.vllm_metal_blas_shim_set_few_rows_min.argtypes = [ctypes.c_int]
        lib.vllm_metal_blas_shim_set_few_rows_min.restype = ctypes.c_int
        lib.vllm_metal_blas_shim_set_few_rows_max.argtypes = [ctypes.c_int]
        lib.vllm_metal_blas_shim_set_few_rows_max.restype = ctypes.c_int
        lib.vllm_metal_blas_shim_few_rows_supported.restype = ctypes.c_int
        lib.vllm_metal_blas_shim_few_rows_max.restype = ctypes.c_int
        lib.vllm_metal_blas_shim_set_threads.argtypes = [ctypes.c_int]
        lib.vllm_metal_blas_shim_set_threads.restype = ctypes.c_int
        lib.vllm_metal_blas_shim_set_large_min_rows.argtypes = [ctypes.c_int]
        lib.vllm_metal_blas_shim_set_large_min_rows.restype = ctypes.c_int
        from vllm_metal import envs  # (no MLX import: safe before mlx.core)

        threads = (envs.get("VLLM_METAL_CPU_THREADS") or "").strip()
        lib.vllm_metal_blas_shim_set_threads(int(threads) if threads.isdigit() else 0)
        err = ctypes.create_string_buffer(512)
        if lib.vllm_metal_blas_shim_init(target.encode(), err, len(err)) != 0:
            return f"{shim}: {err.value.decode(errors='replace')}"
        # Now that its pointers are set, promote it to the global scope (ahead
        # of the system OpenBLAS, loaded next) so libmlx's cblas_* bind here.
        _handles.append(ctypes.CDLL(shim, mode=os.RTLD_NOW | os.RTLD_GLOBAL | os.RTLD_NOLOAD))
    except (OSError, AttributeError) as e:
        return f"{shim}: {e}"
    _shim = lib
    libraries.update(shim=shim, gemm=target)
    _gemm_info = _openblas_info(target, lib.vllm_metal_blas_shim_target().decode())
    _gemm_info += "; " + _shorten_spin(target)
    _bind_large(lib, envs)
    return None


def _bind_large(lib: ctypes.CDLL, envs) -> None:
    """MKL for the products of 33 rows and more, where mkl_gemm chooses it."""
    global large
    from vllm_metal.native import mkl_gemm

    try:
        large = mkl_gemm.bind(lib, envs.cpu_isa_cap())
    except ValueError as e:  # a bad VLLM_METAL_SGEMM / VLLM_METAL_CPU_ISA: the platform refuses it by name
        large = (None, f"MKL not used: {e}")


# OpenBLAS's workers poll for the next call (sched_yield) for 2^THREAD_TIMEOUT
# cycles before sleeping: 2^28 (~0.1 s) by default, so between the BLAS calls
# of a step one core is never free for the step's other kernels (attention,
# norms, the greedy head) on their own pool, nor for vLLM's host work. 2^10
# cycles (~0.4 us) makes them sleep at once; measured in docs/benchmarks.md
# (#engine-overhead): +45-60% output tok/s at concurrency 64 on the tiny model.
SPIN_TIMEOUT = 10


def _shorten_spin(path: str) -> str:
    """Sets numpy's OpenBLAS's worker spin to 2^SPIN_TIMEOUT cycles (unless
    OPENBLAS_THREAD_TIMEOUT is set already: the user's value stands). The
    library read its environment when numpy loaded it, so the variable is set,
    re-read (openblas_read_env) and the idle workers restarted with it
    (blas_thread_shutdown_ / blas_thread_init: what OpenBLAS does around a
    fork). Child processes inherit the variable. Returns what happened."""
    mine = os.environ.get("OPENBLAS_THREAD_TIMEOUT", "").strip()
    if mine:
        return f"OPENBLAS_THREAD_TIMEOUT={mine} (set by the user)"
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
        read_env, timeout = lib.openblas_read_env, lib.openblas_thread_timeout
        shutdown, init = lib.blas_thread_shutdown_, lib.blas_thread_init
    except (OSError, AttributeError) as e:
        return f"worker spin left at OpenBLAS's default ({e})"
    timeout.restype = ctypes.c_int
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = str(SPIN_TIMEOUT)
    read_env()
    if timeout() != SPIN_TIMEOUT:
        return "worker spin left at OpenBLAS's default (the library ignored OPENBLAS_THREAD_TIMEOUT)"
    shutdown()
    init()
    return f"workers sleep after 2^{SPIN_TIMEOUT} cycles (OPENBLAS_THREAD_TIMEOUT={SPIN_TIMEOUT})"


def _openblas_info(path: str, sgemm_symbol: str) -> str:
    """'OpenBLAS 0.3.30, SkylakeX kernels', from the target library's own config calls."""
    prefix, suffix = sgemm_symbol.split("cblas_sgemm")
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
        config, core = (getattr(lib, f"{prefix}openblas_get_{what}{suffix}")
                        for what in ("config", "corename"))
        config.restype = core.restype = ctypes.c_char_p
        version = " ".join(config().decode().split()[:2])  # "OpenBLAS 0.3.30"
        return f"{version}, {core().decode().strip()} kernels"
    except (OSError, AttributeError):
        return "OpenBLAS"


def _load_system(candidates: list[str]) -> tuple[str | None, list[str]]:
    errors = []
    for path in candidates:
        if "/" in path and not os.path.exists(path):
            continue
        try:
            _handles.append(ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL))
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        libraries["system"] = path
        return path, errors
    return None, errors


def _system_candidates() -> list[str]:
    found = ctypes.util.find_library("openblas")
    return [*_CANDIDATES, *([found] if found else [])]


def preload() -> tuple[str | None, str]:
    """Load the optimized BLAS globally if possible. Idempotent; never raises."""
    global status
    if _handles or status[1] != "not attempted":
        return status
    if not sys.platform.startswith("linux"):
        status = (None, "not needed on this OS")
        return status
    from vllm_metal import envs  # (no MLX import: safe before mlx.core)

    choice = (envs.get("VLLM_METAL_BLAS") or "auto").strip() or "auto"
    if choice == "reference":
        status = (None, "VLLM_METAL_BLAS=reference: keeping MLX's bundled reference BLAS")
        return status
    if "mlx.core" in sys.modules:
        status = (None, TOO_LATE + "; MLX keeps its reference BLAS")
        return status
    why_no_shim = _bind_shim() if choice == "auto" else None
    system, errors = _load_system(_system_candidates() if choice in ("auto", "system") else [choice])
    if _shim is not None:
        rest = (f"LAPACK from {system}" if system else
                "LAPACK from MLX's bundled reference LAPACK (no system OpenBLAS found)")
        status = (libraries["gemm"],
                  f"cblas_sgemm/dgemm/cgemm through vllm-metal's shim ({libraries['shim']}) to numpy's "
                  f"{_gemm_info}, {_few_rows_summary()}, "
                  f"{_large_summary()}; {rest}; loaded with RTLD_GLOBAL before mlx.core")
    elif system:
        status = (system, "loaded with RTLD_GLOBAL before mlx.core"
                  + (f" (BLAS shim not used: {why_no_shim})" if why_no_shim else ""))
    else:
        hint = "install Debian's libopenblas0-pthread (apt-get install libopenblas0-pthread)"
        status = (None, "no OpenBLAS found; MLX uses its slow reference BLAS; " + hint
                  + (f"; BLAS shim not used: {why_no_shim}" if why_no_shim else "")
                  + ("; " + "; ".join(errors) if errors else ""))
    return status


_few_rows_auto = True  # the shim's automatic bound (its 33-64 rows for small weights only)


def _few_rows_summary() -> str:
    rows = few_rows_max() if few_rows_supported() else 0
    if not rows:
        return "1-2-row products as sgemv, 3-32-row ones transposed"
    rest = f", {rows + 1}-32-row ones transposed" if rows < 32 else ""
    wide = f" (33-{rows}{' for weights up to 16 MB' if _few_rows_auto else ''})" if rows > 32 else ""
    return f"x @ W.T of 1-{min(rows, 32)} rows on the shim's own kernel{wide}, other 1-2-row products as sgemv" + rest


def _large_summary() -> str:
    if large[0]:
        return f"33 rows and more past the few-row kernel on {large[0]} (sequential, on the shim's pool; {large[1]})"
    return f"33 rows and more past the few-row kernel on OpenBLAS ({large[1]})"


def summary() -> str:
    """One line for `vllm-metal doctor` and the worker's start-up log."""
    if _shim is not None:
        return (f"{libraries['gemm']} ({_gemm_info}) for matmuls, through {SHIM_NAME}; "
                f"{_large_summary()}; LAPACK: {libraries.get('system', 'MLX bundled')}")
    return status[0] or status[1]


def shim_calls() -> dict[str, int] | None:
    """How many calls the shim has forwarded (None when it is not bound), and
    `few_rows_taken_over`: slices of the few-row pool's products that the
    calling thread computed because their worker had not started them yet."""
    if _shim is None:
        return None
    return {name: int(_shim.vllm_metal_blas_shim_calls(i))
            for i, name in enumerate(("sgemm", "sgemm_as_sgemv", "dgemm", "cgemm", "sgemm_transposed",
                                      "sgemm_few_rows", "few_rows_taken_over", "sgemm_large"))}


def set_gemv_max_rows(rows: int) -> int | None:
    """Forward sgemm with at most `rows` rows as one sgemv per row (0: never; default 2).
    For benchmarks and tests. Returns the previous setting, or None when the shim is not bound."""
    if _shim is None:
        return None
    return int(_shim.vllm_metal_blas_shim_set_gemv_max_rows(rows))


def set_transpose_max_rows(rows: int) -> int | None:
    """Compute row-major sgemm with 3..`rows` rows and >= 64 columns as its transpose
    (0: never; default 32). For benchmarks and tests. Returns the previous setting, or
    None when the shim is not bound."""
    if _shim is None:
        return None
    return int(_shim.vllm_metal_blas_shim_set_transpose_max_rows(rows))


def set_few_rows_min(rows: int) -> int | None:
    """Smallest row count sent to the few-row kernel (default 1: decode's one- and two-row
    products too, faster than OpenBLAS's sgemv with the weights streamed from memory and
    never collapsing when another process wants a core; 3 sends them to sgemv). For
    benchmarks and tests. Returns the previous setting, or None when the shim is not bound."""
    if _shim is None:
        return None
    return int(_shim.vllm_metal_blas_shim_set_few_rows_min(rows))


def set_few_rows_max(rows: int) -> int | None:
    """Run row-major x[M,K] @ W[N,K]^T with few_rows_min..`rows` rows through the shim's own
    few-row kernel where the CPU has AVX2 and FMA (0: never; -1, the default: 64 rows on the
    kernel's AVX-512 path, 33-64 only for weights up to 16 MB, 16 on its AVX2 path, see
    few_rows_max()); a set bound applies to every weight. For benchmarks and
    tests. Returns the previous setting, or None when the shim is not bound."""
    global _few_rows_auto
    if _shim is None:
        return None
    _few_rows_auto = rows < 0
    return int(_shim.vllm_metal_blas_shim_set_few_rows_max(rows))


def set_large_min_rows(rows: int) -> int | None:
    """Send row-major sgemm of at least `rows` rows to the large-product library (MKL) when
    one is bound (0: never; default 33). For benchmarks and tests. Returns the previous
    setting, or None when the shim is not bound."""
    if _shim is None:
        return None
    return int(_shim.vllm_metal_blas_shim_set_large_min_rows(rows))


def few_rows_max() -> int:
    """The most rows a product sends to the few-row kernel as things stand (0: none)."""
    return 0 if _shim is None else int(_shim.vllm_metal_blas_shim_few_rows_max())


def few_rows_supported() -> bool:
    """Whether this CPU runs the shim's few-row kernel (AVX2 and FMA)."""
    return _shim is not None and bool(_shim.vllm_metal_blas_shim_few_rows_supported())


TOO_LATE = "mlx.core was imported before vllm_metal"


def warn_if_too_late() -> None:
    """A loud warning when MLX was loaded before the fast BLAS could be."""
    if status[0] is None and status[1].startswith(TOO_LATE):
        import warnings

        warnings.warn("vllm_metal: mlx.core was imported before vllm_metal, so MLX keeps the mlx-cpu "
                      "wheel's reference BLAS (matmuls 30-50x slower). Import vllm_metal (or "
                      "vllm_metal.native.ops) before mlx.", RuntimeWarning, stacklevel=3)
