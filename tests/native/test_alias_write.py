"""The cache writes' alias option (`in_place=True`, native/kv_writes.py): the
updated cache takes the old cache's buffer even while another operation still
holds the old array (the case of two layers sharing one vLLM KV-cache
tensor), and gives exactly the copying write's result. write_kv,
rope_write_kv and the DecoderLayer primitive, on MLX's CPU device; the
default (no alias) keeps copying a buffer something else holds."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_decoder_layer import random_layer

from vllm_metal.native import ops
from vllm_metal.native.decoder_layer import decoder_layer

address = ops._ext.buffer_address
BLOCKS, BLOCK, KV_HEADS, DIM = 6, 4, 2, 8


def caches(rng):
    shape = (BLOCKS, BLOCK, KV_HEADS, DIM)
    kc = mx.array(rng.standard_normal(shape).astype(np.float32))
    vc = mx.array(rng.standard_normal(shape).astype(np.float32))
    mx.eval(kc, vc)
    return kc, vc


def rows(rng, n, heads=KV_HEADS):
    return mx.array(rng.standard_normal((n, heads, DIM)).astype(np.float32))


@pytest.fixture(autouse=True)
def cpu():
    with mx.stream(mx.cpu):
        yield


def test_write_kv_alias_in_place_and_same_result():
    rng = np.random.default_rng(0)
    kc, vc = caches(rng)
    k, v = rows(rng, 3), rows(rng, 3)
    slots = np.array([5, -1, 17])
    expected = ops.write_kv(mx.array(kc), mx.array(vc), k, v, slots)  # copies: kc, vc stay held here
    mx.eval(expected)
    reader = kc.sum() + vc.sum()  # another operation holding the old arrays (an earlier layer's attention)
    before = (address(kc), address(vc))
    out = ops.write_kv(kc, vc, k, v, slots, in_place=True)
    mx.eval(reader, *out)
    assert (address(out[0]), address(out[1])) == before
    for got, want in zip(out, expected):
        assert np.array_equal(np.array(got), np.array(want))


def test_write_kv_default_copies_a_held_cache():
    rng = np.random.default_rng(1)
    kc, vc = caches(rng)
    kept = np.array(kc)
    out_k, _ = ops.write_kv(kc, vc, rows(rng, 2), rows(rng, 2), np.array([0, 1]))
    mx.eval(out_k)
    assert address(out_k) != address(kc)
    assert np.array_equal(np.array(kc), kept)  # the old version is intact


def test_rope_write_kv_alias():
    rng = np.random.default_rng(2)
    kc, vc = caches(rng)
    n = 4
    q, k, v = rows(rng, n, 4), rows(rng, n), rows(rng, n)
    table = mx.array(rng.standard_normal((n, DIM // 2, 2)).astype(np.float32))
    slots = np.array([3, 9, -1, 22])
    want = ops.rope_write_kv(q, k, v, table, mx.array(kc), mx.array(vc), slots)
    mx.eval(want)
    reader = kc * 2  # holds the old key cache
    before = (address(kc), address(vc))
    got = ops.rope_write_kv(q, k, v, table, kc, vc, slots, in_place=True)
    mx.eval(reader, *got)
    assert (address(got[1]), address(got[2])) == before
    for a, b in zip(got, want):
        assert np.array_equal(np.array(a), np.array(b))


def test_alias_chain_of_two_layers_sharing_a_tensor():
    """Layer A writes (its own donation path), attends, then layer B (a later
    layer of another group) aliases the same buffer: one buffer throughout,
    the same contents as separate copying writes, and A's attention read
    A's rows before B's write."""
    rng = np.random.default_rng(3)
    kc, vc = caches(rng)
    ka, va, kb, vb = rows(rng, 2), rows(rng, 2), rows(rng, 2), rows(rng, 2)
    slots_a, slots_b = np.array([0, 1]), np.array([BLOCK * 3, BLOCK * 3 + 1])  # block ids never overlap
    ref = ops.write_kv(*ops.write_kv(mx.array(kc), mx.array(vc), ka, va, slots_a), kb, vb, slots_b)
    mx.eval(ref)
    start = address(kc)
    kc, vc = ops.write_kv(kc, vc, ka, va, slots_a)
    seen_by_a = kc[0, :2] + 0  # A's attention: reads its rows
    kc, vc = ops.write_kv(kc, vc, kb + 0 * seen_by_a.sum(), vb, slots_b, in_place=True)
    mx.eval(seen_by_a, kc, vc)
    assert address(kc) == start
    assert np.array_equal(np.array(seen_by_a), np.array(ka))
    assert np.array_equal(np.array(kc), np.array(ref[0])) and np.array_equal(np.array(vc), np.array(ref[1]))


def test_decoder_layer_alias():
    rng = np.random.default_rng(4)
    args, params = random_layer(rng, tokens_per_seq=[3, 1], context_lens=[7, 20])
    want = decoder_layer(**{**args, "key_cache": mx.array(args["key_cache"]),
                            "value_cache": mx.array(args["value_cache"])}, **params)
    mx.eval(want)
    kc, vc = args["key_cache"], args["value_cache"]
    mx.eval(kc, vc)
    reader = kc + vc
    before = (address(kc), address(vc))
    got = decoder_layer(**args, **params, in_place=True)
    mx.eval(reader, *got)
    assert (address(got[1]), address(got[2])) == before
    for a, b in zip(got, want):
        assert np.array_equal(np.array(a), np.array(b))


def test_shared_slots_in_the_paged_cache():
    """PagedKVCache with layers sharing a slot: one array for both, listed
    once, copied once by copy_blocks; in a step the slot's first writer
    donates as before and the later ones alias."""
    from vllm_metal.models.attention_adapter import PagedKVCache

    rng = np.random.default_rng(5)
    kc, vc = caches(rng)
    own_k, own_v = caches(rng)
    cache = PagedKVCache([kc, own_k], [vc, own_v], layer_group=[0, 1, 2], layer_slot=[0, 0, 1])
    assert cache.keys[0] is cache.keys[1] is kc and cache.keys[2] is own_k
    assert len(cache.arrays()) == 4 and list(cache.keys) == [kc, kc, own_k]
    cache.step = object()
    assert [cache.alias_write(i) for i in (0, 1, 2)] == [False, True, False]
    cache.step = None  # the next step starts again
    assert cache.alias_write(1) is False and cache.alias_write(0) is True
    cache.keys[1] = kc + 1  # a layer's write replaces its slot's array: seen by both
    assert cache.keys[0] is cache.keys[1]
    before = np.array(cache.keys[0])
    cache.copy_blocks([(1, 4)])
    after = np.array(cache.keys[1])
    assert np.array_equal(after[4], before[1]) and np.array_equal(np.delete(after, 4, 0), np.delete(before, 4, 0))


def test_alias_writes_on_the_gpu_only_with_the_metal_kernels(monkeypatch):
    """write_kv(..., in_place=True) takes the RopeWriteKV path on the CPU
    always and on the GPU where the extension has its Metal kernels (its
    eval_gpu: metal/write_kv.metal; tests/metal/test_write_kv_executor.py and,
    on a Mac, test_write_kv_gpu.py); a GPU without them keeps MLX's scatter."""
    from vllm_metal.native import kv_writes

    assert kv_writes.alias_writes_supported(mx.Device(mx.cpu))
    assert kv_writes.alias_writes_supported(mx.Device(mx.gpu)) == bool(ops._ext.HAS_METAL)
    for has_metal in (True, False):
        monkeypatch.setattr(kv_writes, "_ext", type("Ext", (), {"HAS_METAL": has_metal}))
        assert kv_writes.alias_writes_supported(mx.Device(mx.gpu)) is has_metal
        assert kv_writes.alias_writes_supported(mx.Device(mx.cpu))
