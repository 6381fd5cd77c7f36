"""The MSL executor itself: barriers and simd operations synchronise for real,
divergence and out-of-bounds reads are caught, and the shim's types, thread ids,
address spaces and threadgroup memory behave as Metal's (kernels in
kernels/shim_selftest.metal)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import msl_build
import msl_executor
from msl_executor import KernelFault


@pytest.mark.parametrize("threads,groups", [(32, 1), (100, 3), (1024, 2)])
def test_barrier_orders_threadgroup_memory(executor, threads, groups):
    x = np.arange(threads, dtype=np.float32) + 1
    out = np.zeros(threads, np.float32)
    for seed in range(3):
        executor.launch("reverse_with_barrier", [x, out], (groups, 1, 1), (threads, 1, 1),
                        seed=seed)
        np.testing.assert_array_equal(out, x[::-1])


def test_missing_barrier_is_exposed(executor):
    """Without the barrier some threads read threadgroup memory before it is
    written: the poison (NaN) shows, so a forgotten barrier fails tests."""
    x = np.arange(256, dtype=np.float32)
    out = np.zeros(256, np.float32)
    executor.launch("reverse_without_barrier", [x, out], (1, 1, 1), (256, 1, 1))
    assert np.isnan(out).any()


def test_simd_operations(executor, rng):
    n = 64  # two simdgroups
    x = rng.integers(0, 40, n).astype(np.float32)
    out = np.zeros(n * 12, np.float32)
    executor.launch("simd_operations", [x, out], (1, 1, 1), (n, 1, 1))
    out = out.reshape(n, 12)
    for g in range(n // 32):
        v = x[32 * g:32 * g + 32]
        lane = np.arange(32)
        got = out[32 * g:32 * g + 32]
        xi = v.astype(np.int64)
        expect = {
            0: np.full(32, v.sum()), 1: np.full(32, v.max()), 2: np.full(32, v.min()),
            3: np.cumsum(v) - v, 4: np.cumsum(v), 5: v[(lane * 7) % 32], 6: v[lane ^ 5],
            7: np.where(lane + 3 < 32, v[np.minimum(lane + 3, 31)], v),
            8: np.where(lane >= 3, v[np.maximum(lane - 3, 0)], v), 9: np.full(32, v[9]),
            10: np.full(32, np.bitwise_or.reduce(xi) + (1000 if (v > 30).any() else 0) + 2000),
            11: np.full(32, v[0]),
        }
        for col, want in expect.items():
            np.testing.assert_array_equal(got[:, col], want, err_msg=f"column {col}")


def test_thread_ids(executor):
    grid, group = (3, 2, 2), (8, 4, 2)
    ngrid = [g * t for g, t in zip(grid, group)]
    total = int(np.prod(ngrid))
    out = np.zeros(total * 23, np.uint32)
    executor.launch("thread_ids", [out], grid, group)
    out = out.reshape(total, 23)
    for linear in range(total):
        gx = linear % ngrid[0]
        gy = (linear // ngrid[0]) % ngrid[1]
        gz = linear // (ngrid[0] * ngrid[1])
        g = (gx, gy, gz)
        tg = tuple(a // b for a, b in zip(g, group))
        tp = tuple(a % b for a, b in zip(g, group))
        tindex = tp[0] + group[0] * (tp[1] + group[1] * tp[2])
        want = [*g, *tg, *tp, *group, *grid, *ngrid, tindex, tindex // 32, tindex % 32, 2, 32]
        assert list(out[linear]) == want, f"thread {g}"


SPECIAL = np.array([0.0, -0.0, 1.0, 1.0009765625 + 2**-12, 65504.0, 65520.0, 1e-8, 6e-8,
                    3.0e38, -1.5, np.inf, -np.inf, np.nan, 1.00390625, 1.01171875,
                    2**-130], np.float32)


@pytest.mark.parametrize("type_name", ["half", "bfloat"])
def test_half_and_bfloat_conversions(executor, rng, type_name):
    """float -> half/bfloat rounds to nearest even (overflow to inf, NaN kept),
    checked against numpy (half) and MLX's astype (bfloat16)."""
    import mlx.core as mx

    x = np.concatenate([SPECIAL, rng.standard_normal(48).astype(np.float32) * 100])
    n = x.size
    stored = np.zeros(n, np.uint16)
    vectors = rng.standard_normal((n, 4)).astype(np.float32)
    before = vectors.copy()
    executor.launch(f"round_trip_{type_name}", [x, stored, vectors], (1, 1, 1), (n, 1, 1))
    if type_name == "half":
        with np.errstate(over="ignore"):
            want = x.astype(np.float16).view(np.uint16)
            back = x.astype(np.float16).astype(np.float32)
    else:
        want = np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))
        back = msl_executor.bf16_bits_to_float(want)
    np.testing.assert_array_equal(stored, want)
    v = before * 2 + np.stack([back, np.zeros(n), np.ones(n), np.full(n, 2.0)], axis=1)
    v[:, 3] = v[:, :3].sum(axis=1)
    np.testing.assert_allclose(vectors, v.astype(np.float32), rtol=1e-6)


@pytest.mark.parametrize("kernel,message", [
    ("divergent_barrier", "can never continue"),
    ("exit_before_barrier", "can never continue"),
    ("divergent_simd", "can never continue"),
    ("too_much_threadgroup_memory", "32 KiB"),
])
def test_faults_are_reported(executor, kernel, message):
    with pytest.raises(KernelFault, match=message):
        executor.launch(kernel, [np.zeros(64, np.float32)], (1, 1, 1), (64, 1, 1))


def test_read_past_the_end_of_a_buffer_faults(executor, tmp_path):
    """Buffers sit against inaccessible pages: one element too far is a SIGSEGV."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        import numpy as np
        sys.path.insert(0, {str(Path(msl_executor.__file__).parent)!r})
        from msl_executor import Executor
        ex = Executor(Path({str(executor.path)!r}))
        x = np.ones(64, np.float32)
        out = np.zeros(64, np.float32)
        n = np.array([int(sys.argv[1])], np.int32)
        ex.launch("read_past_end", [x, out, n], (1, 1, 1), (64, 1, 1))
    """)
    ok = subprocess.run([sys.executable, "-c", code, "0"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([sys.executable, "-c", code, "1"], capture_output=True, text=True)
    assert bad.returncode == -11, (bad.returncode, bad.stderr[-500:])


def _syntax_check(executor, body: str) -> subprocess.CompletedProcess:
    source = "#include <metal_stdlib>\nusing namespace metal;\n" + body
    return subprocess.run(
        [msl_build.find_compiler(), *msl_build.CXX_FLAGS, *msl_build.include_flags(),
         "-fsyntax-only", "-x", "c++", "-"], input=source, capture_output=True, text=True)


def test_address_spaces_are_distinct_types(executor):
    """As in Metal, a device pointer is not a threadgroup or thread pointer, so
    a missing or wrong address-space qualifier fails to compile here too."""
    good = _syntax_check(executor, """
        float h(const threadgroup float* t, const device float* d) { return t[0] + d[0]; }
        float g(const threadgroup float* t, const device float* d) { return h(t, d); }
    """)
    assert good.returncode == 0, good.stderr
    for call in ("h(d, d)", "k(d)"):
        bad = _syntax_check(executor, """
            float h(const threadgroup float* t, const device float* d) { return t[0] + d[0]; }
            float k(const float* p) { return p[0]; }
            float g(const device float* d) { return %s; }
        """ % call)
        assert bad.returncode != 0 and "address space" in bad.stderr, bad.stderr


def test_unsupported_msl_is_rejected():
    with pytest.raises(RuntimeError, match="unsupported threadgroup declaration"):
        msl_build.rewrite_threadgroup_arrays("void k() {\n  threadgroup float a[4], b[4];\n}")
    pre = ("[[kernel]] void k(device float* x [[buffer(0)]], "
           "texture2d<float> t [[texture(0)]]) {}")
    with pytest.raises(RuntimeError, match=r"does not support \[\[texture\]\]"):
        msl_build.glue(pre)
