"""ops.gelu: vllm-metal's GELU primitive on MLX's CPU device (exact erf
form and tanh form, as transformers' "gelu" and "gelu_pytorch_tanh"),
against float64 numpy."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.native import ops

TOLERANCE = {mx.float32: (2e-6, 2e-6), mx.float16: (2e-3, 2e-3), mx.bfloat16: (1.6e-2, 1.6e-2)}
ERF = np.vectorize(math.erf, otypes=[np.float64])


def reference(x, approximate):
    x = np.array(x.astype(mx.float32), np.float64)
    if approximate:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + ERF(x / math.sqrt(2)))


@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(0,), (1,), (15,), (17,), (3, 1536), (1, 300, 700)])
def test_matches_float64(rng, dtype, shape, approximate):
    x = mx.array((rng.standard_normal(shape) * 3).astype(np.float32)).astype(dtype)
    out = ops.gelu(x, approximate=approximate)
    assert out.dtype == dtype and out.shape == x.shape
    atol, rtol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), reference(x, approximate), atol=atol, rtol=rtol)


@pytest.mark.parametrize("approximate", [False, True])
def test_extremes_and_strided_inputs(rng, approximate):
    x = mx.array(np.array([-1e4, -100.0, -10.0, -4.5, -4.0, -0.0, 0.0, 1e-30, 1e-3, 3.9, 4.0, 10.0, 1e4] * 3,
                          np.float32))
    out = np.array(ops.gelu(x, approximate=approximate))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, reference(x, approximate), atol=1e-6, rtol=2e-6)
    both = mx.array(rng.standard_normal((64, 80)).astype(np.float32))
    cols = mx.split(both, [40], axis=-1)[1].T  # a column slice, transposed: not contiguous
    np.testing.assert_allclose(np.array(ops.gelu(cols, approximate=approximate)), reference(cols, approximate),
                               atol=2e-6, rtol=2e-6)


def test_same_as_mlx_within_rounding(rng):
    import mlx.nn as nn

    x = mx.array((rng.standard_normal((8, 3072)) * 3).astype(np.float32))
    np.testing.assert_allclose(np.array(ops.gelu(x)), np.array(nn.gelu(x)), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.array(ops.gelu(x, approximate=True)), np.array(nn.gelu_approx(x)),
                               rtol=2e-6, atol=2e-6)
    assert np.abs(np.array(ops.gelu(x)) - np.array(ops.gelu(x, approximate=True))).max() > 1e-4  # two forms


def test_lazy_and_bad_input():
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        ops.gelu(mx.zeros((2,), mx.int32))
    with pytest.raises(TypeError):
        ops.gelu(np.zeros(2))
    out = ops.gelu(mx.zeros((2, 3)) + 1)  # builds a graph node, computes nothing yet
    assert not ops._ext.is_materialized(out)
