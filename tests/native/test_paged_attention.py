"""ops.paged_attention against an independent float64 numpy reference.

The matrix covers GQA ratios 1/2/4/8, block sizes 8/16/32, head dims
64/80/128/256, float32/float16/bfloat16, physically permuted blocks, context
lengths that are not block multiples, decode/prefill/mixed batches, sliding
window and softcap, plus long contexts that cross the CPU kernel's key
partitions (split across threads, and merged in place).
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from array_helpers import TOLERANCE, to_mx, to_np
from numpy_reference import batch_lengths, make_batch, paged_attention_f64

from vllm_metal.native import ops

GQA = (1, 2, 4, 8)
HEAD_DIMS = (64, 80, 128, 256)
DTYPES = ("float32", "float16", "bfloat16")
BLOCK_SIZES = (8, 16, 32)
KINDS = ("decode", "prefill", "mixed")

# Every (gqa, head_dim, dtype) once; block size, batch kind, window and softcap
# rotate so that each value meets every dtype.
CASES = [
    (gqa, hd, dt, BLOCK_SIZES[i % 3], KINDS[(i // 3) % 3], (None, 13)[i % 2], (None, 20.0)[(i // 2) % 2])
    for i, (gqa, hd, dt) in enumerate(itertools.product(GQA, HEAD_DIMS, DTYPES))
]


def run_case(rng, *, gqa, head_dim, dtype, block_size, new_tokens, context_lens,
             sliding_window=None, softcap=None, num_kv_heads=2):
    np_dtype = np.float16 if dtype == "float16" else np.float32
    b = make_batch(rng, new_tokens=new_tokens, context_lens=context_lens,
                   num_heads=gqa * num_kv_heads, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, block_size=block_size, dtype=np_dtype)
    q, kc, vc = (to_mx(x, dtype) for x in (b.q, b.key_cache, b.value_cache))
    args = (q, kc, vc, mx.array(b.block_tables), mx.array(b.seq_lens), mx.array(b.cu_seqlens_q))
    kwargs = dict(scale=b.scale, sliding_window=sliding_window, softcap=softcap)
    out = ops.paged_attention(*args, **kwargs)
    ref = ops.paged_attention_reference(*args, **kwargs)
    mx.eval(out, ref)
    # The oracle sees exactly the values stored (after bf16/f16 rounding).
    expected = paged_attention_f64(to_np(q), to_np(kc), to_np(vc), b.block_tables, b.seq_lens,
                                   b.cu_seqlens_q, b.scale, sliding_window, softcap)
    return args, kwargs, out, ref, expected


@pytest.mark.parametrize("gqa,head_dim,dtype,block_size,kind,window,softcap", CASES)
def test_matches_float64_reference(rng, gqa, head_dim, dtype, block_size, kind, window, softcap):
    new, ctx = batch_lengths(rng, kind, block_size)
    args, kwargs, out, ref, expected = run_case(
        rng, gqa=gqa, head_dim=head_dim, dtype=dtype, block_size=block_size,
        new_tokens=new, context_lens=ctx, sliding_window=window, softcap=softcap)
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    atol, rtol = TOLERANCE[dtype]
    np.testing.assert_allclose(to_np(out), expected, atol=atol, rtol=rtol)
    # The plain-MLX reference agrees with the primitive and the oracle.
    np.testing.assert_allclose(to_np(ref), expected, atol=atol, rtol=rtol)
    np.testing.assert_allclose(to_np(out), to_np(ref), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["decode_split", "mixed_long"])
def test_long_context_partitions(rng, dtype, layout):
    # decode_split: few sequences, so partitions run as parallel units whose
    # partials are merged afterwards. mixed_long: enough units that partitions
    # are merged in place inside each unit.
    if layout == "decode_split":
        new, ctx = [1], [3000]
    else:
        new, ctx = [1, 1, 40, 1, 1, 1], [2100, 1500, 2600, 30, 1025, 1024]
    _, _, out, _, expected = run_case(rng, gqa=4, head_dim=64, dtype=dtype, block_size=16,
                                      new_tokens=new, context_lens=ctx, sliding_window=None)
    atol, rtol = TOLERANCE[dtype]
    np.testing.assert_allclose(to_np(out), expected, atol=atol, rtol=rtol)


def test_window_crossing_partitions(rng):
    _, _, out, _, expected = run_case(rng, gqa=2, head_dim=64, dtype="float32", block_size=32,
                                      new_tokens=[3, 1], context_lens=[2050, 1030],
                                      sliding_window=700, softcap=30.0)
    np.testing.assert_allclose(to_np(out), expected, atol=2e-5, rtol=1e-4)


def test_bit_identical_run_to_run(rng):
    new, ctx = batch_lengths(rng, "mixed", 16)
    args, kwargs, out, _, _ = run_case(rng, gqa=4, head_dim=128, dtype="bfloat16", block_size=16,
                                       new_tokens=new, context_lens=ctx)
    first = np.array(out.view(mx.uint16))
    for _ in range(3):
        again = ops.paged_attention(*args, **kwargs)
        assert np.array_equal(np.array(again.view(mx.uint16)), first)


def test_batch_invariant(rng):
    # A sequence's rows do not depend on what else is in the batch.
    args, kwargs, out, _, _ = run_case(rng, gqa=2, head_dim=64, dtype="float32", block_size=16,
                                       new_tokens=[1, 7, 1], context_lens=[1500, 7, 90])
    q, kc, vc, bt, sl, cu = args
    alone = ops.paged_attention(q[1:8], kc, vc, bt[1:2], sl[1:2], mx.array([0, 7], mx.int32), **kwargs)
    assert np.array_equal(np.array(alone), np.array(out[1:8]))
    alone = ops.paged_attention(q[0:1], kc, vc, bt[0:1], sl[0:1], mx.array([0, 1], mx.int32), **kwargs)
    assert np.array_equal(np.array(alone), np.array(out[0:1]))


def test_decode_units_over_all_kv_heads_keep_the_bits(rng):
    """With enough sequences to occupy the cores, a decode sequence's KV heads run
    in one unit (its blocks read for every head in one pass); alone, one unit per
    KV head (and key partition). The same bits either way, and float64's values."""
    new = [1, 1, 1, 1, 1, 1, 9]
    ctx = [1300, 40, 1, 700, 16, 515, 60]
    args, kwargs, out, _, expected = run_case(rng, gqa=3, head_dim=64, dtype="float32", block_size=16,
                                              new_tokens=new, context_lens=ctx, num_kv_heads=3, softcap=30.0)
    np.testing.assert_allclose(np.array(out), expected, rtol=1e-4, atol=2e-5)
    q, kc, vc, bt, sl, cu = args
    for s in range(6):
        alone = ops.paged_attention(q[s:s + 1], kc, vc, bt[s:s + 1], sl[s:s + 1], mx.array([0, 1], mx.int32),
                                    **kwargs)
        assert np.array_equal(np.array(alone), np.array(out[s:s + 1])), s


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3", "fp8_per_token_head"])
def test_decode_units_load_heads_in_groups(rng, fmt):
    """A decode unit over all KV heads loads a step's keys and values for up
    to three heads of 64 at a time (the kernel's slots), block by block, then
    scores each: eight KV heads go 3 + 3 + 2. Float64's values, and each row
    the bits it gets alone (one unit per KV head), with float and 8-bit caches
    (whose values are converted into each slot's own rows)."""
    from vllm_metal.native import kv_quant

    new, ctx = [1] * 6, [700, 130, 1, 515, 48, 1290]
    b = make_batch(rng, new_tokens=new, context_lens=ctx, num_heads=16, num_kv_heads=8, head_dim=64,
                   block_size=16, dtype=np.float32)
    kc, vc = mx.array(b.key_cache), mx.array(b.value_cache)
    kwargs = dict(scale=b.scale)
    k_vals, v_vals = b.key_cache.astype(np.float64), b.value_cache.astype(np.float64)
    if fmt is not None:
        kc, vc = kv_quant.encode(kc, fmt, 0.5), kv_quant.encode(vc, fmt, 2.0)
        kwargs.update(kv_cache_dtype=fmt, k_scale=0.5, v_scale=2.0)
        k_vals = np.array(kv_quant.decode(kc, fmt)).astype(np.float64) * 0.5
        v_vals = np.array(kv_quant.decode(vc, fmt)).astype(np.float64) * 2.0
    q, bt, sl = mx.array(b.q), mx.array(b.block_tables), mx.array(b.seq_lens)
    out = np.array(ops.paged_attention(q, kc, vc, bt, sl, mx.array(b.cu_seqlens_q), **kwargs))
    expected = paged_attention_f64(b.q, k_vals, v_vals, b.block_tables, b.seq_lens, b.cu_seqlens_q, b.scale)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=2e-5)
    for s in range(len(new)):
        alone = ops.paged_attention(q[s:s + 1], kc, vc, bt[s:s + 1], sl[s:s + 1], mx.array([0, 1], mx.int32),
                                    **kwargs)
        assert np.array_equal(np.array(alone), out[s:s + 1]), s


_THREADS_SCRIPT = r"""
import sys, numpy as np, mlx.core as mx
sys.path.insert(0, {tests!r})
from numpy_reference import make_batch, paged_attention_f64
from vllm_metal.native import ops
ctx = [515, 1024, 1300, 2100, 2048, 40, 700, 9]
b = make_batch(np.random.default_rng(5), new_tokens=[1] * 8, context_lens=ctx, num_heads=9, num_kv_heads=3,
               head_dim=64, block_size=16, dtype=np.float32)
q, kc, vc, bt, sl, cu = (mx.array(x) for x in (b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                                               b.cu_seqlens_q))
kw = dict(scale=b.scale, softcap=30.0)
out = np.array(ops.paged_attention(q, kc, vc, bt, sl, cu, **kw))
expected = paged_attention_f64(b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.cu_seqlens_q,
                               b.scale, None, 30.0)
np.testing.assert_allclose(out, expected, rtol=1e-4, atol=2e-5)
for s in range(5):
    alone = np.array(ops.paged_attention(q[s:s + 1], kc, vc, bt[s:s + 1], sl[s:s + 1],
                                         mx.array([0, 1], mx.int32), **kw))
    assert np.array_equal(alone, out[s:s + 1]), (s, ctx[s])
    pair = np.array(ops.paged_attention(q[s:s + 2], kc, vc, bt[s:s + 2], sl[s:s + 2],
                                        mx.array([0, 1, 2], mx.int32), **kw))
    assert np.array_equal(pair, out[s:s + 2]), (s, ctx[s])
print("ok")
"""


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_decode_partitions_keep_the_bits_at_every_thread_count(threads):
    """One or two long decode sequences have their keys split into partitions
    (512 keys) that run as units of their own and are merged afterwards: per
    KV head, or, with a number of partitions the threads share evenly, one
    unit per partition over all KV heads. Which way depends on the thread
    count (fixed per process: a subprocess each); each row gets the same bits
    as in an 8-sequence batch (one unit per sequence) and float64's values."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = _THREADS_SCRIPT.format(tests=str(Path(__file__).resolve().parents[1]))
    env = {**os.environ, "VLLM_METAL_CPU_THREADS": str(threads)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.parametrize("head_dim", [64, 256])
def test_tiles_never_change_the_bits(rng, head_dim):
    """The CPU kernel's rows per tile (the shape-class table, or any override)
    are a speed choice only: a prefill's rows, and a decode row that sees the
    same keys, get the same bits whatever the tiling (the same FMAs in the
    same order per row), and they agree with float64."""
    args, kwargs, out, _, expected = run_case(rng, gqa=3, head_dim=head_dim, dtype="float32", block_size=16,
                                              new_tokens=[300, 1], context_lens=[700, 700],
                                              sliding_window=500, softcap=40.0)
    np.testing.assert_allclose(to_np(out), expected, atol=2e-5, rtol=1e-4)
    try:
        for rows in (3, 16, 48, 256):
            ops._ext.set_cpu_tile_override(rows)
            again = ops.paged_attention(*args, **kwargs)
            assert np.array_equal(np.array(again), np.array(out)), f"rows per tile {rows}"
    finally:
        ops._ext.set_cpu_tile_override(0)
    # The prefill's last token again, alone, as a decode step (the decode class, one-token
    # tiles): the same bits.
    q, kc, vc, bt, sl, cu = args
    last = ops.paged_attention(q[299:300], kc, vc, bt[0:1], sl[0:1], mx.array([0, 1], mx.int32), **kwargs)
    assert np.array_equal(np.array(last), np.array(out[299:300]))


def test_strided_inputs(rng):
    # Lazy inputs may be views with arbitrary strides; the kernel reads strides.
    args, kwargs, out, _, expected = run_case(rng, gqa=2, head_dim=64, dtype="float32",
                                              block_size=8, new_tokens=[3, 1], context_lens=[20, 9])
    q, kc, vc, bt, sl, cu = args
    q_t = mx.array(np.ascontiguousarray(np.array(q).transpose(1, 0, 2))).transpose(1, 0, 2)
    kc_t = mx.array(np.ascontiguousarray(np.array(kc).transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    strided = ops.paged_attention(q_t, kc_t, vc, bt, sl, cu, **kwargs)
    assert np.array_equal(np.array(strided), np.array(out))


def test_zero_new_tokens_and_empty_batch(rng):
    # A sequence with no new tokens contributes no rows; an empty batch is fine.
    _, _, out, _, expected = run_case(rng, gqa=1, head_dim=64, dtype="float32", block_size=8,
                                      new_tokens=[2, 0, 1], context_lens=[5, 9, 3])
    np.testing.assert_allclose(to_np(out), expected, atol=2e-5, rtol=1e-4)
    kc = mx.zeros((4, 8, 1, 64))
    empty = ops.paged_attention(mx.zeros((0, 1, 64)), kc, kc, mx.zeros((0, 2), mx.int32),
                                mx.zeros((0,), mx.int32), mx.zeros((1,), mx.int32), scale=0.125)
    assert empty.shape == (0, 1, 64)
    mx.eval(empty)


def test_is_lazy(rng):
    # Building the op computes nothing: a bad block id only surfaces at eval.
    kc = mx.zeros((2, 8, 1, 64))
    out = ops.paged_attention(mx.zeros((1, 1, 64)), kc, kc, mx.array([[5]], mx.int32),
                              mx.array([1], mx.int32), mx.array([0, 1], mx.int32), scale=0.125)
    with pytest.raises(RuntimeError, match=r"block_tables\[0, 0\] = 5 is out of range"):
        mx.eval(out)


def test_native_path_on_cpu():
    assert ops.attention_path(mx.cpu)[0] == "cpu"


@pytest.mark.parametrize("window", [None, 1, 7, 300])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_causal(rng, dtype, window):
    """causal=False (encoders): every query row sees all keys of its sequence
    (within `window` on both sides) -- whole prompts, a chunk whose keys come
    before and after it, and one long enough to split into key partitions --
    against the float64 definition and the plain-MLX reference; the causal
    result differs wherever a row has keys after it."""
    new, ctx = [5, 17, 40, 530, 3], [5, 17, 60, 530, 9]
    b = make_batch(rng, new_tokens=new, context_lens=ctx, num_heads=8, num_kv_heads=2, head_dim=64,
                   block_size=16, dtype=np.float32)
    q, kc, vc = (to_mx(x, dtype) for x in (b.q, b.key_cache, b.value_cache))
    args = (q, kc, vc, mx.array(b.block_tables), mx.array(b.seq_lens), mx.array(b.cu_seqlens_q))
    out = ops.paged_attention(*args, scale=b.scale, sliding_window=window, causal=False)
    ref = ops.paged_attention_reference(*args, scale=b.scale, sliding_window=window, causal=False)
    expected = paged_attention_f64(to_np(q), to_np(kc), to_np(vc), b.block_tables, b.seq_lens, b.cu_seqlens_q,
                                   b.scale, window, causal=False)
    atol, rtol = TOLERANCE[dtype]
    np.testing.assert_allclose(to_np(out), expected, atol=atol, rtol=rtol)
    np.testing.assert_allclose(to_np(ref), expected, atol=atol, rtol=rtol)
    causal = paged_attention_f64(to_np(q), to_np(kc), to_np(vc), b.block_tables, b.seq_lens, b.cu_seqlens_q,
                                 b.scale, window)
    if window != 1:  # a window of 1 sees only the row itself either way
        assert np.abs(causal - expected).max() > 1e-2
    # batch invariance holds without the causal mask too: one sequence alone, the same bits
    alone = ops.paged_attention(q[22:62], kc, vc, mx.array(b.block_tables[2:3]), mx.array(b.seq_lens[2:3]),
                                mx.array([0, 40], dtype=mx.int32), scale=b.scale, sliding_window=window,
                                causal=False)
    assert np.array_equal(to_np(alone), to_np(out)[22:62])
