"""8-bit float KV caches (vllm_metal/native/kv_quant.py, the paged-attention
primitive's cache_format): the encoding against an independent float64
implementation of the two formats' rounding, and attention over 8-bit caches
against the float64 definition on the decoded values."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from array_helpers import TOLERANCE, to_mx, to_np
from numpy_reference import batch_lengths, make_batch, paged_attention_f64

from vllm_metal.native import kv_quant, ops

FORMATS = ("fp8_e4m3", "fp8_e5m2")


def _grid(fmt: str) -> np.ndarray:
    """Every finite value of the format, ascending (float64), from its definition."""
    exp_bits, man_bits, bias = (4, 3, 7) if fmt == "fp8_e4m3" else (5, 2, 15)
    values = set()
    for e in range(1 << exp_bits):
        for m in range(1 << man_bits):
            if fmt == "fp8_e4m3" and e == 15 and m == 7:
                continue  # NaN in E4M3 "fn"
            if fmt == "fp8_e5m2" and e == 31:
                continue  # inf / NaN
            v = (m / (1 << man_bits)) * 2.0 ** (1 - bias) if e == 0 else (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
            values.update((v, -v))
    return np.array(sorted(values))


def _round_f64(x: np.ndarray, fmt: str) -> np.ndarray:
    """Round to nearest representable (ties to the even bit pattern), saturating."""
    grid = _grid(fmt)
    x = np.clip(x, grid[0], grid[-1])
    i = np.clip(np.searchsorted(grid, x), 1, len(grid) - 1)
    lo, hi = grid[i - 1], grid[i]
    pick_hi = (hi - x < x - lo)
    tie = (hi - x == x - lo)
    # ties: the value whose mantissa is even (its index in the non-negative grid parity)
    even_hi = (np.searchsorted(_grid(fmt)[_grid(fmt) >= 0], np.abs(hi)) % 2 == 0)
    return np.where(pick_hi | (tie & even_hi), hi, lo)


@pytest.mark.parametrize("fmt", FORMATS)
def test_encode_rounds_like_the_format_definition(fmt, rng):
    grid = _grid(fmt)
    mids = (grid[1:] + grid[:-1]) / 2  # every tie
    x = np.concatenate([grid, mids, rng.standard_normal(4000) * 30, [1e6, -1e6, 0.0]])
    got = np.array(kv_quant.decode(kv_quant.encode(mx.array(x.astype(np.float32)), fmt), fmt))
    want = _round_f64(x.astype(np.float32).astype(np.float64), fmt)
    np.testing.assert_array_equal(got, want)
    scaled = np.array(kv_quant.decode(kv_quant.encode(mx.array(x[:100].astype(np.float32)), fmt, 4.0), fmt,
                                      scale=4.0))
    np.testing.assert_array_equal(scaled, 4.0 * _round_f64(x[:100] / 4.0, fmt))


def test_per_token_head_rows_carry_their_scale(rng):
    """fp8_per_token_head: each row's absmax becomes E4M3's 448; the row
    decodes to its codes times its float32 scale (the 4 bytes after them)."""
    x = rng.standard_normal((5, 3, 64)).astype(np.float32) * rng.uniform(1e-4, 1e3, (5, 3, 1)).astype(np.float32)
    enc = np.array(kv_quant.encode(mx.array(x), "fp8_per_token_head"))
    assert enc.shape == (5, 3, 68) and enc.dtype == np.uint8
    scale = enc[..., 64:].copy().view(np.float32)[..., 0]
    np.testing.assert_allclose(scale, np.abs(x).max(-1) / 448, rtol=1e-6)
    codes = np.array(kv_quant.decode(mx.array(enc[..., :64]), "fp8_e4m3"))
    want = _round_f64(x.astype(np.float64) / scale[..., None].astype(np.float32), "fp8_e4m3")
    np.testing.assert_array_equal(codes, want)
    got = np.array(kv_quant.decode(mx.array(enc), "fp8_per_token_head"))
    np.testing.assert_array_equal(got, codes * scale[..., None])
    assert (np.abs(got - x) <= np.abs(x).max(-1, keepdims=True) / 16 + 1e-30).all()  # 3 mantissa bits, any range


@pytest.mark.parametrize("fmt,dtype,kind", list(itertools.product(FORMATS + ("fp8_per_token_head",),
                                                                  ("float32", "float16", "bfloat16"),
                                                                  ("decode", "prefill", "mixed"))))
def test_attention_over_8bit_caches(fmt, dtype, kind, rng):
    block_size, head_dim = 16, 64
    new, ctx = batch_lengths(rng, kind, block_size)
    b = make_batch(rng, new_tokens=new, context_lens=ctx, num_heads=8, num_kv_heads=2, head_dim=head_dim,
                   block_size=block_size)
    k_scale, v_scale = 0.5, 2.0
    kc = kv_quant.encode(mx.array(b.key_cache), fmt, k_scale)
    vc = kv_quant.encode(mx.array(b.value_cache), fmt, v_scale)
    q = to_mx(b.q, dtype)
    args = (q, kc, vc, mx.array(b.block_tables), mx.array(b.seq_lens), mx.array(b.cu_seqlens_q))
    kwargs = dict(scale=b.scale, kv_cache_dtype=fmt, k_scale=k_scale, v_scale=v_scale)
    out = ops.paged_attention(*args, **kwargs)
    ref = ops.paged_attention_reference(*args, **kwargs)
    # float64 on the values the caches hold
    k_vals = np.array(kv_quant.decode(kc, fmt)).astype(np.float64) * k_scale
    v_vals = np.array(kv_quant.decode(vc, fmt)).astype(np.float64) * v_scale
    expected = paged_attention_f64(to_np(q), k_vals, v_vals, b.block_tables, b.seq_lens, b.cu_seqlens_q, b.scale)
    atol, rtol = TOLERANCE[dtype]
    assert out.dtype == q.dtype
    np.testing.assert_allclose(to_np(out), expected, atol=atol * 2, rtol=rtol)
    np.testing.assert_allclose(to_np(ref), expected, atol=atol * 2, rtol=rtol)
    # and the 8-bit cache is close to the float one it was made from
    exact = paged_attention_f64(to_np(q), b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.cu_seqlens_q,
                                b.scale)
    assert np.abs(to_np(out) - exact).max() < {"fp8_e4m3": 0.15, "fp8_e5m2": 0.3, "fp8_per_token_head": 0.15}[fmt]


def test_write_kv_encodes_into_8bit_caches(rng):
    kc = mx.zeros((4, 16, 2, 64), mx.uint8)
    vc = mx.zeros((4, 16, 2, 64), mx.uint8)
    k = mx.array(rng.standard_normal((5, 2, 64)).astype(np.float32))
    v = mx.array(rng.standard_normal((5, 2, 64)).astype(np.float32))
    slots = np.array([3, 17, -1, 40, 63])
    kc2, vc2 = ops.write_kv(kc, vc, k, v, slots, kv_cache_dtype="fp8", k_scale=0.25, v_scale=1.0)
    assert kc2.dtype == mx.uint8
    flat_k = np.array(kv_quant.decode(kc2.reshape(64, 2, 64), "fp8", scale=0.25))
    for i, slot in enumerate(slots):
        if slot >= 0:
            np.testing.assert_array_equal(flat_k[slot], np.array(kv_quant.decode(kv_quant.encode(k[i], "fp8", 0.25),
                                                                                 "fp8", scale=0.25)))
    with pytest.raises(ValueError, match="needs uint8 caches"):
        ops.write_kv(mx.zeros((4, 16, 2, 64)), mx.zeros((4, 16, 2, 64)), k, v, slots, kv_cache_dtype="fp8")


def test_refusals():
    q = mx.zeros((1, 2, 64))
    kc = mx.zeros((2, 16, 2, 64), mx.uint8)
    args = (mx.array([[0]]), mx.array([1]), mx.array([0, 1]))
    with pytest.raises(ValueError, match="must be uint8 .*cache_format 1"):
        ops.paged_attention(q, mx.zeros((2, 16, 2, 64)), mx.zeros((2, 16, 2, 64)), *args, scale=1.0,
                            kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="does not match q dtype"):
        ops.paged_attention(q, kc, kc, *args, scale=1.0)
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not served"):
        ops.paged_attention(q, kc, kc, *args, scale=1.0, kv_cache_dtype="int8")
