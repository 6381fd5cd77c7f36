"""ops.gated_delta: the fused gated-delta recurrence primitive on MLX's CPU
device, against the float64 definition (tests/numpy_reference.py) and
against mlx-lm's own ops path (gated_delta_ops, what the primitive replaces);
its in-place state, scheduling invariance (the bits of a sequence do not
depend on how its tokens are split into calls or batched) and bad input.
The Metal kernel is checked by tests/metal/test_gated_delta_executor.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops

from numpy_reference import gated_delta_f64, gated_delta_inputs
from vllm_metal.native import ops

address = ops._ext.buffer_address
TOL = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def as_mx(arrays, dtype=mx.float32):
    q, k, v, g, beta, state, mask = arrays
    out = [mx.array(a).astype(dtype) for a in (q, k, v)]
    out += [mx.array(g), mx.array(beta), mx.array(state), None if mask is None else mx.array(mask)]
    return out


def rounded(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32), np.float64)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("key_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_float64_definition(rng, dtype, key_dim, masked):
    shape = dict(batch=3, steps=7, k_heads=2, v_heads=4, key_dim=key_dim, value_dim=20)
    arrays = gated_delta_inputs(rng, masked=masked, **shape)
    q, k, v, g, beta, state, mask = as_mx(arrays, dtype)
    y, new_state = ops.gated_delta(q, k, v, g, beta, state, mask)
    assert y.dtype == dtype and y.shape == (3, 7, 4, 20)
    assert new_state.dtype == mx.float32 and new_state.shape == (3, 4, 20, key_dim)
    # The reference sees exactly the inputs the primitive saw (rounded to dtype).
    y_ref, state_ref = gated_delta_f64(rounded(q), rounded(k), rounded(v), arrays[3], arrays[4], arrays[5],
                                       arrays[6])
    tol = TOL[dtype]
    np.testing.assert_allclose(rounded(y), y_ref, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.array(new_state), state_ref, atol=2e-5, rtol=2e-5)
    if masked:
        assert (np.array(y.astype(mx.float32))[~arrays[6]] == 0).all()


def test_fully_masked_row_keeps_its_state_exactly(rng):
    arrays = list(gated_delta_inputs(rng, batch=2, steps=5, k_heads=1, v_heads=2, key_dim=32, value_dim=8))
    arrays[6] = np.array([[True, True, False, False, False], [False] * 5])
    q, k, v, g, beta, state, mask = as_mx(arrays)
    y, new_state = ops.gated_delta(q, k, v, g, beta, state, mask)
    np.testing.assert_array_equal(np.array(new_state)[1], arrays[5][1])
    assert (np.array(y)[1] == 0).all()


@pytest.mark.parametrize("masked", [False, True])
def test_agrees_with_mlx_lm_ops_path(rng, masked):
    """mlx-lm's gated_delta_ops (a few MLX ops per token) is what the layer
    ran before; the primitive computes the same thing (float32 rounding apart)."""
    arrays = gated_delta_inputs(rng, batch=2, steps=12, k_heads=2, v_heads=4, key_dim=128, value_dim=128,
                                masked=masked)
    q, k, v, g, beta, state, mask = as_mx(arrays)
    y, new_state = ops.gated_delta(q, k, v, g, beta, state, mask)
    y_ops, state_ops = gated_delta_ops(q, k, v, g, beta, state, mask)
    real = np.ones((2, 12), bool) if mask is None else arrays[6]
    np.testing.assert_allclose(np.array(y)[real], np.array(y_ops)[real], atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(np.array(new_state), np.array(state_ops), atol=1e-6, rtol=1e-5)


def test_same_bits_however_the_tokens_are_split_or_batched(rng):
    """Decode one token at a time, prefill at once, chunked, or batched with
    other sequences of other lengths: the same bits (what makes hybrid serving
    scheduling-invariant)."""
    arrays = gated_delta_inputs(rng, batch=3, steps=10, k_heads=2, v_heads=4, key_dim=64, value_dim=16,
                                masked=True)
    arrays[6][0] = True  # row 0 runs all 10 steps
    q, k, v, g, beta, state, mask = as_mx(arrays)
    y_all, s_all = ops.gated_delta(q, k, v, g, beta, state, mask)
    mx.eval(y_all, s_all)
    row = lambda a: a[:1]  # noqa: E731
    for split in ([10], [1] * 10, [3, 7], [4, 4, 2]):
        s, start, ys = row(state), 0, []
        for n in split:
            sl = slice(start, start + n)
            y, s = ops.gated_delta(row(q)[:, sl], row(k)[:, sl], row(v)[:, sl], row(g)[:, sl], row(beta)[:, sl], s)
            ys.append(y)
            start += n
        np.testing.assert_array_equal(np.array(mx.concatenate(ys, axis=1)), np.array(y_all[:1]))
        np.testing.assert_array_equal(np.array(s), np.array(s_all[:1]))


def test_state_updated_in_place_when_nothing_else_holds_it(rng):
    """A state nothing else references (a step's gathered states) is donated:
    the final state comes back in its buffer. A state still referenced is
    left untouched and the result gets a buffer of its own."""
    q, k, v, g, beta, state, _ = as_mx(gated_delta_inputs(rng, batch=2, steps=3, k_heads=1, v_heads=2,
                                                          key_dim=32, value_dim=8))
    mx.eval(q, k, v, g, beta, state)
    kept = state * 1.0
    mx.eval(kept)
    before = np.array(kept)
    _, out_kept = ops.gated_delta(q, k, v, g, beta, kept)
    mx.eval(out_kept)
    assert address(out_kept) != address(kept)
    np.testing.assert_array_equal(np.array(kept), before)

    temp = state * 1.0
    mx.eval(temp)
    temp_address = address(temp)
    y, out = ops.gated_delta(q, k, v, g, beta, temp)
    del temp  # now only the primitive holds it
    mx.eval(y, out)
    assert address(out) == temp_address
    np.testing.assert_array_equal(np.array(out), np.array(out_kept))


def test_empty_batch_and_zero_steps(rng):
    q, k, v, g, beta, state, _ = as_mx(gated_delta_inputs(rng, batch=2, steps=3, k_heads=1, v_heads=2,
                                                          key_dim=32, value_dim=8))
    y, s = ops.gated_delta(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0], state)
    assert y.shape == (2, 0, 2, 8)
    np.testing.assert_array_equal(np.array(s), np.array(state))
    y, s = ops.gated_delta(q[:0], k[:0], v[:0], g[:0], beta[:0], state[:0])
    assert y.shape == (0, 3, 2, 8) and s.shape == (0, 2, 8, 32)


def test_strided_inputs(rng):
    """Views of any layout (here: q and the state as transposed views) give
    the bits of their contiguous copies."""
    arrays = gated_delta_inputs(rng, batch=2, steps=4, k_heads=2, v_heads=2, key_dim=32, value_dim=8)
    q, k, v, g, beta, state, _ = as_mx(arrays)
    qt = mx.swapaxes(mx.array(np.ascontiguousarray(np.swapaxes(arrays[0], 1, 2))), 1, 2)
    st = mx.swapaxes(mx.array(np.ascontiguousarray(np.swapaxes(arrays[5], 0, 2))), 0, 2)
    assert np.array_equal(np.array(qt), arrays[0]) and np.array_equal(np.array(st), arrays[5])
    y, s = ops.gated_delta(qt, k, v, g, beta, st)
    y_ref, s_ref = ops.gated_delta(q, k, v, g, beta, state)
    np.testing.assert_array_equal(np.array(y), np.array(y_ref))
    np.testing.assert_array_equal(np.array(s), np.array(s_ref))


BAD = [
    (lambda a: dict(a, q=a["q"][0]), "q must have rank 4"),
    (lambda a: dict(a, k=a["k"][:, :2]), "k must have shape"),
    (lambda a: dict(a, v=a["v"][..., :1, :]), "g must have shape"),
    (lambda a: dict(a, g=a["g"][..., None]), "g must have shape"),
    (lambda a: dict(a, beta=a["beta"][:, :1]), "beta must have shape"),
    (lambda a: dict(a, state=a["state"].astype(mx.float16)), "state must be float32"),
    (lambda a: dict(a, state=a["state"][:, :, :4]), "state must have shape"),
    (lambda a: dict(a, k=a["k"].astype(mx.float16)), "k dtype"),
    (lambda a: dict(a, q=a["q"].astype(mx.int32), k=a["k"].astype(mx.int32), v=a["v"].astype(mx.int32)),
     "q must be float32, float16 or bfloat16"),
    (lambda a: dict(a, mask=mx.ones((2, 3), mx.int32)), "mask must be bool"),
    (lambda a: dict(a, mask=mx.ones((2, 4), mx.bool_)), "mask must have shape"),
    (lambda a: dict(a, g=mx.ones((2, 3, 3), mx.int32)), "g must be a floating-point array"),
]


@pytest.mark.parametrize("change,message", BAD)
def test_bad_input_is_refused_with_its_name(rng, change, message):
    q, k, v, g, beta, state, _ = as_mx(gated_delta_inputs(rng, batch=2, steps=3, k_heads=1, v_heads=3,
                                                          key_dim=32, value_dim=8))
    args = change(dict(q=q, k=k, v=v, g=g, beta=beta, state=state, mask=None))
    with pytest.raises(ValueError, match=message):
        ops.gated_delta(**args)


def test_unsupported_sizes_are_refused(rng):
    for key_dim, value_dim, k_heads, v_heads, message in [
            (16, 8, 1, 2, "key head dim Dk = 16 is not supported"),
            (48, 8, 1, 2, "key head dim Dk = 48"),
            (32, 257, 1, 2, "value head dim Dv = 257"),
            (32, 8, 2, 3, "positive multiple of the key heads")]:
        q, k, v, g, beta, state, _ = as_mx(gated_delta_inputs(rng, batch=1, steps=2, k_heads=k_heads,
                                                              v_heads=v_heads, key_dim=key_dim,
                                                              value_dim=value_dim))
        with pytest.raises(ValueError, match=message):
            ops.gated_delta(q, k, v, g, beta, state)
    with pytest.raises(TypeError, match="beta must be an mx.array"):
        ops.gated_delta(q, k, v, g, np.ones(3), state)


def test_path_switch(monkeypatch):
    monkeypatch.delenv("VLLM_METAL_GATED_DELTA", raising=False)
    assert ops.gated_delta_path(mx.cpu)[0] == "fused"
    assert ops.gated_delta_path(mx.gpu)[0] == "mlx-lm"  # mlx-lm's own Metal kernel on the GPU
    monkeypatch.setenv("VLLM_METAL_GATED_DELTA", "mlx-lm")
    assert ops.gated_delta_path(mx.cpu)[0] == "mlx-lm"
    monkeypatch.setenv("VLLM_METAL_GATED_DELTA", "fused")
    assert ops.gated_delta_path(mx.cpu)[0] == "fused"
    assert ops.gated_delta_path(mx.gpu)[0] == ("fused" if ops._ext.HAS_METAL else "mlx-lm")
    monkeypatch.setenv("VLLM_METAL_GATED_DELTA", "fast")
    with pytest.raises(ValueError, match="VLLM_METAL_GATED_DELTA='fast'"):
        ops.gated_delta_path(mx.cpu)
