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
