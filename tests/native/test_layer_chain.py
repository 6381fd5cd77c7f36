"""A 28-layer write-then-read chain: one lazy graph equals per-layer eval, bit for bit.

Each layer projects the hidden state to q/k/v, writes k/v into its own paged
cache with ops.write_kv and attends through ops.paged_attention: the same
shape as a transformer step. Built lazily and evaluated once, it must give the
same bits as evaluating after every layer, and match a float64 numpy chain.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from numpy_reference import paged_attention_f64

from vllm_metal.native import ops

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 28, 4, 2, 32, 8
HIDDEN = HEADS * HEAD_DIM


def make_problem(rng):
    # Sequence 0: a fresh 5-token prefill. Sequence 1: one decode token at
    # position 19 whose first 19 positions are already cached.
    new_tokens, context = [5, 1], [5, 20]
    num_blocks = 8
    block_tables = np.array([[6, 0, -1], [3, 7, 1]], np.int32)
    slots = np.array([6 * BLOCK + i for i in range(5)] + [1 * BLOCK + 3], np.int64)
    w = lambda *shape: (rng.standard_normal(shape) * 0.5 / np.sqrt(HIDDEN)).astype(np.float32)  # noqa: E731
    return dict(
        x=rng.standard_normal((6, HIDDEN)).astype(np.float32),
        wq=w(LAYERS, HIDDEN, HIDDEN), wk=w(LAYERS, HIDDEN, KV_HEADS * HEAD_DIM),
        wv=w(LAYERS, HIDDEN, KV_HEADS * HEAD_DIM), wo=w(LAYERS, HIDDEN, HIDDEN),
        caches=rng.standard_normal((LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)).astype(np.float32),
        block_tables=block_tables, seq_lens=np.array(context, np.int32),
        cu_seqlens_q=np.array([0, 5, 6], np.int32), slots=slots,
    )


def run_mlx(p, eval_each_layer: bool):
    x = mx.array(p["x"])
    caches = [(mx.array(c[0]), mx.array(c[1])) for c in p["caches"]]
    bt, sl, cu = mx.array(p["block_tables"]), mx.array(p["seq_lens"]), mx.array(p["cu_seqlens_q"])
    n = x.shape[0]
    for layer in range(LAYERS):
        q = (x @ mx.array(p["wq"][layer])).reshape(n, HEADS, HEAD_DIM)
        k = (x @ mx.array(p["wk"][layer])).reshape(n, KV_HEADS, HEAD_DIM)
        v = (x @ mx.array(p["wv"][layer])).reshape(n, KV_HEADS, HEAD_DIM)
        kc, vc = ops.write_kv(*caches[layer], k, v, p["slots"])
        caches[layer] = (kc, vc)
        attn = ops.paged_attention(q, kc, vc, bt, sl, cu, scale=HEAD_DIM ** -0.5)
        x = x + attn.reshape(n, HIDDEN) @ mx.array(p["wo"][layer])
        if eval_each_layer:
            mx.eval(x, kc, vc)
    mx.eval(x, caches)
    return np.array(x), [np.array(c) for pair in caches for c in pair]


def run_numpy(p):
    x = p["x"].astype(np.float64)
    n = x.shape[0]
    for layer in range(LAYERS):
        kc, vc = (c.astype(np.float64).reshape(-1, KV_HEADS, HEAD_DIM) for c in p["caches"][layer])
        q = (x @ p["wq"][layer]).reshape(n, HEADS, HEAD_DIM)
        kc[p["slots"]] = (x @ p["wk"][layer]).reshape(n, KV_HEADS, HEAD_DIM)
        vc[p["slots"]] = (x @ p["wv"][layer]).reshape(n, KV_HEADS, HEAD_DIM)
        shape = p["caches"].shape[2:]
        attn = paged_attention_f64(q, kc.reshape(shape), vc.reshape(shape), p["block_tables"],
                                   p["seq_lens"], p["cu_seqlens_q"], HEAD_DIM ** -0.5)
        x = x + attn.reshape(n, HIDDEN) @ p["wo"][layer]
    return x


def test_one_graph_equals_eval_per_layer_and_numpy(rng):
    p = make_problem(rng)
    lazy_x, lazy_caches = run_mlx(p, eval_each_layer=False)
    eager_x, eager_caches = run_mlx(p, eval_each_layer=True)
    assert np.isfinite(lazy_x).all()
    assert np.array_equal(lazy_x, eager_x)
    for a, b in zip(lazy_caches, eager_caches):
        assert np.array_equal(a, b)
    np.testing.assert_allclose(lazy_x, run_numpy(p), rtol=1e-4, atol=1e-4)


def test_graph_is_lazy_until_evaluated(rng):
    # Building all 28 layers computes nothing: the output is not materialized.
    p = make_problem(rng)
    x = mx.array(p["x"])
    kc, vc = mx.array(p["caches"][0][0]), mx.array(p["caches"][0][1])
    mx.eval(x, kc, vc)
    n = x.shape[0]
    for layer in range(LAYERS):
        k = (x @ mx.array(p["wk"][layer])).reshape(n, KV_HEADS, HEAD_DIM)
        kc, vc = ops.write_kv(kc, vc, k, k, p["slots"])
        attn = ops.paged_attention(mx.repeat(k, 2, axis=1), kc, vc, mx.array(p["block_tables"]),
                                   mx.array(p["seq_lens"]), mx.array(p["cu_seqlens_q"]), scale=0.1)
        x = x + attn.reshape(n, HIDDEN)
    assert not ops._ext.is_materialized(x)
    assert not ops._ext.is_materialized(kc)
    mx.eval(x)
    assert ops._ext.is_materialized(x)
