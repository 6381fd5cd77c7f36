"""Hybrid prefix caching's worker-side bookkeeping (vllm_metal.engine.state_align
and the cache's block copies), against vLLM's own rule: block p of a request's
state group holds the state after (p + 1) * block_size tokens, the running
state sits in the block of the last computed token, and a step that moves it
reads the old block and writes the new one (vLLM's GPU runner copies, then
updates in place: `mamba_utils.preprocess_mamba`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from vllm_metal.engine.state_align import AlignedStateIndex


def _so(finished=(), preempted=(), resumed=()):
    return SimpleNamespace(finished_req_ids=set(finished), preempted_req_ids=set(preempted),
                           scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(resumed)))


def _vllm_rule(prev_idx, computed, scheduled, block):
    """vLLM 0.33 preprocess_mamba's indices, written out (no speculative blocks)."""
    prev = prev_idx if prev_idx is not None else (computed - 1) // block
    curr = -(-(computed + scheduled) // block) - 1
    return prev, curr


def test_a_request_walks_its_blocks_as_vllm_does():
    block = 4
    index = AlignedStateIndex(block)
    table = np.array([[11, 12, 13, 14, 15, 16]], np.int32)
    # prefill chunk to a boundary, the prompt's tail, decode across a boundary
    steps = [(0, 8), (8, 2), (10, 1), (11, 1), (12, 1), (13, 1), (14, 3)]
    expected_prev = None
    for computed, scheduled in steps:
        (src, dst), = index.plan(["a"], np.array([computed]), np.array([scheduled]), [table])
        prev, curr = _vllm_rule(expected_prev, computed, scheduled, block)
        assert int(dst[0]) == table[0, curr]
        assert int(src[0]) == (table[0, prev] if prev >= 0 else 0)
        expected_prev = curr
    # The boundary states stay where they were written: block 1 (8 tokens)
    # and block 2 (12 tokens) are never a destination after their step.
    assert index.state_idx["a"] == 4


def test_a_prefix_hit_starts_from_the_hit_block_and_forget_resets():
    index = AlignedStateIndex(16)
    table = np.array([[0, 0, 7, 9, 0], [3, 4, 5, 0, 0]], np.int32)
    # "a" hit 48 cached tokens (its table: nulls, then the hit block 7); "b" is new.
    (src, dst), = index.plan(["a", "b"], np.array([48, 0]), np.array([10, 40]), [table])
    assert src.tolist() == [7, 0] and dst.tolist() == [9, 5]
    index.forget(_so(resumed=["a"], finished=["b"]))
    assert index.state_idx == {}
    (src, dst), = index.plan(["a"], np.array([0]), np.array([5]), [np.array([[21, 22]], np.int32)])
    assert src.tolist() == [0] and dst.tolist() == [21]  # a resumed request without a hit: from zeros
    index.forget(_so(preempted=["a"]))
    assert "a" not in index.state_idx


def test_two_state_groups_share_one_index():
    index = AlignedStateIndex(8)
    tables = [np.array([[1, 2, 3]], np.int32), np.array([[4, 5, 6]], np.int32)]
    (s1, d1), (s2, d2) = index.plan(["r"], np.array([8]), np.array([9]), tables)
    assert (s1.tolist(), d1.tolist(), s2.tolist(), d2.tolist()) == ([1], [3], [4], [6])


def test_bookkeeping_errors_name_the_request():
    index = AlignedStateIndex(4)
    with pytest.raises(ValueError, match="request r: its state block 2 is past"):
        index.plan(["r"], np.array([0]), np.array([9]), [np.array([[1, 2]], np.int32)])
    with pytest.raises(ValueError, match="request s: its state block 1 is the null block"):
        index.plan(["s"], np.array([0]), np.array([5]), [np.array([[1, 0]], np.int32)])


def test_block_copies_copy_every_cache_array():
    import mlx.core as mx

    from vllm_metal.models.attention_adapter import PagedKVCache

    k = mx.arange(5 * 2 * 3, dtype=mx.float32).reshape(5, 2, 3)
    state = mx.arange(5 * 4, dtype=mx.float32).reshape(5, 4)
    cache = PagedKVCache([k, state, None], [k + 100, None, None], [0, 1, 0])
    before = [np.array(a) for a in cache.arrays()]
    cache.copy_blocks([(1, 3), (4, 2)])
    for old, new in zip(before, cache.arrays()):
        new = np.array(new)
        expected = old.copy()
        expected[3], expected[2] = old[1], old[4]
        np.testing.assert_array_equal(new, expected)
