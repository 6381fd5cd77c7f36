"""ops.rms_norm, ops.layer_norm and ops.rope: vllm-metal's norm and RoPE primitives on
MLX's CPU device, against float64 numpy (and MLX's own rms_norm / rope where
they compute the same thing), plus their refusals of bad input."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.native import ops

TOLERANCE = {mx.float32: (2e-6, 2e-6), mx.float16: (2e-3, 2e-3), mx.bfloat16: (1.6e-2, 1.6e-2)}


def f64(a):
    return np.array(a.astype(mx.float32), np.float64)


def rms_reference(x, w, eps):
    X, W = f64(x), f64(w)
    return X / np.sqrt((X * X).mean(-1, keepdims=True) + eps) * W


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (8, 576), (1, 300, 64), (2, 5, 9, 64), (1030, 128)])
def test_rms_norm_matches_float64(rng, dtype, shape):
    x = mx.array((rng.standard_normal(shape) * 3).astype(np.float32)).astype(dtype)
    w = mx.array(rng.standard_normal(shape[-1]).astype(np.float32)).astype(dtype)
    out = ops.rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    atol, rtol = TOLERANCE[dtype]
    np.testing.assert_allclose(f64(out), rms_reference(x, w, 1e-5), atol=atol * 4, rtol=rtol)
    # MLX's own composition: the same formula, the same roundings.
    np.testing.assert_allclose(f64(out), f64(mx.fast.rms_norm(x, w, 1e-5)), atol=atol * 4, rtol=rtol)


def layer_reference(x, w, b, eps):
    X = f64(x)
    c = X - X.mean(-1, keepdims=True)
    y = c / np.sqrt((c * c).mean(-1, keepdims=True) + eps) * f64(w)
    return y if b is None else y + f64(b)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (8, 768), (2, 5, 9, 64), (1030, 128)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_matches_float64(rng, dtype, shape, with_bias):
    # rows off zero mean with a spread, as an encoder's residual stream has
    x = mx.array((rng.standard_normal(shape) * 3 + 5).astype(np.float32)).astype(dtype)
    w = mx.array(rng.standard_normal(shape[-1]).astype(np.float32)).astype(dtype)
    b = mx.array(rng.standard_normal(shape[-1]).astype(np.float32)).astype(dtype) if with_bias else None
    out = ops.layer_norm(x, w, b, 1e-12)
    assert out.dtype == dtype and out.shape == x.shape
    atol, rtol = TOLERANCE[dtype]
    if shape[-1] > 1:
        np.testing.assert_allclose(f64(out), layer_reference(x, w, b, 1e-12), atol=atol * 8, rtol=rtol * 4)
    # MLX's own composition (one element per row: 0 * rsqrt(eps), both)
    np.testing.assert_allclose(f64(out), f64(mx.fast.layer_norm(x, w, b, 1e-12)), atol=atol * 8, rtol=rtol * 4)


def test_layer_norm_constant_rows_strided_input_and_refusals(rng):
    x = mx.full((4, 32), 7.0)
    w, b = mx.ones((32,)), mx.full((32,), 0.5)
    assert np.array(ops.layer_norm(x, w, b, 1e-6)).tolist() == np.full((4, 32), 0.5).tolist()  # no NaN
    both = mx.array(rng.standard_normal((64, 80)).astype(np.float32))
    view = both[:, 10:42]
    w = mx.array(rng.standard_normal(32).astype(np.float32))
    np.testing.assert_allclose(f64(ops.layer_norm(view, w, None, 1e-5)), layer_reference(view, w, None, 1e-5),
                               atol=2e-5, rtol=2e-6)
    x = mx.ones((2, 8))
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        ops.layer_norm(x, mx.ones((8,)), mx.ones((7,)), 1e-5)
    with pytest.raises(ValueError, match=r"weight must be \[8\] of x's dtype"):
        ops.layer_norm(x, mx.ones((8,), dtype=mx.float16), None, 1e-5)
    with pytest.raises(TypeError, match="bias must be an mx.array"):
        ops.layer_norm(x, mx.ones((8,)), np.ones(8), 1e-5)
    with pytest.raises(ValueError, match="eps must be finite"):
        ops.layer_norm(x, mx.ones((8,)), None, -1.0)
    with pytest.raises(ValueError, match=r"\[layer_norm\] bias must have shape"):
        ops._ext.layer_norm(x, mx.ones((8,)), mx.ones((3,)), 1e-5)


def test_rms_norm_zero_rows_and_strided_input(rng):
    x = mx.zeros((4, 32))
    w = mx.ones((32,))
    assert np.array(ops.rms_norm(x, w, 1e-6)).tolist() == np.zeros((4, 32)).tolist()  # no NaN from 0/0
    both = mx.array(rng.standard_normal((64, 80)).astype(np.float32))
    view = both[:, 10:42]  # column slice: not contiguous
    w = mx.array(rng.standard_normal(32).astype(np.float32))
    np.testing.assert_allclose(f64(ops.rms_norm(view, w, 1e-5)), rms_reference(view, w, 1e-5), atol=1e-5, rtol=2e-6)


def test_rms_norm_refuses_bad_input():
    x = mx.ones((2, 8))
    with pytest.raises(ValueError, match=r"weight must be \[8\]"):
        ops.rms_norm(x, mx.ones((7,)), 1e-5)
    with pytest.raises(ValueError, match="x's dtype"):
        ops.rms_norm(x, mx.ones((8,), dtype=mx.float16), 1e-5)
    with pytest.raises(TypeError, match="x must be an mx.array"):
        ops.rms_norm(np.ones((2, 8)), mx.ones((8,)), 1e-5)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        ops._ext.rms_norm(mx.ones((2, 8), dtype=mx.int32), mx.ones((8,), dtype=mx.int32), 1e-5)
    with pytest.raises(ValueError, match="eps must be finite"):
        ops.rms_norm(x, mx.ones((8,)), float("nan"))


def rope_reference(x, table, traditional):
    X, T = f64(x), np.array(table, np.float64)
    rotated = 2 * T.shape[1]
    c, s = T[:, None, :, 0], T[:, None, :, 1]
    out = X.copy()
    if traditional:
        a, b = X[..., 0:rotated:2], X[..., 1:rotated:2]
        out[..., 0:rotated:2], out[..., 1:rotated:2] = a * c - b * s, b * c + a * s
    else:
        h = rotated // 2
        a, b = X[..., :h], X[..., h:rotated]
        out[..., :h], out[..., h:rotated] = a * c - b * s, b * c + a * s
    return out


def random_table(rng, tokens, half, scale=1.0):
    angle = rng.uniform(0, 2 * np.pi, (tokens, half))
    return mx.array((scale * np.stack([np.cos(angle), np.sin(angle)], -1)).astype(np.float32))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("shape,rotated", [((1, 1, 2), 2), ((7, 9, 64), 64), ((5, 3, 128), 32),
                                           ((1030, 2, 256), 256), ((3, 4, 80), 64)])
def test_rope_matches_float64(rng, dtype, traditional, shape, rotated):
    x = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    table = random_table(rng, shape[0], rotated // 2, scale=1.3)  # a folded-in scale (yarn's mscale)
    out = ops.rope(x, table, traditional=traditional)
    assert out.dtype == dtype and out.shape == x.shape
    atol, rtol = TOLERANCE[dtype]
    want = rope_reference(x, table, traditional)
    np.testing.assert_allclose(f64(out), want, atol=atol * 4, rtol=rtol)
    # What `rope` builds off the CPU: the same numbers from MLX ops.
    np.testing.assert_allclose(f64(ops.rope_composed(x, table, traditional=traditional)), want,
                               atol=atol * 4, rtol=rtol)


@pytest.mark.parametrize("traditional", [False, True])
def test_rope_with_a_cos_sin_table_equals_mlx_rope(rng, traditional):
    """The table of nn.RoPE's angles reproduces mx.fast.rope at per-token
    positions (small ones: MLX forms the angles in float32, ~6e-8 x position
    off the float64 ones)."""
    tokens, heads, dim, base = 6, 4, 64, 10000.0
    positions = np.array([0, 1, 7, 100, 300, 511])
    inv = base ** (-np.arange(0, dim, 2) / dim)
    angle = positions[:, None] * inv[None, :]
    table = mx.array(np.stack([np.cos(angle), np.sin(angle)], -1).astype(np.float32))
    x = mx.array(rng.standard_normal((tokens, heads, dim)).astype(np.float32))
    theirs = mx.fast.rope(x[:, :, None, :], dim, traditional=traditional, base=base, scale=1.0,
                          offset=mx.array(positions, dtype=mx.int32))[:, :, 0, :]
    np.testing.assert_allclose(np.array(ops.rope(x, table, traditional=traditional)), np.array(theirs),
                               atol=1e-4, rtol=1e-4)


def test_rope_inside_a_lazy_graph(rng):
    x = mx.array(rng.standard_normal((4, 2, 16)).astype(np.float32))
    table = random_table(rng, 4, 8)
    y = ops.rope(ops.rope(x * 2, table), table)  # nothing evaluated until here
    np.testing.assert_allclose(f64(y), rope_reference(mx.array(rope_reference(x * 2, table, False).astype(np.float32)),
                                                      table, False), atol=1e-5, rtol=1e-5)


def test_rope_refuses_bad_input():
    x = mx.ones((3, 2, 8))
    with pytest.raises(ValueError, match=r"\[rope\] x must be \[tokens, heads, dim\]"):
        ops.rope(mx.ones((3, 8)), mx.ones((3, 4, 2)))
    with pytest.raises(ValueError, match="rotated <= dim"):
        ops.rope(x, mx.ones((3, 5, 2)))  # 10 rotated dims of 8
    with pytest.raises(ValueError, match="table float32"):
        ops.rope(x, mx.ones((2, 4, 2)))  # tokens differ
    with pytest.raises(ValueError, match="table float32"):
        ops.rope(x, mx.ones((3, 4, 2), dtype=mx.float16))
    with pytest.raises(ValueError, match="table must be float32"):
        ops._ext.rope(x, mx.ones((3, 4, 2), dtype=mx.float16), False)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        ops._ext.rope(mx.ones((3, 2, 8), dtype=mx.int32), mx.ones((3, 4, 2)), False)
