"""Batch preparation, without a model."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_metal.step_inputs import ScheduledRow, build_step_inputs


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
