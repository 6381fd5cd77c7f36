"""native/decoder_layer.py: a llama-shaped decoder layer as one DecoderLayer
primitive on MLX's CPU device. Against float64 numpy (the layer's formula
from its definition: RMSNorm, q/k/v, RoPE, the cache write, paged attention,
the residual adds, SwiGLU), against the graph of separate operations it
replaces (the same bits), over prefill, decode and mixed batches with GQA,
both RoPE pairings, partial rotation and a sliding window; the caches written
in place when nothing else holds them; bad input refused with the problem
named, before anything is written."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from numpy_reference import batch_lengths, make_batch, paged_attention_f64
from test_norm_rope import random_table, rope_reference

from vllm_metal.native import ops
from vllm_metal.native.decoder_layer import decoder_layer, decoder_layer_composed

address = ops._ext.buffer_address
HIDDEN, FFN = 48, 80


def f64(a) -> np.ndarray:
    return np.array(a, np.float64)


def random_layer(rng, *, tokens_per_seq, context_lens, heads=4, kv_heads=2, head_dim=16, block_size=16,
                 rotated=None, traditional=False, window=None):
    """Every argument of one layer's call over a random paged batch (numpy
    caches with garbage in unused slots, physically shuffled blocks)."""
    batch = make_batch(rng, new_tokens=tokens_per_seq, context_lens=context_lens, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    tokens = int(sum(tokens_per_seq))
    slots = []
    for s, (n, ctx) in enumerate(zip(tokens_per_seq, context_lens)):
        for pos in range(ctx - n, ctx):
            slots.append(int(batch.block_tables[s, pos // block_size]) * block_size + pos % block_size)

    def w(*shape, scale):
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))

    args = dict(
        x=w(1, tokens, HIDDEN, scale=1.0), input_norm=1 + w(HIDDEN, scale=0.2),
        qkv_weight=w((heads + 2 * kv_heads) * head_dim, HIDDEN, scale=0.3),
        table=random_table(rng, tokens, (rotated or head_dim) // 2),
        key_cache=mx.array(batch.key_cache), value_cache=mx.array(batch.value_cache), slot_mapping=np.array(slots),
        block_tables=mx.array(batch.block_tables), seq_lens=mx.array(batch.seq_lens),
        cu_seqlens_q=mx.array(batch.cu_seqlens_q), o_weight=w(HIDDEN, heads * head_dim, scale=0.2),
        post_norm=1 + w(HIDDEN, scale=0.2), gate_up_weight=w(2 * FFN, HIDDEN, scale=0.3),
        down_weight=w(HIDDEN, FFN, scale=0.2))
    params = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, input_eps=1e-5, post_eps=1e-6,
                  scale=head_dim ** -0.5, sliding_window=window, traditional=traditional)
    return args, params


def layer_f64(a, p):
    """The layer from its definition, in float64: (out, key_cache, value_cache)."""
    H, KV, D = p["heads"], p["kv_heads"], p["head_dim"]

    def rms(x, w, eps):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    x = f64(a["x"]).reshape(-1, HIDDEN)
    tokens = x.shape[0]
    qkv = rms(x, f64(a["input_norm"]), p["input_eps"]) @ f64(a["qkv_weight"]).T
    q = qkv[:, :H * D].reshape(tokens, H, D)
    k = qkv[:, H * D:(H + KV) * D].reshape(tokens, KV, D)
    v = qkv[:, (H + KV) * D:].reshape(tokens, KV, D)
    q = rope_reference(mx.array(q.astype(np.float32)), a["table"], p["traditional"]) if tokens else q
    k = rope_reference(mx.array(k.astype(np.float32)), a["table"], p["traditional"]) if tokens else k
    kc, vc = f64(a["key_cache"]), f64(a["value_cache"])
    flat_k, flat_v = kc.reshape(-1, KV, D), vc.reshape(-1, KV, D)
    for i, slot in enumerate(a["slot_mapping"]):
        if slot >= 0:
            flat_k[slot], flat_v[slot] = k[i], v[i]
    attended = paged_attention_f64(q, kc, vc, np.array(a["block_tables"]), np.array(a["seq_lens"]),
                                   np.array(a["cu_seqlens_q"]), p["scale"], sliding_window=p["sliding_window"])
    h = x + attended.reshape(tokens, -1) @ f64(a["o_weight"]).T
    gate_up = rms(h, f64(a["post_norm"]), p["post_eps"]) @ f64(a["gate_up_weight"]).T
    gate, up = gate_up[:, :FFN], gate_up[:, FFN:]
    out = h + (gate / (1 + np.exp(-gate)) * up) @ f64(a["down_weight"]).T
    return out.reshape(np.array(a["x"]).shape), kc, vc


CASES = {
    "decode": dict(tokens_per_seq=[1, 1, 1], context_lens=[1, 37, 130]),
    "prefill": dict(tokens_per_seq=[19, 5], context_lens=[19, 5]),
    "mixed": dict(tokens_per_seq=[1, 7, 12], context_lens=[60, 7, 40]),
    "traditional, partial": dict(tokens_per_seq=[3, 1], context_lens=[20, 33], rotated=8, traditional=True),
    "sliding window": dict(tokens_per_seq=[9, 1], context_lens=[50, 70], window=16),
    "MQA, block 8": dict(tokens_per_seq=[4, 1], context_lens=[30, 9], kv_heads=1, block_size=8),
    "no GQA, head 64": dict(tokens_per_seq=[2], context_lens=[40], heads=2, kv_heads=2, head_dim=64),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_and_the_separate_operations_bit_for_bit(rng, case):
    args, params = random_layer(rng, **CASES[case])
    want_out, want_kc, want_vc = layer_f64(args, params)
    kept = {k: mx.array(np.array(args[k])) for k in ("key_cache", "value_cache")}
    out, kc, vc = decoder_layer(**args, **params)
    sep = decoder_layer_composed(**{**args, **kept, "slot_mapping": ops.SlotMapping(args["slot_mapping"])},
                                 **params)
    mx.eval(out, kc, vc, *sep)
    assert out.shape == args["x"].shape and out.dtype == mx.float32
    np.testing.assert_allclose(f64(out), want_out, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(f64(kc), want_kc, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(f64(vc), want_vc, rtol=2e-5, atol=2e-5)
    for got, want in zip((out, kc, vc), sep):
        assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_random_batches(rng, kind):
    for _ in range(3):
        new, ctx = batch_lengths(rng, kind, 16)
        args, params = random_layer(rng, tokens_per_seq=new, context_lens=ctx)
        want_out, _, _ = layer_f64(args, params)
        out, _, _ = decoder_layer(**args, **params)
        np.testing.assert_allclose(f64(out), want_out, rtol=2e-4, atol=2e-4)


def test_strided_inputs_and_no_tokens(rng):
    args, params = random_layer(rng, tokens_per_seq=[3], context_lens=[10])
    want = layer_f64(args, params)[0]
    wide = mx.concatenate([args["x"], args["x"]], axis=-1)[..., :HIDDEN]  # a column slice: not contiguous
    weight = mx.array(np.array(args["o_weight"]).T.copy()).T  # a transposed view
    out, _, _ = decoder_layer(**{**args, "x": wide, "o_weight": weight}, **params)
    np.testing.assert_allclose(f64(out), want, rtol=2e-4, atol=2e-4)
    empty, _ = random_layer(rng, tokens_per_seq=[0], context_lens=[4])
    out, kc, vc = decoder_layer(**empty, **params)
    mx.eval(out, kc, vc)
    assert out.shape == (1, 0, HIDDEN)
    assert np.array_equal(np.array(kc), np.array(empty["key_cache"]))


def test_caches_written_in_place_and_a_kept_cache_untouched(rng):
    args, params = random_layer(rng, tokens_per_seq=[1], context_lens=[20])
    kc, vc = args.pop("key_cache"), args.pop("value_cache")
    mx.eval(kc, vc)
    k_addr, v_addr = address(kc), address(vc)
    for _ in range(3):
        out, kc, vc = decoder_layer(**args, key_cache=kc, value_cache=vc, **params)  # old references dropped
        mx.eval(out, kc, vc)
    assert (address(kc), address(vc)) == (k_addr, v_addr), "cache buffers were copied"
    before = np.array(kc)
    _, kc2, _ = decoder_layer(**args, key_cache=kc, value_cache=vc, **params)
    args["slot_mapping"] = args["slot_mapping"] + 1  # another slot: the kept cache must not see it
    _, kc3, _ = decoder_layer(**args, key_cache=kc, value_cache=vc, **params)
    mx.eval(kc2, kc3)
    assert np.array_equal(np.array(kc), before) and address(kc2) != address(kc)
    assert not np.array_equal(np.array(kc3), before)


def test_the_blas_it_calls_is_the_one_mlx_binds(rng):
    """Its products go through the symbol MLX's own matmuls call: with the
    BLAS shim loaded, the shim counts the layer's four products."""
    from vllm_metal.native import fast_blas

    path = ops._ext.decoder_layer_blas()
    assert path, "no cblas_sgemm found"
    before = fast_blas.shim_calls()
    if before is None:
        pytest.skip("the BLAS shim is not loaded here: nothing counts the calls")
    assert path.endswith("libvllm_metal_blas_shim.so")
    args, params = random_layer(rng, tokens_per_seq=[1], context_lens=[5])
    mx.eval(*decoder_layer(**args, **params))
    after = fast_blas.shim_calls()
    calls = [k for k in after if k != "few_rows_taken_over"]  # (slices, not calls)
    assert sum(after[k] - before[k] for k in calls) == 4


BAD = {
    "x dtype": (lambda a, p: ({**a, "x": a["x"].astype(mx.float16)}, p), "x must be float32"),
    "heads": (lambda a, p: (a, {**p, "heads": 3}), r"heads \(3\) must be a positive multiple of kv_heads"),
    "head dim": (lambda a, p: (a, {**p, "head_dim": 600}), "head_dim 600 is not supported"),
    "scale": (lambda a, p: (a, {**p, "scale": 0.0}), "scale must be positive"),
    "qkv rows": (lambda a, p: ({**a, "qkv_weight": a["qkv_weight"][:-1]}, p), "qkv_weight must be"),
    "o weight": (lambda a, p: ({**a, "o_weight": a["o_weight"].T}, p), "o_weight must be"),
    "norm size": (lambda a, p: ({**a, "post_norm": a["post_norm"][:-1]}, p), "post_norm must be"),
    "odd gate/up": (lambda a, p: ({**a, "gate_up_weight": a["gate_up_weight"][:-1]}, p), "gate_up_weight must be"),
    "down": (lambda a, p: ({**a, "down_weight": a["down_weight"][:, :-1]}, p), "down_weight must be"),
    "bf16 weight": (lambda a, p: ({**a, "down_weight": a["down_weight"].astype(mx.bfloat16)}, p),
                    "down_weight must be float32"),
    "table tokens": (lambda a, p: ({**a, "table": a["table"][:-1]}, p), "table must be float32"),
    "table too wide": (lambda a, p: ({**a, "table": mx.zeros((4, 9, 2))}, p), "rotated <= head_dim"),
    "cache heads": (lambda a, p: ({**a, "key_cache": a["key_cache"][:, :, :1], "value_cache": a["value_cache"][:, :, :1]},
                                  p), "key_cache must be float32"),
    "cache rank": (lambda a, p: ({**a, "key_cache": a["key_cache"][0]}, p), "key_cache must have rank 4"),
    "value cache": (lambda a, p: ({**a, "value_cache": a["value_cache"][:-1]}, p), "value_cache must be"),
    "block size": (lambda a, p: ({**a, "key_cache": mx.zeros((8, 12, 2, 16)), "value_cache": mx.zeros((8, 12, 2, 16))},
                                 p), "block_size 12 is not supported"),
    "fp8 cache": (lambda a, p: ({**a, "key_cache": a["key_cache"].astype(mx.uint8),
                                 "value_cache": a["value_cache"].astype(mx.uint8)}, p), "key_cache must be float32"),
    "slot too high": (lambda a, p: ({**a, "slot_mapping": np.array([0, 1, 2, 10 ** 6])}, p), "is outside"),
    "slot count": (lambda a, p: ({**a, "slot_mapping": np.array([0, 1])}, p), r"must be \[num_tokens\] = \[4\]"),
    "lazy slots": (lambda a, p: ({**a, "slot_mapping": mx.array([0, 1, 2, 3]) + 1}, p), "known on the host"),
    "seq lens": (lambda a, p: ({**a, "seq_lens": a["seq_lens"][:1]}, p), "seq_lens must be int32"),
    "cu dtype": (lambda a, p: ({**a, "cu_seqlens_q": a["cu_seqlens_q"].astype(mx.int64)}, p),
                 "cu_seqlens_q must be int32"),
    "window": (lambda a, p: (a, {**p, "sliding_window": 0}), "sliding_window must be a positive int"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_naming_the_problem(rng, case):
    args, params = random_layer(rng, tokens_per_seq=[3, 1], context_lens=[3, 20])
    change, message = BAD[case]
    before = np.array(args["key_cache"])
    bad_args, bad_params = change(args, params)
    with pytest.raises(ValueError, match=message):
        decoder_layer(**bad_args, **bad_params)
    assert np.array_equal(np.array(args["key_cache"]), before)  # nothing written


EVAL_BAD = {
    "block id": (lambda a: {**a, "block_tables": mx.full(a["block_tables"].shape, 999, dtype=mx.int32)},
                 r"block_tables\[0, 0\] = 999 is out of range"),
    "seq len past the table": (lambda a: {**a, "seq_lens": mx.array([3, 10 ** 4], dtype=mx.int32)},
                               "must be >= the 1 new tokens of that sequence and <= the block table capacity"),
    "cu end": (lambda a: {**a, "cu_seqlens_q": mx.array([0, 3, 3], dtype=mx.int32)},
               "must start at 0 and end at num_tokens = 4"),
}


@pytest.mark.parametrize("case", list(EVAL_BAD))
def test_bad_index_data_raises_at_eval_and_the_next_step_runs(rng, case):
    args, params = random_layer(rng, tokens_per_seq=[3, 1], context_lens=[3, 20])
    change, message = EVAL_BAD[case]
    caches = [np.array(args["key_cache"]), np.array(args["value_cache"])]
    for _ in range(12):  # more failed evaluations than MLX 0.32's leaked-task limit (~10) would allow
        out, kc, vc = decoder_layer(**change(args), **params)
        with pytest.raises(RuntimeError, match=r"\[decoder_layer\] .*" + message):
            mx.eval(out, kc, vc)
    # Nothing was written: the checks run before any output or cache buffer is taken.
    assert np.array_equal(np.array(args["key_cache"]), caches[0])
    assert np.array_equal(np.array(args["value_cache"]), caches[1])
    want = layer_f64(args, params)[0]
    out, _, _ = decoder_layer(**args, **params)
    np.testing.assert_allclose(f64(out), want, rtol=2e-4, atol=2e-4)


def test_non_arrays_are_refused(rng):
    args, params = random_layer(rng, tokens_per_seq=[1], context_lens=[2])
    with pytest.raises(TypeError, match="o_weight must be an mx.array"):
        decoder_layer(**{**args, "o_weight": np.array(args["o_weight"])}, **params)
