"""The BLAS shim (csrc/blas_shim.c, its few-row kernels csrc/blas_few_rows_kernels.h and their pool csrc/blas_few_rows.c, vllm_metal/native/fast_blas.py): MLX's CPU matmuls
are really bound to it and forwarded to numpy's OpenBLAS, and the results match
a float64 reference within float32 error for every shape class the shim treats
differently: one or two rows (forwarded to sgemv), one column, a few rows, many rows,
transposed and strided operands, column-major calls and beta != 0."""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
import pytest

from vllm_metal.native import fast_blas

import mlx.core as mx  # noqa: E402  (after vllm_metal: conftest imports vllm_metal.native.ops first)

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the BLAS shim is Linux-only"),
    pytest.mark.skipif(os.environ.get("VLLM_METAL_BLAS", "auto") != "auto",
                       reason="VLLM_METAL_BLAS chooses another BLAS"),
]

ROW_MAJOR, COL_MAJOR = 101, 102
NO_TRANS, TRANS = 111, 112
U32 = np.finfo(np.float32).eps / 2


def _bound(a64: np.ndarray, b64: np.ndarray) -> np.ndarray:
    """Elementwise float32 error bound of a @ b: gamma_K |a| |b| (plus rounding of the inputs)."""
    k = a64.shape[-1]
    return (k + 2) * U32 * (np.abs(a64) @ np.abs(b64)) + 1e-30


def _check(got, a64, b64):
    ref = a64 @ b64
    err = np.abs(np.asarray(got, np.float64) - ref)
    assert np.all(err <= _bound(a64, b64)), float((err / _bound(a64, b64)).max())


def test_shim_is_bound():
    shim = fast_blas.libraries.get("shim")
    assert shim and shim.endswith(fast_blas.SHIM_NAME), fast_blas.status
    assert fast_blas.status[0] == fast_blas.libraries["gemm"] == fast_blas.numpy_openblas()
    assert "shim" in fast_blas.status[1] and fast_blas.SHIM_NAME in fast_blas.summary()
    maps = open("/proc/self/maps").read()
    assert shim in maps and fast_blas.libraries["gemm"] in maps
    # MLX's own matmuls arrive in the shim: one and four rows times a row-major
    # weight through the few-row kernel (where the CPU has it, else sgemv and
    # sgemm), one row times another layout as sgemv, 80 rows as sgemm.
    before = fast_blas.shim_calls()
    w = mx.ones((32, 16))
    mx.eval(mx.ones((1, 16)) @ w.T, mx.ones((4, 16)) @ w.T, mx.ones((80, 16)) @ w.T, mx.ones((1, 16)) @ mx.ones((16, 32)))
    after = fast_blas.shim_calls()
    few = int(fast_blas.few_rows_supported())
    assert after["sgemm_few_rows"] == before["sgemm_few_rows"] + 2 * few
    assert after["sgemm_as_sgemv"] == before["sgemm_as_sgemv"] + 1 + (1 - few)
    large = int(bool(fast_blas.large[0]))
    assert after["sgemm_large"] == before["sgemm_large"] + large
    assert after["sgemm"] == before["sgemm"] + 2 - few - large


@pytest.mark.parametrize("m", [1, 2, 3, 8, 17, 300])
@pytest.mark.parametrize("layout", ["x@W.T", "x@W", "x.T@W.T", "x.T@W"])
def test_mlx_matmul_matches_float64(m, layout, rng):
    k, n = 257, 190
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    # The same product x @ W.T with each operand stored either way round.
    xs = mx.array(x) if layout.startswith("x@") else mx.array(np.ascontiguousarray(x.T)).T
    ws = mx.array(w).T if layout.endswith("W.T") else mx.array(np.ascontiguousarray(w.T))
    got = mx.matmul(xs, ws)
    mx.eval(got)
    _check(np.array(got), x.astype(np.float64), w.T.astype(np.float64))


@pytest.mark.parametrize("m", [1, 5])
def test_mlx_batched_and_strided_matmul(m, rng):
    # Batched products (one sgemm per batch entry) and a column-sliced operand.
    x = rng.standard_normal((3, m, 96)).astype(np.float32)
    w = rng.standard_normal((3, 96, 200)).astype(np.float32)
    got = mx.matmul(mx.array(x), mx.array(w)[:, :, ::2])
    mx.eval(got)
    for i in range(3):
        _check(np.array(got[i]), x[i].astype(np.float64), w[i, :, ::2].astype(np.float64))
    # A matrix-vector product with the vector on the right: one column.
    got = mx.array(w[0].T) @ mx.array(x[0, 0])
    mx.eval(got)
    _check(np.array(got)[:, None], w[0].T.astype(np.float64), x[0, 0, :, None].astype(np.float64))


def test_mlx_float64_and_complex_go_through_the_shim(rng):
    before = fast_blas.shim_calls()
    a = rng.standard_normal((20, 30))
    b = rng.standard_normal((30, 10))
    got = mx.matmul(mx.array(a, mx.float64), mx.array(b, mx.float64), stream=mx.cpu)
    mx.eval(got)
    assert got.dtype == mx.float64
    np.testing.assert_allclose(np.array(got), a @ b, rtol=1e-12, atol=1e-12)
    c = (a + 1j * rng.standard_normal(a.shape)).astype(np.complex64)
    d = (b + 1j * rng.standard_normal(b.shape)).astype(np.complex64)
    got = mx.matmul(mx.array(c), mx.array(d), stream=mx.cpu)
    mx.eval(got)
    ref = c.astype(np.complex128) @ d.astype(np.complex128)
    np.testing.assert_allclose(np.array(got), ref, rtol=1e-5, atol=1e-4)
    after = fast_blas.shim_calls()
    assert after["dgemm"] == before["dgemm"] + 1 and after["cgemm"] == before["cgemm"] + 1


# -- the shim's cblas_sgemm called directly: what MLX never asks for ---------

def _sgemm():
    fn = ctypes.CDLL(fast_blas.libraries["shim"]).cblas_sgemm
    f, i, p = ctypes.c_float, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    fn.restype = None
    return fn


def _stored(op: np.ndarray, trans: int, order: int, pad: int) -> tuple[np.ndarray, int]:
    """Memory for an operand whose op() is `op`, with a leading dimension `pad` larger than needed."""
    mat = op.T if trans == TRANS else op  # what is stored, logically
    if order == COL_MAJOR:
        buf = np.full((mat.shape[1], mat.shape[0] + pad), np.nan, np.float32)
        buf[:, :mat.shape[0]] = mat.T
    else:
        buf = np.full((mat.shape[0], mat.shape[1] + pad), np.nan, np.float32)
        buf[:, :mat.shape[1]] = mat
    return buf, buf.shape[1]


@pytest.mark.parametrize("gemv", [True, False], ids=["fast_paths", "sgemm_only"])
@pytest.mark.parametrize("order", [ROW_MAJOR, COL_MAJOR], ids=["row", "col"])
@pytest.mark.parametrize("ta", [NO_TRANS, TRANS], ids=["A", "At"])
@pytest.mark.parametrize("tb", [NO_TRANS, TRANS], ids=["B", "Bt"])
@pytest.mark.parametrize("mnk", [(1, 37, 29), (2, 37, 29), (23, 1, 29), (1, 1, 5), (6, 37, 29), (6, 70, 29),
                                 (40, 70, 29), (4, 9, 16), (7, 301, 43), (8, 64, 7), (33, 9, 16), (70, 40, 3)])
@pytest.mark.parametrize("beta", [0.0, 0.5])
@pytest.mark.parametrize("few_min", [3, 1], ids=["few3", "few1"])
def test_shim_sgemm_every_layout(gemv, order, ta, tb, mnk, beta, few_min, rng):
    m, n, k = mnk
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    a_buf, lda = _stored(a, ta, order, pad=3)
    b_buf, ldb = _stored(b, tb, order, pad=2)
    # C with padding; beta == 0 must ignore what C held (NaN here), as BLAS requires.
    c_buf, ldc = _stored(c0 if beta else np.full((m, n), np.nan, np.float32), NO_TRANS, order, pad=4)
    alpha = 1.5
    previous = (fast_blas.set_gemv_max_rows(2 if gemv else 0), fast_blas.set_transpose_max_rows(32 if gemv else 0),
                fast_blas.set_few_rows_max(8 if gemv else 0), fast_blas.set_few_rows_min(few_min),
                fast_blas.set_large_min_rows(33 if gemv else 0))
    try:
        before = fast_blas.shim_calls()
        _sgemm()(order, ta, tb, m, n, k, alpha, a_buf.ctypes.data, lda, b_buf.ctypes.data, ldb,
                 beta, c_buf.ctypes.data, ldc)
        after = fast_blas.shim_calls()
    finally:
        fast_blas.set_gemv_max_rows(previous[0])
        fast_blas.set_transpose_max_rows(previous[1])
        fast_blas.set_few_rows_max(previous[2])
        fast_blas.set_few_rows_min(previous[3])
        fast_blas.set_large_min_rows(previous[4])
    got = c_buf[:, :m].T if order == COL_MAJOR else c_buf[:, :n]
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = alpha * (a64 @ b64) + (beta * c0.astype(np.float64) if beta else 0.0)
    bound = abs(alpha) * _bound(a64, b64) + 2 * U32 * np.abs(ref)
    assert np.all(np.abs(got - ref) <= bound)
    pad = c_buf[:, m:] if order == COL_MAJOR else c_buf[:, n:]
    assert np.all(np.isnan(pad)), "wrote outside C"
    # The rule is the row-major one; a column-major C[m,n] is a row-major C^T[n,m].
    rows, cols = (m, n) if order == ROW_MAJOR else (n, m)
    # x[M,K] @ W[N,K]^T in the row-major view, few_min..8 rows, K >= 8: the few-row kernel
    # (AVX2 CPUs), tried first; then 1-2-row (or one-column) products as sgemv.
    row_ta, row_tb = (ta, tb) if order == ROW_MAJOR else (tb, ta)
    few = (gemv and fast_blas.few_rows_supported() and row_ta == NO_TRANS and row_tb == TRANS
           and few_min <= rows <= 8 and cols >= 2 and k >= 8)
    as_gemv = gemv and not few and ((cols > 1 and rows <= 2) or (cols == 1 and rows > 1))
    # Row-major only: 3..32 rows and >= 64 columns are computed as the transpose.
    transposed = gemv and not as_gemv and not few and order == ROW_MAJOR and 3 <= rows <= 32 and cols >= 64
    assert after["sgemm_as_sgemv"] - before["sgemm_as_sgemv"] == int(as_gemv)
    assert after["sgemm_few_rows"] - before["sgemm_few_rows"] == int(few)
    assert after["sgemm_transposed"] - before["sgemm_transposed"] == int(transposed)
    # 33 rows and more (row-major view) on the large-product library, where one is bound.
    large = gemv and bool(fast_blas.large[0]) and not (as_gemv or few or transposed) and rows >= 33
    assert after["sgemm_large"] - before["sgemm_large"] == int(large)
    assert after["sgemm"] - before["sgemm"] == int(not as_gemv and not transposed and not few and not large)


@pytest.mark.parametrize("m", [1, 2, 4, 8, 13, 16, 32, 47, 64])
def test_few_row_kernel_on_the_pool_matches_float64(m, rng):
    # >= 1M multiply-adds: the columns are split over the pool (smaller products stay on
    # the caller); one and two rows reach the kernel with few_rows_min 1.
    if not fast_blas.few_rows_supported():
        pytest.skip("this CPU has no AVX2/FMA: the few-row kernel does not run")
    k, n = 577, 2053  # odd sizes: K's scalar tail, N's odd column
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    if m > fast_blas.few_rows_max():
        pytest.skip(f"{m} rows: past this CPU's bound ({fast_blas.few_rows_max()}), OpenBLAS's product")
    previous = fast_blas.set_few_rows_min(1)
    try:
        before = fast_blas.shim_calls()["sgemm_few_rows"]
        got = mx.array(x) @ mx.array(w).T
        mx.eval(got)
        assert fast_blas.shim_calls()["sgemm_few_rows"] == before + 1
    finally:
        fast_blas.set_few_rows_min(previous)
    _check(np.array(got), x.astype(np.float64), w.T.astype(np.float64))


def test_rows_past_32_take_the_kernel_only_for_layer_sized_weights(rng):
    """With the automatic bound, 33-64 rows run the few-row kernel for weights of up
    to 16 MB (a layer's) and OpenBLAS's packed sgemm for larger ones (an output
    head's: compute-bound there, where OpenBLAS is faster); 32 rows or fewer take
    the kernel whatever the weight, and a bound set explicitly holds for every
    weight. Each way float64's values."""
    if fast_blas.few_rows_max() <= 32:
        pytest.skip(f"this CPU's bound is {fast_blas.few_rows_max()} rows (the kernel's AVX-512 path takes 64)")
    k = 577
    big = mx.array(rng.standard_normal((7283, k)).astype(np.float32))  # 4.2M floats: past 16 MB
    small = mx.array(rng.standard_normal((2053, k)).astype(np.float32))
    previous = fast_blas.set_few_rows_min(1)
    try:
        for w, m, bound, kernel in [(big, 48, -1, False), (big, 64, -1, False), (big, 32, -1, True),
                                    (small, 48, -1, True), (big, 48, 64, True)]:
            x = rng.standard_normal((m, k)).astype(np.float32)
            old = fast_blas.set_few_rows_max(bound)
            try:
                before = fast_blas.shim_calls()
                got = mx.array(x) @ w.T
                mx.eval(got)
                after = fast_blas.shim_calls()
            finally:
                fast_blas.set_few_rows_max(old)
            assert after["sgemm_few_rows"] - before["sgemm_few_rows"] == int(kernel), (w.shape, m, bound)
            _check(np.array(got), x.astype(np.float64), np.array(w).T.astype(np.float64))
    finally:
        fast_blas.set_few_rows_min(previous)
    # The shim's status line says so: the automatic bound's rule, or a set bound for every weight.
    assert "1-32 rows on the shim's own kernel (33-64 for weights up to 16 MB)" in fast_blas._few_rows_summary()
    old = fast_blas.set_few_rows_max(48)
    try:
        assert "1-32 rows on the shim's own kernel (33-48)," in fast_blas._few_rows_summary()
    finally:
        fast_blas.set_few_rows_max(old)
    assert "(33-64 for weights up to 16 MB)" in fast_blas._few_rows_summary()


_THREADS_SCRIPT = r"""
import sys, numpy as np
import vllm_metal.native.ops  # noqa: F401  (arms the shim before mlx.core)
import mlx.core as mx
from vllm_metal.native import fast_blas
fast_blas.set_few_rows_min(1)
rng = np.random.default_rng(3)
out = {}
for m in (1, 2, 5, 8):
    for n in (4099, 49157):  # slice ends off the 8-row blocks unless aligned
        x = rng.standard_normal((m, 577)).astype(np.float32)
        w = rng.standard_normal((n, 577)).astype(np.float32)
        out[f"{m}x{n}"] = np.array(mx.array(x) @ mx.array(w).T)
np.savez(sys.argv[1], **out)
"""


def test_few_row_kernel_bits_do_not_depend_on_the_threads(tmp_path):
    """The pool's threads take slices of whole multiples of 8 columns, so every
    column takes the same kernel path (8-row blocks, then 4, pairs, singles)
    and the same sums with 1, 2 or 3 threads."""
    if not fast_blas.few_rows_supported():
        pytest.skip("this CPU has no AVX2/FMA: the few-row kernel does not run")
    import subprocess

    results = []
    for threads in (1, 2, 3):
        path = tmp_path / f"t{threads}.npz"
        env = {**os.environ, "VLLM_METAL_CPU_THREADS": str(threads)}
        subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, str(path)], env=env, check=True, timeout=300)
        results.append(np.load(path))
    for key in results[0].files:
        for other in results[1:]:
            assert np.array_equal(results[0][key], other[key]), key


_ROWS_SCRIPT = r"""
import sys, numpy as np
import vllm_metal.native.ops  # noqa: F401  (arms the shim before mlx.core)
import mlx.core as mx
from vllm_metal.native import fast_blas
fast_blas.set_few_rows_min(1)
rng = np.random.default_rng(5)
k, n = 577, 1030  # K's tail; N: columns past the last block of four
w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
rows = fast_blas.few_rows_max()
x = rng.standard_normal((rows + 1, k)).astype(np.float32)
before = fast_blas.shim_calls()["sgemm_few_rows"]
alone = [np.array(mx.array(x[i:i + 1]) @ w.T)[0] for i in range(rows)]
differ = []
for m in range(2, rows + 1):
    got = np.array(mx.array(x[:m]) @ w.T)
    differ += [(m, i, float(np.abs(got[i] - alone[i]).max())) for i in range(m) if not np.array_equal(got[i], alone[i])]
kernel_calls = fast_blas.shim_calls()["sgemm_few_rows"] - before
mx.eval(mx.array(x) @ w.T)  # one row past the bound: not the kernel's
past = fast_blas.shim_calls()["sgemm_few_rows"] - before - kernel_calls
print(rows, kernel_calls, past, differ)
"""


def _cpu_flags() -> set:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


@pytest.mark.parametrize("isa", [None, "avx2"])
def test_few_row_kernel_row_bits_do_not_depend_on_the_row_count(isa):
    """Decode's products at batch 1-32: a row's result has the same bits whatever the
    batch (the one-row kernel's FMA chains and sums, on AVX-512 the row blocks'
    sixteen sums at once in reduce16_avx512's same tree), so a request's tokens do
    not depend on how many others run beside it. The kernel takes up to 64 rows on its
    AVX-512 path (33-64 for weights up to 16 MB, as this one) and 16 on its AVX2 path
    (past those OpenBLAS's packed sgemm is as fast quiet, and slower served:
    docs/benchmarks.md#blas-shim); one row more goes to OpenBLAS. In a fresh
    process per ISA (the cap is read once)."""
    if not fast_blas.few_rows_supported():
        pytest.skip("this CPU has no AVX2/FMA: the few-row kernel does not run")
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "VLLM_METAL_CPU_ISA"}
    if isa:
        env["VLLM_METAL_CPU_ISA"] = isa
    out = subprocess.run([sys.executable, "-c", _ROWS_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.strip().splitlines()[-1]
    rows, calls, past, differ = out.split(" ", 3)
    avx512 = isa is None and {"avx512f", "avx512vl", "avx512dq"} <= _cpu_flags()
    assert int(rows) == (64 if avx512 else 16), out
    assert int(calls) == 2 * int(rows) - 1 and int(past) == 0 and differ == "[]", out


def _openblas_timeout(env: dict) -> str:
    """In a fresh interpreter: numpy's OpenBLAS's worker spin, as the library reports it."""
    import subprocess

    code = ("import ctypes, os, vllm_metal.native.ops; from vllm_metal.native import fast_blas; "
            "lib = ctypes.CDLL(fast_blas.libraries['gemm']); "
            "print(lib.openblas_thread_timeout(), os.environ.get('OPENBLAS_THREAD_TIMEOUT'), fast_blas.summary())")
    env = {**{k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}, **env}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_openblas_workers_sleep_soon_unless_the_user_chose():
    """numpy's OpenBLAS read its environment when numpy loaded it; the shim's
    set-up re-reads it with OPENBLAS_THREAD_TIMEOUT=10 and restarts the idle
    workers (their polling would otherwise hold a core for ~0.1 s after every
    BLAS call); a value the user set stands. Matmuls still right afterwards."""
    timeout, env, summary = _openblas_timeout({}).split(" ", 2)
    assert timeout == env == str(fast_blas.SPIN_TIMEOUT) and "workers sleep after 2^10 cycles" in summary
    timeout, env, summary = _openblas_timeout({"OPENBLAS_THREAD_TIMEOUT": "7"}).split(" ", 2)
    assert timeout == env == "7" and "set by the user" in summary
    a = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32)
    _check(np.array(mx.array(a) @ mx.array(a.T)), a.astype(np.float64), a.T.astype(np.float64))
