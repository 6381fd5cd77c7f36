"""ops.rope_write_kv: RoPE of q and k and the K/V cache write as one
primitive on MLX's CPU device. Against the separate operations it replaces
(ops.rope, then ops.write_kv: the same bits) and float64 numpy, in every
dtype and input layout; the caches written in place when nothing else holds
them; bad input refused with the problem named."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_norm_rope import TOLERANCE, f64, random_table, rope_reference
from test_write_kv import expected_after, random_cache

from vllm_metal.native import ops

address = ops._ext.buffer_address
H, KV, D = 5, 2, 32  # random_cache's [16, 8, 2, 32]: 128 slots


def qkv_views(rng, tokens, dtype, layout):
    """q [tokens, H, D], k and v [tokens, KV, D] in the layout a model gives them."""
    if layout == "fused_columns":  # column slices of one q/k/v product, read in place
        qkv = mx.array(rng.standard_normal((tokens, (H + 2 * KV) * D)).astype(np.float32)).astype(dtype)
        q, k, v = mx.split(qkv, [H * D, (H + KV) * D], axis=-1)
        return q.reshape(tokens, H, D), k.reshape(tokens, KV, D), v.reshape(tokens, KV, D)
    if layout == "heads_major":  # [heads, tokens, dim] storage seen through a transpose
        arrays = [mx.array(rng.standard_normal((n, tokens, D)).astype(np.float32)).astype(dtype).transpose(1, 0, 2)
                  for n in (H, KV, KV)]
        return tuple(arrays)
    return tuple(mx.array(rng.standard_normal((tokens, n, D)).astype(np.float32)).astype(dtype) for n in (H, KV, KV))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("rotated", [D, 16])
@pytest.mark.parametrize("layout", ["contiguous", "fused_columns", "heads_major"])
@pytest.mark.parametrize("slots", [[5, 17, 127, 0], [5, -1, 17, -1], [-1, -1], []])
def test_same_bits_as_rope_then_write_kv(rng, dtype, traditional, rotated, layout, slots):
    q, k, v = qkv_views(rng, len(slots), dtype, layout)
    table = random_table(rng, len(slots), rotated // 2, scale=1.2)
    kc, vc = random_cache(rng, dtype=dtype)
    mx.eval(q, k, v, table)
    want_q = ops.rope(q, table, traditional=traditional)
    want_kc, want_vc = ops.write_kv(mx.array(kc), mx.array(vc), ops.rope(k, table, traditional=traditional), v,
                                    slots)
    got_q, got_kc, got_vc = ops.rope_write_kv(q, k, v, table, mx.array(kc), mx.array(vc), slots,
                                              traditional=traditional)
    mx.eval(want_q, want_kc, want_vc, got_q, got_kc, got_vc)
    for want, got in ((want_q, got_q), (want_kc, got_kc), (want_vc, got_vc)):
        assert got.dtype == dtype and got.shape == want.shape
        assert mx.array_equal(got, want).item()
    # And the numbers themselves: float64 RoPE, values copied exactly.
    atol, rtol = TOLERANCE[dtype]
    if slots:
        np.testing.assert_allclose(f64(got_q), rope_reference(q, table, traditional), atol=atol * 4, rtol=rtol)
    k_rot = rope_reference(k, table, traditional) if slots else np.zeros((0, KV, D))
    np.testing.assert_allclose(f64(got_kc), expected_after(f64(kc), k_rot, slots), atol=atol * 4, rtol=rtol)
    assert np.array_equal(f64(got_vc), expected_after(f64(vc), f64(v) if slots else np.zeros((0, KV, D)), slots))


def test_many_tokens_split_over_threads(rng):
    tokens = 700  # more than one task of the kernel's thread pool
    q, k, v = qkv_views(rng, tokens, mx.float32, "fused_columns")
    kc, vc = random_cache(rng, shape=(64, 16, KV, D))
    slots = rng.permutation(1024)[:tokens]
    table = random_table(rng, tokens, D // 2)
    got = ops.rope_write_kv(q, k, v, table, mx.array(kc), mx.array(vc), slots)
    want_kc, want_vc = ops.write_kv(mx.array(kc), mx.array(vc), ops.rope(k, table), v, slots)
    mx.eval(*got, want_kc, want_vc)
    assert mx.array_equal(got[0], ops.rope(q, table)).item()
    assert mx.array_equal(got[1], want_kc).item() and mx.array_equal(got[2], want_vc).item()


def test_caches_written_in_place_without_peak_growth(rng):
    kc, vc = random_cache(rng, shape=(256, 16, KV, D))  # 2 MiB each
    k_addr, v_addr = address(kc), address(vc)
    q, k, v = qkv_views(rng, 3, mx.float32, "fused_columns")
    table = random_table(rng, 3, D // 2)
    mx.eval(q, k, v, table)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for step in range(5):
        _, kc, vc = ops.rope_write_kv(q, k, v, table, kc, vc, [step, 100 + step, -1])  # old refs dropped
        mx.eval(kc, vc)
    assert (address(kc), address(vc)) == (k_addr, v_addr), "cache buffers were copied"
    assert mx.get_peak_memory() - base < 1 << 20  # a copy of either cache would add 2 MiB


def test_a_kept_cache_is_not_clobbered(rng):
    kc, vc = random_cache(rng)
    old_k, old_v = np.array(kc), np.array(vc)
    q, k, v = qkv_views(rng, 2, mx.float32, "contiguous")
    _, kc2, vc2 = ops.rope_write_kv(q, k, v, random_table(rng, 2, D // 2), kc, vc, [3, 9])
    mx.eval(kc2, vc2)
    assert np.array_equal(np.array(kc), old_k) and np.array_equal(np.array(vc), old_v)
    assert address(kc2) != address(kc) and not np.array_equal(np.array(kc2), old_k)


def test_the_same_slot_mapping_serves_every_layer(rng):
    mapping = ops.SlotMapping(np.array([4, -1, 60]))
    q, k, v = qkv_views(rng, 3, mx.float32, "contiguous")
    table = random_table(rng, 3, D // 2)
    for _ in range(2):
        kc, vc = random_cache(rng)
        got = ops.rope_write_kv(q, k, v, table, kc, vc, mapping)
        want = ops.write_kv(kc, vc, ops.rope(k, table), v, mapping)
        mx.eval(*got, *want)
        assert mx.array_equal(got[1], want[0]).item() and mx.array_equal(got[2], want[1]).item()


BAD = {
    "q rank": (lambda a: {**a, "q": a["q"][0]}, r"q, k and v must be \[tokens, heads, dim\]"),
    "k tokens": (lambda a: {**a, "k": a["k"][:2], "v": a["v"][:2]}, r"k and v must be \[3, kv_heads, 32\]"),
    "v heads": (lambda a: {**a, "v": mx.zeros((3, 1, D))}, r"k and v must be \[3, kv_heads, 32\]"),
    "k dtype": (lambda a: {**a, "k": a["k"].astype(mx.float16)}, "k and v must have q's dtype"),
    "int q": (lambda a: {**a, "q": a["q"].astype(mx.int32), "k": a["k"].astype(mx.int32),
                         "v": a["v"].astype(mx.int32)}, "float32, float16 or bfloat16"),
    "table tokens": (lambda a: {**a, "table": mx.zeros((2, 16, 2))}, "table must be float32"),
    "table too wide": (lambda a: {**a, "table": mx.zeros((3, 17, 2))}, "rotated <= dim"),
    "table dtype": (lambda a: {**a, "table": mx.zeros((3, 16, 2), dtype=mx.float16)}, "table must be float32"),
    "cache heads": (lambda a: {**a, "key_cache": mx.zeros((16, 8, 3, D)), "value_cache": mx.zeros((16, 8, 3, D))},
                    r"key_cache must be \[num_blocks, block_size, 2, 32\]"),
    "cache rank": (lambda a: {**a, "key_cache": mx.zeros((128, 2, D))}, "key_cache must have rank 4"),
    "value cache": (lambda a: {**a, "value_cache": mx.zeros((8, 8, 2, D))}, "value_cache .* must match key_cache"),
    "cache dtype": (lambda a: {**a, "key_cache": a["key_cache"].astype(mx.float16),
                               "value_cache": a["value_cache"].astype(mx.float16)}, "both of q's dtype"),
    "slot too high": (lambda a: {**a, "slot_mapping": [1, 2, 128]}, r"slot_mapping\[2\] = 128 is outside \[-1, 128\)"),
    "slot below -1": (lambda a: {**a, "slot_mapping": [1, -2, 3]}, r"slot_mapping\[1\] = -2"),
    "slot count": (lambda a: {**a, "slot_mapping": [1, 2]}, r"slot_mapping must be \[num_tokens\] = \[3\]"),
    "float slots": (lambda a: {**a, "slot_mapping": [1.0, 2.0, 3.0]}, "slot_mapping must hold integers"),
    "lazy slots": (lambda a: {**a, "slot_mapping": mx.array([1, 2, 3]) + 1}, "must be known on the host"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_naming_the_problem(rng, case):
    kc, vc = random_cache(rng)
    q, k, v = qkv_views(rng, 3, mx.float32, "contiguous")
    args = dict(q=q, k=k, v=v, table=random_table(rng, 3, 16), key_cache=kc, value_cache=vc, slot_mapping=[1, 2, 3])
    change, message = BAD[case]
    before = np.array(kc)
    with pytest.raises(ValueError, match=message):
        ops.rope_write_kv(**change(args))
    assert np.array_equal(np.array(kc), before)  # nothing written


def test_non_arrays_are_refused():
    with pytest.raises(TypeError, match="q must be an mx.array"):
        ops.rope_write_kv(np.ones((1, H, D)), mx.ones((1, KV, D)), mx.ones((1, KV, D)), mx.ones((1, 16, 2)),
                          mx.zeros((2, 8, KV, D)), mx.zeros((2, 8, KV, D)), [0])
