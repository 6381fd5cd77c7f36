"""Intel MKL for MLX's large CPU matmuls (prefill), behind the BLAS shim.

The shim (csrc/blas_shim.c) sends MLX's sgemm calls to numpy's OpenBLAS,
except the few-row ones it runs itself. A product of at least 33 rows (a
prefill's, or an embedding batch's) can go instead to MKL's LP64
`cblas_sgemm`, single-threaded, one call per slice of the output's columns
on the shim's own pool (no OpenMP threads spinning beside the kernels' pools).
Measured on SmolLM2-135M's four prefill shapes at 1024 rows on two cores of
an Intel Xeon (AVX-512): 364-386 GFLOP/s against 336-349 for numpy's OpenBLAS
(docs/benchmarks.md#blas-shim).

`VLLM_METAL_SGEMM` picks the library (read once, before MLX loads):

- `auto` (default): MKL where the CPU is Intel's and the `mkl` wheel is
  installed (`scripts/setup.sh` installs it on Linux x86-64); OpenBLAS
  otherwise. On AMD CPUs it is not chosen: on a 2-core AMD EPYC (Zen 4) VM
  SmolLM2's 1024-token prefill chain took 1,381-2,391 ms on MKL against
  1,177-1,230 ms on OpenBLAS (2026-11-28, benchmarks/results/prefill_gemm_amd.json).
- `mkl`: MKL on any x86-64 CPU; a missing library is reported by the doctor
  and the start-up line, and OpenBLAS does the work.
- `openblas`: never MKL.
- a path: that libmkl_rt.

MKL obeys VLLM_METAL_CPU_ISA's cap through its own MKL_ENABLE_INSTRUCTIONS
(set here when the user has not set it). Results agree with OpenBLAS's to
float32 rounding, and do not depend on the pool's size (VLLM_METAL_CPU_THREADS:
the slices are whole multiples of 8 columns, each a sequential sgemm of the
same rows; tests/native/test_mkl_gemm.py).
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import re
import sys

from vllm_metal import envs

CHOICES = ("auto", "mkl", "openblas")
# MKL_ENABLE_INSTRUCTIONS for each VLLM_METAL_CPU_ISA cap.
MKL_ISA = {"avx2": "AVX2", "generic": "SSE4_2"}


def choice(environ=None) -> str:
    """VLLM_METAL_SGEMM, checked: one of CHOICES or a path to a library."""
    environ = os.environ if environ is None else environ
    value = (envs.get("VLLM_METAL_SGEMM", environ) or "auto").strip() or "auto"
    if value in CHOICES or "/" in value:
        return value
    raise ValueError(f"VLLM_METAL_SGEMM={value!r}: use 'auto', 'mkl', 'openblas' or a path to libmkl_rt")


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """'GenuineIntel', 'AuthenticAMD', ... ('' when unknown)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def find_mkl_rt() -> str | None:
    """libmkl_rt from the `mkl` wheel (its files list), else under sys.prefix/lib."""
    try:
        dist = importlib.metadata.distribution("mkl")
        for f in dist.files or ():
            name = os.path.basename(str(f))
            if name.startswith("libmkl_rt.so"):
                path = os.path.realpath(dist.locate_file(f))
                if os.path.exists(path):
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    found = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))
    return found[0] if found else None


def plan(environ=None, vendor: str | None = None, machine: str | None = None,
         found: str | None | bool = False) -> tuple[str | None, str]:
    """(library to load or None, why). `found` False: look for it."""
    environ = os.environ if environ is None else environ
    want = choice(environ)
    machine = machine or os.uname().machine
    if want == "openblas":
        return None, "VLLM_METAL_SGEMM=openblas"
    if "/" in want:
        return want, f"VLLM_METAL_SGEMM={want}"
    if machine not in ("x86_64", "AMD64"):
        return None, f"MKL runs on x86-64 only (this is {machine})"
    vendor = cpu_vendor() if vendor is None else vendor
    if want == "auto" and vendor != "GenuineIntel":
        return None, f"CPU vendor {vendor or 'unknown'}: MKL is chosen on Intel CPUs only (VLLM_METAL_SGEMM=mkl forces it)"
    path = find_mkl_rt() if found is False else found
    if not path:
        return None, "the mkl wheel is not installed (pip install mkl; scripts/setup.sh does)"
    return path, f"VLLM_METAL_SGEMM={want}" + (f", {vendor}" if want == "auto" else "")


def cap_instructions(environ=None, isa_cap: str | None = None) -> str | None:
    """Sets MKL_ENABLE_INSTRUCTIONS for a VLLM_METAL_CPU_ISA cap unless the
    user set it. Returns the value in effect (None: MKL's own choice)."""
    environ = os.environ if environ is None else environ
    mine = (environ.get("MKL_ENABLE_INSTRUCTIONS") or "").strip()
    if mine:
        return mine
    cap = MKL_ISA.get(isa_cap or "")
    if cap:
        environ["MKL_ENABLE_INSTRUCTIONS"] = cap
    return cap


def bind(shim, isa_cap: str | None) -> tuple[str | None, str]:
    """Points the bound shim's large products at MKL when the plan says so.
    Returns (MKL's version string or None, why); never raises for a missing
    or broken library (the shim keeps OpenBLAS), only for a bad variable."""
    import ctypes

    path, why = plan()
    if path is None:
        return None, why
    cap = cap_instructions(isa_cap=isa_cap)
    shim.vllm_metal_blas_shim_init_large.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    shim.vllm_metal_blas_shim_init_large.restype = ctypes.c_int
    shim.vllm_metal_blas_shim_large_target.restype = ctypes.c_char_p
    err = ctypes.create_string_buffer(512)
    if shim.vllm_metal_blas_shim_init_large(path.encode(), err, len(err)) != 0:
        return None, f"MKL not used: {err.value.decode(errors='replace')}"
    full = shim.vllm_metal_blas_shim_large_target().decode().strip()
    found = re.search(r"Version (\d+(?:\.\d+)*)", full)
    version = f"MKL {found.group(1)}" if found else (full or "MKL")
    return version, f"{path} ({why}{', MKL_ENABLE_INSTRUCTIONS=' + cap if cap else ''})"
