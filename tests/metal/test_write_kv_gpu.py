"""The KV-cache write kernel (metal/write_kv.metal) on a real Apple GPU,
through RopeWriteKV::eval_gpu and MLX's command stream: write_kv(...,
in_place=True) on the GPU gives MLX's scatter's result exactly, writes the
shared buffer in place while an earlier reader still holds it, and orders
after that reader. Skipped where the extension has no Metal (every Linux
machine): scripts/mac_verify.sh runs it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.native import kv_writes, ops

pytestmark = pytest.mark.skipif(
    not (ops._ext.HAS_METAL and mx.metal.is_available()),
    reason="needs the Metal build of vllm_metal on an Apple GPU (run scripts/mac_verify.sh on a Mac)")

address = ops._ext.buffer_address
SHAPE = (5, 4, 3, 40)  # blocks, block size, kv heads, head dim


def case(rng, dtype, tokens=11):
    kc = mx.array(rng.standard_normal(SHAPE).astype(np.float32)).astype(dtype)
    vc = mx.array(rng.standard_normal(SHAPE).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((tokens, *SHAPE[2:])).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((tokens, *SHAPE[2:])).astype(np.float32)).astype(dtype)
    slots = rng.permutation(SHAPE[0] * SHAPE[1])[:tokens].astype(np.int32)
    slots[::3] = -1
    mx.eval(kc, vc, k, v)
    return kc, vc, k, v, slots


def as_np(a):
    return np.array(a.astype(mx.float32))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_alias_write_matches_scatter_and_stays_in_place(rng, dtype):
    with mx.stream(mx.gpu):
        kc, vc, k, v, slots = case(rng, dtype)
        want_k, want_v = kv_writes.write_kv(kc, vc, k, v, slots)  # MLX's scatter (a copy: kc is held)
        before = as_np(kc)
        held = kc  # another holder of the old array, as a sharing layer is
        got_k, got_v = kv_writes.write_kv(kc, vc, k, v, slots, in_place=True)
        mx.eval(got_k, got_v, want_k, want_v)
        assert address(got_k) == address(held) and address(got_v) == address(vc)
        np.testing.assert_array_equal(as_np(got_k), as_np(want_k))
        np.testing.assert_array_equal(as_np(got_v), as_np(want_v))
        untouched = np.ones(SHAPE[0] * SHAPE[1], bool)
        untouched[slots[slots >= 0]] = False
        flat = as_np(got_k).reshape(-1, *SHAPE[2:])
        np.testing.assert_array_equal(flat[untouched], before.reshape(-1, *SHAPE[2:])[untouched])


def test_strided_rows_and_reader_before_writer(rng):
    """k as a column slice of a fused projection; a reader of the old cache
    (an earlier layer's attention stand-in) whose result feeds the write's
    input sees the old contents."""
    with mx.stream(mx.gpu):
        kc, vc, _, v, slots = case(rng, mx.float16)
        fused = mx.array(rng.standard_normal((v.shape[0], 3 * SHAPE[2], SHAPE[3])).astype(np.float16))
        old_sum = mx.sum(kc.astype(mx.float32))  # reads the old cache
        k = fused[:, SHAPE[2]:2 * SHAPE[2]] + 0 * old_sum.astype(mx.float16)  # depends on the reader
        want = as_np(kc).sum()
        got_k, _ = kv_writes.write_kv(kc, vc, k, v, slots, in_place=True)
        mx.eval(got_k, old_sum)
        assert float(old_sum) == pytest.approx(want, rel=1e-3)
        ref = np.array(kc.astype(mx.float32)).reshape(-1, *SHAPE[2:])  # kc's buffer is got_k's now
        k_np = as_np(k)
        for t, s in enumerate(slots):
            if s >= 0:
                np.testing.assert_array_equal(ref[s], k_np[t])


def test_rope_with_a_table_still_refused_on_the_gpu(rng):
    kc, vc, k, v, slots = case(rng, mx.float32, tokens=2)
    table = mx.zeros((2, 4, 2), dtype=mx.float32)
    with pytest.raises(RuntimeError, match="only writes the caches"):
        q, a, b = ops._ext.rope_write_kv(k, k, v, table, kc, vc, mx.array(np.maximum(slots, -1)), False,
                                         in_place=True, stream=mx.gpu)
        mx.eval(q, a, b)
