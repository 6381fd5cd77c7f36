"""Bad input to ops.paged_attention: a clear Python exception naming the
problem, never a crash or an out-of-bounds read; the next call still works."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from numpy_reference import make_batch, paged_attention_f64

from vllm_metal.native import ops


@pytest.fixture
def good(rng):
    b = make_batch(rng, new_tokens=[3, 1], context_lens=[3, 17], num_heads=4, num_kv_heads=2,
                   head_dim=64, block_size=8)
    return dict(q=mx.array(b.q), key_cache=mx.array(b.key_cache), value_cache=mx.array(b.value_cache),
                block_tables=mx.array(b.block_tables), seq_lens=mx.array(b.seq_lens),
                cu_seqlens_q=mx.array(b.cu_seqlens_q), scale=b.scale), b


def call(args):
    return ops.paged_attention(args["q"], args["key_cache"], args["value_cache"], args["block_tables"],
                               args["seq_lens"], args["cu_seqlens_q"], scale=args["scale"],
                               sliding_window=args.get("sliding_window"), softcap=args.get("softcap"),
                               sinks=args.get("sinks"), v_head_dim=args.get("v_head_dim"))


def big_heads(a, k_dim, v_row, q_dim=None):
    """The good batch with key rows of k_dim and value rows of v_row (zeros)."""
    nb, bs, kvh, _ = a["key_cache"].shape
    return dict(a, q=mx.zeros(a["q"].shape[:2] + (q_dim or k_dim,)), key_cache=mx.zeros((nb, bs, kvh, k_dim)),
                value_cache=mx.zeros((nb, bs, kvh, v_row)))


def still_works(good):
    args, b = good
    out = call(args)
    expected = paged_attention_f64(b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                                   b.cu_seqlens_q, b.scale)
    np.testing.assert_allclose(np.array(out), expected, atol=2e-5, rtol=1e-4)


# Caught when the op is built (static shapes and dtypes): ValueError/TypeError.
STATIC = {
    "q rank": (lambda a: dict(a, q=a["q"][0]), ValueError, r"q must have rank 3"),
    "q dtype": (lambda a: dict(a, q=a["q"].astype(mx.int32)), ValueError, r"q must be float32, float16 or bfloat16"),
    "cache dtype": (lambda a: dict(a, key_cache=a["key_cache"].astype(mx.float16)), ValueError, r"key_cache dtype"),
    "cache rank": (lambda a: dict(a, value_cache=a["value_cache"][0]), ValueError, r"value_cache must have rank 4"),
    "cache shapes differ": (lambda a: dict(a, value_cache=a["value_cache"][:2]), ValueError, r"differs from value_cache"),
    "head_dim": (lambda a: dict(a, q=a["q"][..., :32]), ValueError, r"head_dim mismatch"),
    "heads not a multiple": (lambda a: dict(a, q=a["q"][:, :3]), ValueError, r"num_heads \(3, from q\) must be a positive multiple of num_kv_heads \(2"),
    "block_tables dtype": (lambda a: dict(a, block_tables=a["block_tables"].astype(mx.int64)), ValueError, r"block_tables must be int32"),
    "block_tables rows": (lambda a: dict(a, block_tables=a["block_tables"][:1]), ValueError, r"block_tables has 1 rows but seq_lens has 2"),
    "cu_seqlens length": (lambda a: dict(a, cu_seqlens_q=a["cu_seqlens_q"][:2]), ValueError, r"cu_seqlens_q must have num_seqs \+ 1 = 3"),
    "seq_lens rank": (lambda a: dict(a, seq_lens=a["seq_lens"][None]), ValueError, r"seq_lens must have rank 1"),
    "block size": (lambda a: dict(a, key_cache=a["key_cache"][:, :5], value_cache=a["value_cache"][:, :5]), ValueError, r"block_size 5 is not supported"),
    "scale": (lambda a: dict(a, scale=0.0), ValueError, r"scale must be a positive"),
    "window": (lambda a: dict(a, sliding_window=0), ValueError, r"sliding_window must be >= 1"),
    "softcap": (lambda a: dict(a, softcap=-1.0), ValueError, r"softcap must be a positive"),
    "not an array": (lambda a: dict(a, q=np.zeros((4, 4, 64), np.float32)), TypeError, r"q must be an mx.array"),
    # attention sinks: [num_heads] floats
    "sinks rank": (lambda a: dict(a, sinks=mx.zeros((4, 1))), ValueError, r"sinks must have shape \[num_heads\] = \(4,\) .*got shape \(4, 1\)"),
    "sinks length": (lambda a: dict(a, sinks=mx.zeros((2,))), ValueError, r"sinks must have shape \[num_heads\] = \(4,\) .*got shape \(2,\)"),
    "sinks dtype": (lambda a: dict(a, sinks=mx.zeros((4,), mx.int32)), ValueError, r"sinks must be a floating-point array, got int32"),
    "sinks type": (lambda a: dict(a, sinks="none"), TypeError, r"sinks must be an mx.array"),
    # value head size, and caches that may differ only in their rows' size
    "v_head_dim zero": (lambda a: dict(a, v_head_dim=0), ValueError, r"v_head_dim must be >= 1"),
    "v_head_dim past the value row": (lambda a: dict(a, v_head_dim=65), ValueError, r"v_head_dim 65 exceeds the value_cache row of 64 values"),
    "v_head_dim type": (lambda a: dict(a, v_head_dim=32.0), TypeError, r"v_head_dim must be an int"),
    "value rows differ, no v_head_dim": (lambda a: dict(a, value_cache=a["value_cache"][..., :32]), ValueError, r"value_cache rows hold 32 values but the key head_dim is 64; pass v_head_dim"),
    "value kv heads": (lambda a: dict(a, value_cache=a["value_cache"][:, :, :1]), ValueError, r"differs from value_cache shape .* in num_kv_heads \(2 vs 1\)"),
    "value block size": (lambda a: dict(a, value_cache=a["value_cache"][:, :4]), ValueError, r"differs from value_cache shape .* in block_size \(8 vs 4\)"),
    "value num_blocks": (lambda a: dict(a, value_cache=a["value_cache"][:2]), ValueError, r"in num_blocks \(\d+ vs 2\)"),
    "head_dim past 576": (lambda a: big_heads(a, 584, 584), ValueError, r"head_dim 584 is not supported \(1..576\)"),
    "v_head_dim past 512": (lambda a: dict(big_heads(a, 576, 576), v_head_dim=520), ValueError, r"v_head_dim 520 is not supported \(1..512\)"),
    "default v_head_dim past 512": (lambda a: big_heads(a, 576, 576), ValueError, r"v_head_dim 576 \(the key head_dim, v_head_dim being None\) is not supported \(1..512\)"),
    "q head_dim vs wide key rows": (lambda a: dict(big_heads(a, 576, 576, q_dim=512), v_head_dim=512), ValueError, r"head_dim mismatch: q has 512, key_cache has 576"),
    "float block table": (lambda a: dict(a, block_tables=np.zeros((2, 4))), ValueError, r"block_tables must hold integers"),
}

# Known only from the data: RuntimeError when evaluated, before any output.
AT_EVAL = {
    "block id too large": (lambda a: dict(a, block_tables=mx.array(np.array([[0, 1, 2, 3], [4, 99, 5, 6]], np.int32))),
                           r"block_tables\[1, 1\] = 99 is out of range \[0, "),
    "negative block id": (lambda a: dict(a, block_tables=mx.array(np.array([[-1, 1, 2, 3], [4, 0, 5, 6]], np.int32))),
                          r"block_tables\[0, 0\] = -1 is out of range"),
    "seq_len beyond capacity": (lambda a: dict(a, seq_lens=mx.array(np.array([3, 33], np.int32))),
                                r"seq_lens\[1\] = 33 must be .* <= the block table capacity 4 blocks x 8 = 32"),
    "seq_len below new tokens": (lambda a: dict(a, seq_lens=mx.array(np.array([2, 17], np.int32))),
                                 r"seq_lens\[0\] = 2 must be >= the 3 new tokens"),
    "cu_seqlens not starting at 0": (lambda a: dict(a, cu_seqlens_q=mx.array(np.array([1, 3, 4], np.int32))),
                                     r"cu_seqlens_q must start at 0 and end at num_tokens = 4"),
    "cu_seqlens decreasing": (lambda a: dict(a, cu_seqlens_q=mx.array(np.array([0, 5, 4], np.int32))),
                              r"cu_seqlens_q must be non-decreasing"),
}


@pytest.mark.parametrize("case", STATIC)
def test_static_errors(good, case):
    change, exc, message = STATIC[case]
    with pytest.raises(exc, match=message):
        call(change(good[0]))
    still_works(good)


@pytest.mark.parametrize("case", AT_EVAL)
def test_errors_at_eval(good, case):
    change, message = AT_EVAL[case]
    out = call(change(good[0]))  # building is fine: the data is not known yet
    with pytest.raises(RuntimeError, match=message):
        mx.eval(out)
    still_works(good)


@pytest.mark.parametrize("change,message", [
    (lambda a: dict(a, q=a["q"][:, :3]), "must be a positive multiple"),
    (lambda a: dict(a, sinks=mx.zeros((3,))), r"sinks must have shape"),
    (lambda a: dict(a, v_head_dim=65), r"v_head_dim 65 exceeds"),
])
def test_reference_validates_the_same_way(good, change, message):
    args = change(good[0])
    with pytest.raises(ValueError, match=message):
        ops.paged_attention_reference(*(args[k] for k in ("q", "key_cache", "value_cache", "block_tables",
                                                          "seq_lens", "cu_seqlens_q")), scale=0.1,
                                      sinks=args.get("sinks"), v_head_dim=args.get("v_head_dim"))


def test_many_failures_then_success(good):
    # Errors inside the CPU task leave the stream usable, over and over.
    bad = AT_EVAL["block id too large"][0](good[0])
    for _ in range(20):
        with pytest.raises(RuntimeError):
            mx.eval(call(bad))
    still_works(good)
