"""Batch preparation, without a model."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs


def test_mixed_batch():
    rows = [
        ScheduledRow([11], num_computed=20, block_ids=[[7, 3]]),  # decode at position 20
        ScheduledRow([1, 2, 3], num_computed=0, block_ids=[[5]]),  # fresh prefill
        ScheduledRow([4, 5], num_computed=15, block_ids=[[9, 2]]),  # chunk crossing a block edge
    ]
    x = build_step_inputs(rows, [16])
    assert x.token_ids.tolist() == [11, 1, 2, 3, 4, 5]
    assert x.positions.tolist() == [20, 0, 1, 2, 15, 16]
    assert x.seq_lens.tolist() == [21, 3, 17]
    assert x.cu_seqlens_q.tolist() == [0, 1, 4, 6]
    assert x.last_token_indices.tolist() == [0, 3, 5]
    assert x.block_tables[0].tolist() == [[7, 3], [5, 0], [9, 2]]
    assert x.slot_mappings[0].tolist() == [3 * 16 + 4, 5 * 16, 5 * 16 + 1, 5 * 16 + 2, 9 * 16 + 15, 2 * 16]
    assert x.token_ids.dtype == np.int32 and x.slot_mappings[0].dtype == np.int64


def test_two_groups_with_their_own_blocks():
    x = build_step_inputs([ScheduledRow([1, 2], 8, [[4], [6, 1]])], [16, 8])
    assert x.slot_mappings[0].tolist() == [4 * 16 + 8, 4 * 16 + 9]
    assert x.slot_mappings[1].tolist() == [1 * 8 + 0, 1 * 8 + 1]


def test_too_few_blocks_is_an_error():
    with pytest.raises(ValueError, match="row 0: 1 blocks of 16 cannot hold 17 tokens"):
        build_step_inputs([ScheduledRow([1], 16, [[3]])], [16])


def test_empty_rows_rejected():
    with pytest.raises(ValueError):
        build_step_inputs([], [16])
    with pytest.raises(ValueError, match="row 0 has no scheduled tokens"):
        build_step_inputs([ScheduledRow([], 0, [[1]])], [16])


def test_sliding_window_tables_drop_blocks_vllm_has_freed():
    # vLLM frees out-of-window blocks of a sliding-window request without
    # telling the worker (the ids may already belong to another request):
    # entries wholly below the first query's window become the null block.
    rows = [ScheduledRow([7], 100, [[11, 12, 13, 14, 15, 16, 17]]),  # decode at 100, window 32: from 69
            ScheduledRow([1, 2, 3], 40, [[21, 22, 23, 24]]),  # chunk from 40: window from 9
            ScheduledRow([5], 10, [[31]])]  # young request: nothing out of window
    x = build_step_inputs(rows, [16], sliding_windows=[32])
    assert x.block_tables[0].tolist() == [[0, 0, 0, 0, 15, 16, 17], [21, 22, 23, 24, 0, 0, 0], [31, 0, 0, 0, 0, 0, 0]]
    assert x.slot_mappings[0].tolist() == [17 * 16 + 4, 23 * 16 + 8, 23 * 16 + 9, 23 * 16 + 10, 31 * 16 + 10]
    full = build_step_inputs(rows, [16])
    assert full.block_tables[0][0].tolist() == [11, 12, 13, 14, 15, 16, 17]


def test_windowed_attention_never_reads_the_dropped_blocks(rng):
    # The same attention with the freed blocks' ids kept, or nulled and the
    # blocks filled with garbage, gives identical results.
    import mlx.core as mx

    from vllm_metal.native import ops

    block, window, heads, dim = 16, 32, 2, 64
    rows = [ScheduledRow([7], 100, [[1, 2, 3, 4, 5, 6, 7]]), ScheduledRow([1, 2, 3], 40, [[8, 9, 10]])]
    keys = rng.standard_normal((12, block, heads, dim)).astype(np.float32)
    values = rng.standard_normal((12, block, heads, dim)).astype(np.float32)
    q = mx.array(rng.standard_normal((4, heads, dim)).astype(np.float32))
    kept = build_step_inputs(rows, [block])
    nulled = build_step_inputs(rows, [block], sliding_windows=[window])
    garbage_k, garbage_v = keys.copy(), values.copy()
    for blk in (1, 2, 3, 4, 0):  # the blocks dropped from the first row, and the null block
        garbage_k[blk] = np.nan
        garbage_v[blk] = np.nan

    def attend(inputs, k, v):
        return np.array(ops.paged_attention(q, mx.array(k), mx.array(v), mx.array(inputs.block_tables[0]),
                                            mx.array(inputs.seq_lens), mx.array(inputs.cu_seqlens_q),
                                            scale=dim ** -0.5, sliding_window=window))

    expected = attend(kept, keys, values)
    np.testing.assert_array_equal(attend(nulled, keys, values), expected)
    assert np.isfinite(attend(nulled, garbage_k, garbage_v)).all()
    np.testing.assert_array_equal(attend(nulled, garbage_k, garbage_v), expected)
