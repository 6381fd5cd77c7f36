"""ops.paged_attention's attention sinks and value head size (v_head_dim),
against the float64 numpy oracle and, for sinks, against MLX's own
scaled_dot_product_attention(..., sinks=); with the head sizes of the served
families up to latent attention (MLA: one cache holding [kv_latent | k_rope]
per token, K = the whole row, V = its first kv_lora_rank entries).

Both the native primitive (CPU) and paged_attention_reference are checked.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from array_helpers import TOLERANCE, to_mx, to_np
from numpy_reference import batch_lengths, make_batch, paged_attention_f64

from vllm_metal.native import ops


def draw_sinks(rng, num_heads: int) -> np.ndarray:
    """Sinks around the scores' size, one that outweighs every key, one -inf (no sink)."""
    sinks = rng.normal(0.0, 2.0, num_heads).astype(np.float32)
    sinks[0] = 6.0
    if num_heads >= 3:
        sinks[-1] = -np.inf
    return sinks


def check(rng, *, dtype, head_dim, num_heads, num_kv_heads, block_size, new_tokens,
          context_lens, v_head_dim=None, shared_kv=False, value_head_dim=None, sinks=None,
          sliding_window=None, softcap=None):
    """Primitive and reference against the oracle; returns the primitive's output."""
    np_dtype = np.float16 if dtype == "float16" else np.float32
    b = make_batch(rng, new_tokens=new_tokens, context_lens=context_lens, num_heads=num_heads,
                   num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                   dtype=np_dtype, value_head_dim=value_head_dim)
    q, kc = to_mx(b.q, dtype), to_mx(b.key_cache, dtype)
    vc = kc if shared_kv else to_mx(b.value_cache, dtype)
    args = (q, kc, vc, mx.array(b.block_tables), mx.array(b.seq_lens), mx.array(b.cu_seqlens_q))
    kwargs = dict(scale=b.scale, sliding_window=sliding_window, softcap=softcap,
                  sinks=None if sinks is None else mx.array(sinks), v_head_dim=v_head_dim)
    out = ops.paged_attention(*args, **kwargs)
    ref = ops.paged_attention_reference(*args, **kwargs)
    mx.eval(out, ref)
    expected = paged_attention_f64(to_np(q), to_np(kc), to_np(vc), b.block_tables, b.seq_lens,
                                   b.cu_seqlens_q, b.scale, sliding_window, softcap, sinks,
                                   v_head_dim)
    dv = head_dim if v_head_dim is None else v_head_dim
    assert out.shape == (q.shape[0], num_heads, dv) and out.dtype == q.dtype
    assert ref.shape == out.shape and ref.dtype == q.dtype
    atol, rtol = TOLERANCE[dtype]
    np.testing.assert_allclose(to_np(out), expected, atol=atol, rtol=rtol)
    np.testing.assert_allclose(to_np(ref), expected, atol=atol, rtol=rtol)
    return args, kwargs, out


# ---- sinks -----------------------------------------------------------------

@pytest.mark.parametrize("new,ctx", [([9], [9]), ([5], [37]), ([1], [40])],
                         ids=["prefill", "chunked", "decode"])
def test_sinks_match_mlx_sdpa(rng, new, ctx):
    """MLX's own definition: the sink is one more logit, not scaled (a scale far
    from 1 tells) and without a value; its causal mask is aligned lower-right,
    like the paged positions."""
    num_heads, num_kv_heads, head_dim, scale = 6, 2, 32, 0.05
    b = make_batch(rng, new_tokens=new, context_lens=ctx, num_heads=num_heads,
                   num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=8)
    sinks = mx.array(draw_sinks(rng, num_heads))
    args = (mx.array(b.q), mx.array(b.key_cache), mx.array(b.value_cache),
            mx.array(b.block_tables), mx.array(b.seq_lens), mx.array(b.cu_seqlens_q))
    out = ops.paged_attention(*args, scale=scale, sinks=sinks)
    ref = ops.paged_attention_reference(*args, scale=scale, sinks=sinks)

    positions = np.arange(ctx[0])
    rows = b.block_tables[0][positions // 8], positions % 8
    k = mx.array(b.key_cache[rows].transpose(1, 0, 2)[None])    # [1, kv_heads, ctx, D]
    v = mx.array(b.value_cache[rows].transpose(1, 0, 2)[None])
    q = mx.array(b.q.transpose(1, 0, 2)[None])                   # [1, heads, new, D]
    sdpa = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal", sinks=sinks,
                                                stream=mx.cpu)
    expected = np.array(sdpa)[0].transpose(1, 0, 2)
    np.testing.assert_allclose(np.array(out), expected, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.array(ref), expected, atol=2e-6, rtol=1e-5)


# Each dtype once per batch kind, with window and softcap rotating in.
SINK_CASES = [
    ("float32", "decode", None, None),
    ("float16", "prefill", 13, 20.0),
    ("bfloat16", "mixed", None, 30.0),
    ("float32", "mixed", 7, 20.0),
    ("float16", "decode", 40, None),
]


@pytest.mark.parametrize("dtype,kind,window,softcap", SINK_CASES)
def test_sinks_match_float64_reference(rng, dtype, kind, window, softcap):
    new, ctx = batch_lengths(rng, kind, 16)
    check(rng, dtype=dtype, head_dim=64, num_heads=8, num_kv_heads=2, block_size=16,
          new_tokens=new, context_lens=ctx, sinks=draw_sinks(rng, 8), sliding_window=window,
          softcap=softcap)


@pytest.mark.parametrize("layout", ["decode_split", "mixed_long"])
def test_sinks_counted_once_across_partitions(rng, layout):
    """Long contexts reduced in several key partitions (split into parallel
    units, or merged in place): the sink joins each row once."""
    new, ctx = ([1], [3000]) if layout == "decode_split" else ([1, 40, 1], [2100, 2600, 1025])
    check(rng, dtype="float32", head_dim=64, num_heads=4, num_kv_heads=1, block_size=16,
          new_tokens=new, context_lens=ctx, sinks=draw_sinks(rng, 4), sliding_window=1500)


def test_no_sink_is_bit_identical_to_a_minus_inf_sink(rng):
    args, kwargs, out = check(rng, dtype="bfloat16", head_dim=64, num_heads=4, num_kv_heads=2,
                              block_size=16, new_tokens=[1, 12], context_lens=[1300, 20])
    minus_inf = ops.paged_attention(*args, **dict(kwargs, sinks=mx.full((4,), -mx.inf)))
    assert np.array_equal(np.array(minus_inf.view(mx.uint16)), np.array(out.view(mx.uint16)))


def test_sinks_are_lazy_graph_inputs(rng):
    """Sinks computed in the same graph (and in another dtype) are cast and
    consumed at evaluation, like any input."""
    args, kwargs, out = check(rng, dtype="float32", head_dim=32, num_heads=4, num_kv_heads=2,
                              block_size=8, new_tokens=[3], context_lens=[19],
                              sinks=draw_sinks(rng, 4))
    lazy = (kwargs["sinks"].astype(mx.bfloat16) * 2).astype(mx.float16) / 2
    again = ops.paged_attention(*args, **dict(kwargs, sinks=lazy))
    expected = ops.paged_attention(*args, **dict(kwargs, sinks=lazy.astype(mx.float32)))
    assert np.array_equal(np.array(again), np.array(expected))


# ---- value head size, shared K/V cache (MLA) --------------------------------

# (key head_dim, v_head_dim, shared cache, value row when not shared, dtype, kind)
HEAD_SIZE_CASES = [
    (48, 32, True, None, "float32", "mixed"),       # small MLA-shaped cache
    (48, 32, True, None, "float16", "prefill"),
    (48, 32, True, None, "bfloat16", "decode"),
    (576, 512, True, None, "bfloat16", "mixed"),    # deepseek: kv_lora_rank 512 + rope 64
    (576, 512, True, None, "float32", "decode"),
    (288, 256, True, None, "float16", "mixed"),     # minicpm3: 256 + 32
    (192, 128, False, None, "float32", "mixed"),    # separate, narrower values
    (64, 40, False, 48, "float16", "mixed"),        # values: a prefix of wider rows
    (192, None, False, None, "bfloat16", "prefill"),
    (96, None, False, None, "float32", "decode"),
]


@pytest.mark.parametrize("head_dim,v_head_dim,shared,value_row,dtype,kind", HEAD_SIZE_CASES)
def test_head_sizes_match_float64_reference(rng, head_dim, v_head_dim, shared, value_row, dtype,
                                            kind):
    if head_dim > 256:  # small token counts at the largest sizes
        new, ctx = ([1, 6, 1], [40, 30, 70]) if kind == "mixed" else ([1, 1], [50, 17])
    else:
        new, ctx = batch_lengths(rng, kind, 16)
    # Latent attention (shared cache): one kv head read by every query head.
    check(rng, dtype=dtype, head_dim=head_dim, num_heads=4, num_kv_heads=1 if shared else 2,
          block_size=16, new_tokens=new, context_lens=ctx, v_head_dim=v_head_dim,
          shared_kv=shared, value_head_dim=value_row or v_head_dim)


def test_mla_long_context_with_sinks(rng):
    """MLA shape, partitioned long-context decode and sinks together."""
    check(rng, dtype="float32", head_dim=576, num_heads=4, num_kv_heads=1, block_size=16,
          new_tokens=[1], context_lens=[2100], v_head_dim=512, shared_kv=True,
          sinks=draw_sinks(rng, 4))


def test_default_v_head_dim_is_bit_identical_to_explicit(rng):
    args, kwargs, out = check(rng, dtype="float16", head_dim=80, num_heads=4, num_kv_heads=2,
                              block_size=8, new_tokens=[2, 9], context_lens=[30, 9])
    explicit = ops.paged_attention(*args, **dict(kwargs, v_head_dim=80))
    assert np.array_equal(np.array(explicit), np.array(out))


def test_shared_cache_equals_separate_copy(rng):
    """Passing one array as both caches reads exactly what a separate value
    cache holding the first v_head_dim entries of each row would give."""
    args, kwargs, out = check(rng, dtype="bfloat16", head_dim=48, num_heads=2, num_kv_heads=1,
                              block_size=8, new_tokens=[1, 10], context_lens=[33, 12],
                              v_head_dim=32, shared_kv=True)
    q, kc, _, bt, sl, cu = args
    separate = mx.array(np.ascontiguousarray(np.array(kc[..., :32].astype(mx.float32)))
                        ).astype(mx.bfloat16)
    copy = ops.paged_attention(q, kc, separate, bt, sl, cu, **kwargs)
    assert np.array_equal(np.array(copy.view(mx.uint16)), np.array(out.view(mx.uint16)))
