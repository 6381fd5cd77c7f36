"""The CPU paged-attention kernel's verify tiles against float64 numpy.

Speculative decoding's verify rows are 2..8 new tokens per sequence (the last
token plus k drafts) against a paged cache; csrc/cpu/paged_attention_tiles.h
gives them their own entries (kVerifyTiles: tokens per tile and KV heads per
unit, per head-dim class and batch class). These check every entry's shape
-- head dims 64, 128, 256 and 512, sliding window on and off, batch 1 (the
small-batch entry, key partitions split into units) and 32 (the large-batch
entry) -- against tests/numpy_reference.py's float64 definition, and that no
tile (the table's or any the benchmark hook forces) changes a row's bits: a
sequence alone (batch 1) and inside a batch of 32 runs different entries and
gets the same bits.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from numpy_reference import make_batch, paged_attention_f64

from vllm_metal.native import ops

# head_dim -> (num_heads, num_kv_heads): groups 3, 4, 4 and 8, as in the
# benchmark's shapes (bench_paged_attention.py SHAPE_HEADS), fewer heads.
HEADS = {64: (6, 2), 128: (8, 2), 256: (4, 1), 512: (8, 1)}
WINDOW = 37  # a window shorter than the contexts: rows see different first keys
# Forced tiles: (tokens per tile: 8 is all of them, KV heads per unit: 1 or all).
FORCED = [(1, 1), (2, 2), (4, 1), (8, 2)]


def verify_batch(rng, head_dim, batch, long=False):
    """`batch` sequences of 2..8 new tokens each; contexts short (fast), one
    long enough (`long`) to cross the kernel's 512-key partitions."""
    new = rng.integers(2, 9, size=batch).tolist()
    ctx = [n + int(rng.integers(0, 120)) for n in new]
    if long:
        ctx[0] = 1100
    heads, kv_heads = HEADS[head_dim]
    b = make_batch(rng, new_tokens=new, context_lens=ctx, num_heads=heads, num_kv_heads=kv_heads,
                   head_dim=head_dim, block_size=16)
    args = tuple(mx.array(x) for x in (b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                                       b.cu_seqlens_q))
    return b, args


def expected_of(b, window):
    return paged_attention_f64(b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.cu_seqlens_q,
                               b.scale, window)


@pytest.fixture(autouse=True)
def _table_restored():
    yield
    ops._ext.set_cpu_tile_override()


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("head_dim", sorted(HEADS))
def test_verify_rows_match_float64(rng, head_dim, batch, window):
    b, args = verify_batch(rng, head_dim, batch, long=batch == 1)
    out = np.array(ops.paged_attention(*args, scale=b.scale, sliding_window=window))
    np.testing.assert_allclose(out, expected_of(b, window), atol=2e-5, rtol=1e-4)
    # Every forced tile: the same bits as the table's.
    for tokens, kv_heads in FORCED:
        ops._ext.set_cpu_tile_override(verify_tokens=tokens, verify_kv_heads=kv_heads)
        again = np.array(ops.paged_attention(*args, scale=b.scale, sliding_window=window))
        assert np.array_equal(again, out), (tokens, kv_heads)
    ops._ext.set_cpu_tile_override()


@pytest.mark.parametrize("head_dim,window", [(64, None), (128, WINDOW), (256, None), (512, WINDOW)])
def test_a_sequence_alone_and_in_a_batch_of_32_gets_the_same_bits(rng, head_dim, window):
    """Batch 1 and batch 32 are different entries of the table (and batch 1
    splits key partitions into units of their own): the same bits."""
    b, args = verify_batch(rng, head_dim, 32)
    q, kc, vc, bt, sl, cu = args
    out = np.array(ops.paged_attention(*args, scale=b.scale, sliding_window=window))
    np.testing.assert_allclose(out, expected_of(b, window), atol=2e-5, rtol=1e-4)
    for s in (0, 13, 31):
        t0, t1 = int(b.cu_seqlens_q[s]), int(b.cu_seqlens_q[s + 1])
        alone = ops.paged_attention(q[t0:t1], kc, vc, bt[s:s + 1], sl[s:s + 1], mx.array([0, t1 - t0], mx.int32),
                                    scale=b.scale, sliding_window=window)
        assert np.array_equal(np.array(alone), out[t0:t1]), s


def test_mixed_batch_keeps_verify_decode_and_prefill_rows_right(rng):
    """A verify tile over all KV heads next to decode and prefill sequences
    (the other classes' tiles unchanged), forced and by the table."""
    new = [5, 1, 40, 8, 2, 1, 3, 7, 1, 6]
    ctx = [60, 30, 90, 8, 700, 2, 3, 19, 600, 50]
    b = make_batch(rng, new_tokens=new, context_lens=ctx, num_heads=8, num_kv_heads=4, head_dim=64,
                   block_size=16)
    args = tuple(mx.array(x) for x in (b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                                       b.cu_seqlens_q))
    outs = []
    for tokens, kv_heads in itertools.chain([(0, 0)], FORCED):
        ops._ext.set_cpu_tile_override(verify_tokens=tokens, verify_kv_heads=kv_heads)
        outs.append(np.array(ops.paged_attention(*args, scale=b.scale, softcap=30.0)))
    expected = paged_attention_f64(b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.cu_seqlens_q,
                                   b.scale, None, 30.0)
    np.testing.assert_allclose(outs[0], expected, atol=2e-5, rtol=1e-4)
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])
