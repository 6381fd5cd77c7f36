"""MKL for the large products (vllm_metal/native/mkl_gemm.py, the shim's
sgemm_large in csrc/blas_shim.c): the choice for every CPU / variable /
installation, the products' results against float64 on every layout, and
what a bad VLLM_METAL_SGEMM or a library that is not MKL's gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from vllm_metal.native import fast_blas, mkl_gemm

import mlx.core as mx  # noqa: E402  (after vllm_metal)

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the BLAS shim is Linux-only")
U32 = np.finfo(np.float32).eps / 2


# -- the choice ---------------------------------------------------------------

def test_plan_for_every_cpu_and_setting(tmp_path):
    lib = str(tmp_path / "libmkl_rt.so.3")
    intel, amd = "GenuineIntel", "AuthenticAMD"
    assert mkl_gemm.plan({}, intel, "x86_64", lib) == (lib, "VLLM_METAL_SGEMM=auto, GenuineIntel")
    path, why = mkl_gemm.plan({}, amd, "x86_64", lib)
    assert path is None and "AuthenticAMD" in why and "VLLM_METAL_SGEMM=mkl" in why
    assert mkl_gemm.plan({"VLLM_METAL_SGEMM": "mkl"}, amd, "x86_64", lib) == (lib, "VLLM_METAL_SGEMM=mkl")
    assert mkl_gemm.plan({"VLLM_METAL_SGEMM": "openblas"}, intel, "x86_64", lib) == (None, "VLLM_METAL_SGEMM=openblas")
    path, why = mkl_gemm.plan({}, intel, "x86_64", None)
    assert path is None and "pip install mkl" in why
    path, why = mkl_gemm.plan({"VLLM_METAL_SGEMM": "mkl"}, intel, "aarch64", lib)
    assert path is None and "aarch64" in why
    assert mkl_gemm.plan({"VLLM_METAL_SGEMM": " /opt/x/libmkl_rt.so "}, amd, "aarch64", None)[0] == "/opt/x/libmkl_rt.so"
    assert mkl_gemm.plan({"VLLM_METAL_SGEMM": ""}, intel, "x86_64", lib)[0] == lib  # empty: auto


@pytest.mark.parametrize("bad", ["MKL", "yes", "openblas64", "1"])
def test_a_bad_setting_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="VLLM_METAL_SGEMM=.*'auto', 'mkl', 'openblas'"):
        mkl_gemm.choice({"VLLM_METAL_SGEMM": bad})


def test_isa_cap_reaches_mkl_unless_the_user_chose():
    env: dict = {}
    assert mkl_gemm.cap_instructions(env, "avx2") == "AVX2" and env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    env = {}
    assert mkl_gemm.cap_instructions(env, "generic") == "SSE4_2"
    env = {}
    assert mkl_gemm.cap_instructions(env, None) is None and env == {}
    assert mkl_gemm.cap_instructions(env, "avx512") is None and env == {}
    env = {"MKL_ENABLE_INSTRUCTIONS": "AVX512"}
    assert mkl_gemm.cap_instructions(env, "avx2") == "AVX512" and env["MKL_ENABLE_INSTRUCTIONS"] == "AVX512"


def test_cpu_vendor_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu\n")
    assert mkl_gemm.cpu_vendor(str(info)) == "AuthenticAMD"
    assert mkl_gemm.cpu_vendor(str(tmp_path / "missing")) == ""


# -- the products -------------------------------------------------------------

def _check(got, a64, b64):
    k = a64.shape[-1]
    bound = (k + 2) * U32 * (np.abs(a64) @ np.abs(b64)) + 1e-30
    assert np.all(np.abs(np.asarray(got, np.float64) - a64 @ b64) <= bound)


@linux
@pytest.mark.parametrize("m,k,n", [(33, 577, 2053), (300, 64, 9), (1024, 576, 960)])
@pytest.mark.parametrize("layout", ["x@W.T", "x@W", "x.T@W.T", "x.T@W"])
def test_large_products_match_float64(m, k, n, layout, rng):
    if not fast_blas.large[0]:
        pytest.skip(f"no large-product library bound here: {fast_blas.large[1]}")
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    xs = mx.array(x) if layout.startswith("x@") else mx.array(np.ascontiguousarray(x.T)).T
    ws = mx.array(w).T if layout.endswith("W.T") else mx.array(np.ascontiguousarray(w.T))
    before = fast_blas.shim_calls()["sgemm_large"]
    got = mx.matmul(xs, ws)
    mx.eval(got)
    assert fast_blas.shim_calls()["sgemm_large"] == before + 1
    _check(np.array(got), x.astype(np.float64), w.T.astype(np.float64))


_SCRIPT = r"""
import json, os, numpy as np
import vllm_metal.native.ops  # noqa: F401  (arms the shim before mlx.core)
import mlx.core as mx
from vllm_metal.native import fast_blas
a = np.random.default_rng(0).standard_normal((80, 96)).astype(np.float32)  # past the few-row kernel (64)
before = fast_blas.shim_calls()
got = np.array(mx.array(a) @ mx.array(a.T))
after = fast_blas.shim_calls()
ok = np.abs(got - a.astype(np.float64) @ a.T.astype(np.float64)).max() < 1e-3
print(json.dumps([list(fast_blas.large), after["sgemm_large"] - before["sgemm_large"],
                  after["sgemm"] - before["sgemm"], bool(ok), os.environ.get("MKL_ENABLE_INSTRUCTIONS"),
                  fast_blas.summary()]))
"""


def _run(env: dict):
    clean = {k: v for k, v in os.environ.items() if k not in ("VLLM_METAL_SGEMM", "MKL_ENABLE_INSTRUCTIONS")}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env={**clean, **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@linux
def test_settings_and_bad_libraries_in_a_fresh_process():
    if fast_blas.libraries.get("shim") is None or mkl_gemm.find_mkl_rt() is None:
        pytest.skip("the BLAS shim or the mkl wheel is not installed here")
    # OpenBLAS by request: the products go there, the summary says why.
    (version, why), large, plain, ok, _, summary = _run({"VLLM_METAL_SGEMM": "openblas"})
    assert version is None and why == "VLLM_METAL_SGEMM=openblas" and (large, plain, ok) == (0, 1, True)
    assert "on OpenBLAS (VLLM_METAL_SGEMM=openblas)" in summary
    # A missing file, and a library that is not MKL's (numpy's OpenBLAS): said, and OpenBLAS does the work.
    for path, said in (("/nonexistent/libmkl_rt.so.3", "dlopen"),
                       (fast_blas.numpy_openblas(), "is not MKL's runtime library")):
        (version, why), large, plain, ok, _, summary = _run({"VLLM_METAL_SGEMM": path})
        assert version is None and why.startswith("MKL not used") and said in why, why
        assert (large, plain, ok) == (0, 1, True) and said in summary
    # A bad value: said (the platform refuses it at engine start: tests/engine).
    (version, why), large, plain, ok, _, _ = _run({"VLLM_METAL_SGEMM": "fast"})
    assert version is None and "VLLM_METAL_SGEMM='fast'" in why and (large, plain, ok) == (0, 1, True)
    # The AVX2 cap reaches MKL (forced: 'auto' leaves AMD CPUs on OpenBLAS); products still right.
    (version, why), large, plain, ok, isa, summary = _run({"VLLM_METAL_CPU_ISA": "avx2", "VLLM_METAL_SGEMM": "mkl"})
    assert version and version.startswith("MKL ") and "MKL_ENABLE_INSTRUCTIONS=AVX2" in why
    assert (large, plain, ok, isa) == (1, 0, True, "AVX2") and version in summary


_BITS = r"""
import sys, numpy as np
import vllm_metal.native.ops  # noqa: F401
import mlx.core as mx
rng = np.random.default_rng(3); out = {}
for m, k, n in ((33, 577, 2053), (1024, 576, 960), (200, 64, 4099)):
    x = rng.standard_normal((m, k)).astype(np.float32); w = rng.standard_normal((n, k)).astype(np.float32)
    out[f"{m}x{k}x{n}"] = np.array(mx.array(x) @ mx.array(w).T)
np.savez(sys.argv[1], **out)
"""


@linux
def test_large_product_bits_do_not_depend_on_the_threads(tmp_path):
    """Each thread's slice is a single-threaded MKL sgemm of whole multiples of
    8 columns: every output's sum is the same with 1, 2 or 3 threads."""
    if fast_blas.libraries.get("shim") is None or mkl_gemm.find_mkl_rt() is None:
        pytest.skip("the BLAS shim or the mkl wheel is not installed here")
    results = []
    for threads in (1, 2, 3):
        path = tmp_path / f"t{threads}.npz"
        env = {**os.environ, "VLLM_METAL_CPU_THREADS": str(threads), "VLLM_METAL_SGEMM": "mkl"}
        subprocess.run([sys.executable, "-c", _BITS, str(path)], env=env, check=True, timeout=300)
        results.append(np.load(path))
    for key in results[0].files:
        for other in results[1:]:
            assert np.array_equal(results[0][key], other[key]), key
