"""The Metal KV-cache write kernel (metal/write_kv.metal), run by the MSL
executor exactly as RopeWriteKV::eval_gpu dispatches it (a table of no
pairs: kv_writes.write_kv(..., in_place=True) on a GPU stream), against a
numpy reference: token t's k[t] / v[t] land in cache[slot // block_size,
slot % block_size] for slot = slots[t] in range, any other slot writes
nothing, every other cache row is left as it was, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from paged_attention_cases import storage

DTYPES = ("float32", "float16", "bfloat16")


def reference(k, v, slots, key_cache, value_cache):
    kc, vc = key_cache.copy(), value_cache.copy()
    num_blocks, block_size = kc.shape[:2]
    for t, slot in enumerate(slots):
        if 0 <= slot < num_blocks * block_size:
            kc[slot // block_size, slot % block_size] = k[t]
            vc[slot // block_size, slot % block_size] = v[t]
    return kc, vc


def case(rng, dtype, *, tokens, heads, dim, num_blocks, block_size, skip=0.25):
    """Storage-dtype k, v, caches (random bit patterns as values) and distinct
    slots, about `skip` of them -1 (and one past the cache, which the kernel
    must skip as the CPU backend does)."""
    k = storage(dtype, rng.standard_normal((tokens, heads, dim)).astype(np.float32))
    v = storage(dtype, rng.standard_normal((tokens, heads, dim)).astype(np.float32))
    shape = (num_blocks, block_size, heads, dim)
    kc = storage(dtype, rng.standard_normal(shape).astype(np.float32))
    vc = storage(dtype, rng.standard_normal(shape).astype(np.float32))
    slots = rng.permutation(num_blocks * block_size)[:tokens].astype(np.int32)
    slots[rng.random(tokens) < skip] = -1
    if tokens > 2:
        slots[1] = num_blocks * block_size  # out of range: written nowhere
    return k, v, slots, kc, vc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,dim", [(1, 64), (2, 128), (4, 80), (3, 7), (8, 256)])
def test_write_matches_reference_in_place(executor, rng, dtype, heads, dim):
    """Several blocks and heads, rows shorter and longer than a threadgroup,
    negative slots skipped; the outputs are the input caches' buffers."""
    k, v, slots, kc, vc = case(rng, dtype, tokens=13, heads=heads, dim=dim, num_blocks=5,
                               block_size=4)
    kc_out, vc_out, plan = executor.write_kv(dtype, k, v, slots, kc, vc, in_place=True)
    kc_ref, vc_ref = reference(k, v, slots, kc, vc)
    assert plan["dispatched"] and plan["in_place"]
    row = heads * dim
    assert plan["threads"] == min(256, -(-row // 32) * 32)
    assert plan["grid"] == (-(-row // plan["threads"]), 13, 1)
    np.testing.assert_array_equal(kc_out, kc_ref)
    np.testing.assert_array_equal(vc_out, vc_ref)
    assert (slots < 0).any(), "the case should skip some token"


@pytest.mark.parametrize("dtype", DTYPES)
def test_copying_write_leaves_input_caches_alone(executor, rng, dtype):
    """in_place=False with a cache that cannot be taken: the output is a copy
    (the driver checks the input caches stay untouched) with the rows written."""
    k, v, slots, kc, vc = case(rng, dtype, tokens=9, heads=2, dim=32, num_blocks=3, block_size=8)
    kc_out, vc_out, plan = executor.write_kv(dtype, k, v, slots, kc, vc, in_place=False)
    kc_ref, vc_ref = reference(k, v, slots, kc, vc)
    assert plan["dispatched"] and not plan["in_place"]
    np.testing.assert_array_equal(kc_out, kc_ref)
    np.testing.assert_array_equal(vc_out, vc_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views(executor, rng, dtype):
    """k and v read through their strides: column slices of a fused
    projection [tokens, 3 * heads, dim] and a head-transposed view."""
    tokens, heads, dim = 6, 2, 48
    fused = storage(dtype, rng.standard_normal((tokens, 3 * heads, dim)).astype(np.float32))
    k = fused[:, heads:2 * heads]
    v_base = storage(dtype, rng.standard_normal((heads, tokens, dim)).astype(np.float32))
    v = v_base.transpose(1, 0, 2)
    _, _, slots, kc, vc = case(rng, dtype, tokens=tokens, heads=heads, dim=dim, num_blocks=4,
                               block_size=2)
    kc_out, vc_out, _ = executor.write_kv(dtype, k, v, slots, kc, vc)
    kc_ref, vc_ref = reference(k, v, slots, kc, vc)
    np.testing.assert_array_equal(kc_out, kc_ref)
    np.testing.assert_array_equal(vc_out, vc_ref)


def test_every_slot_skipped_and_empty_step(executor, rng):
    """All slots -1: nothing changes; no tokens: no dispatch."""
    k, v, slots, kc, vc = case(rng, "float16", tokens=4, heads=2, dim=16, num_blocks=2,
                               block_size=4)
    slots[:] = -1
    kc_out, vc_out, plan = executor.write_kv("float16", k, v, slots, kc, vc)
    assert plan["dispatched"]
    np.testing.assert_array_equal(kc_out, kc)
    np.testing.assert_array_equal(vc_out, vc)
    k0, v0 = k[:0], v[:0]
    kc_out, _, plan = executor.write_kv("float16", k0, v0, slots[:0], kc, vc)
    assert not plan["dispatched"]
    np.testing.assert_array_equal(kc_out, kc)


def test_guard_pages_before_the_buffers(executor, rng):
    """The caches' first and last slots written with the guard page just
    before each buffer (the executor faults on any access outside)."""
    k, v, slots, kc, vc = case(rng, "float32", tokens=3, heads=3, dim=5, num_blocks=2,
                               block_size=3, skip=0.0)
    slots[:] = [0, 5, -1]
    for at_start in (False, True):
        kc_out, vc_out, _ = executor.write_kv("float32", k, v, slots, kc, vc, at_start=at_start)
        kc_ref, vc_ref = reference(k, v, slots, kc, vc)
        np.testing.assert_array_equal(kc_out, kc_ref)
        np.testing.assert_array_equal(vc_out, vc_ref)


def test_kernel_names_instantiated(executor):
    names = executor.kernel_names()
    for dtype in DTYPES:
        assert f"write_kv_{dtype}" in names
