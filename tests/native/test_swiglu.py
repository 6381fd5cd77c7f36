"""ops.swiglu: silu(gate) * up, vllm-metal's SwiGLU primitive on MLX's CPU
device, against float64 numpy."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.native import ops

TOLERANCE = {mx.float32: (2e-6, 2e-6), mx.float16: (2e-3, 2e-3), mx.bfloat16: (1.6e-2, 1.6e-2)}


def reference(g, u):
    g, u = np.array(g.astype(mx.float32), np.float64), np.array(u.astype(mx.float32), np.float64)
    with np.errstate(over="ignore"):  # exp(1e4) = inf: the limit 0 is what silu takes
        return g / (1.0 + np.exp(-g)) * u


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(0,), (1,), (15,), (17,), (3, 1536), (1, 300, 700)])
def test_matches_float64(rng, dtype, shape):
    g = mx.array((rng.standard_normal(shape) * 4).astype(np.float32)).astype(dtype)
    u = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    out = ops.swiglu(g, u)
    assert out.dtype == dtype and out.shape == g.shape
    atol, rtol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), reference(g, u), atol=atol, rtol=rtol)


def test_extremes_and_strided_inputs(rng):
    g = mx.array(np.array([-1e4, -100.0, -88.0, -30.0, -0.0, 0.0, 1e-30, 30.0, 88.0, 100.0, 1e4] * 3, np.float32))
    u = mx.array(rng.standard_normal(g.shape[0]).astype(np.float32))
    out = np.array(ops.swiglu(g, u))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, reference(g, u), atol=1e-6, rtol=2e-6)
    both = mx.array(rng.standard_normal((64, 2 * 40)).astype(np.float32))
    gate, up = mx.split(both, [40], axis=-1)  # column slices: not contiguous
    np.testing.assert_allclose(np.array(ops.swiglu(gate.T, up.T)), reference(gate.T, up.T), atol=2e-6, rtol=2e-6)


def test_same_as_mlx_silu_within_rounding(rng):
    import mlx.nn as nn

    g = mx.array(rng.standard_normal((8, 1536)).astype(np.float32))
    u = mx.array(rng.standard_normal((8, 1536)).astype(np.float32))
    np.testing.assert_allclose(np.array(ops.swiglu(g, u)), np.array(nn.silu(g) * u), rtol=1e-6, atol=1e-7)


def test_lazy_and_bad_input(rng):
    g = mx.zeros((2, 3))
    with pytest.raises(ValueError, match="same shape"):
        ops.swiglu(g, mx.zeros((3, 2)))
    with pytest.raises(ValueError, match="same dtype"):
        ops.swiglu(g, mx.zeros((2, 3), mx.float16))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        ops.swiglu(mx.zeros((2,), mx.int32), mx.zeros((2,), mx.int32))
    with pytest.raises(TypeError):
        ops.swiglu(np.zeros(2), g)
    out = ops.swiglu(g + 1, g)  # builds a graph node, computes nothing yet
    assert not ops._ext.is_materialized(out)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("layout", ["fused halves", "fused halves 3d", "one row", "transposed", "broadcast",
                                    "mixed", "step slices", "overlapping"])
def test_every_operand_layout_same_bits_as_contiguous(rng, dtype, layout):
    """Rows read in place (a fused gate/up product's halves: evenly spaced
    contiguous rows) or copied first (any other layout): the same bits as
    the same values passed contiguous."""
    both = mx.array((rng.standard_normal((2, 37, 2 * 100)) * 3).astype(np.float32)).astype(dtype)
    flat = both.reshape(74, 200)
    if layout == "fused halves":
        gate, up = mx.split(flat, [100], axis=-1)
    elif layout == "fused halves 3d":
        gate, up = mx.split(both, [100], axis=-1)
    elif layout == "one row":
        gate, up = mx.split(flat[5:6], [100], axis=-1)
    elif layout == "transposed":
        gate, up = flat[:, :50].T, flat[:, 100:150].T
    elif layout == "broadcast":
        gate, up = mx.broadcast_to(flat[:1, :100], (74, 100)), flat[:, 100:]
    elif layout == "mixed":
        gate, up = flat[:, :100], mx.array(np.array(flat[:, 100:].astype(mx.float32))).astype(dtype)
    elif layout == "step slices":
        gate, up = flat[::2, :100], flat[1::2, 100:]
    else:  # rows closer than their width: a view MLX can make with as_strided
        gate = mx.as_strided(flat.reshape(-1), (10, 100), (50, 1))
        up = mx.as_strided(flat.reshape(-1), (10, 100), (50, 1), offset=7)
    want = ops.swiglu(mx.array(np.array(gate.astype(mx.float32))).astype(dtype),
                      mx.array(np.array(up.astype(mx.float32))).astype(dtype))
    got = ops.swiglu(gate, up)
    assert got.shape == gate.shape and got.dtype == dtype
    assert np.array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))
    atol, rtol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), reference(gate, up), atol=atol, rtol=rtol)
