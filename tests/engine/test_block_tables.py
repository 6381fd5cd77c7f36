"""The persistent batch's incrementally kept block tables against tables
built from scratch, through random sequences of what vLLM's scheduler does
between steps: requests joining, gaining blocks, sitting a step out,
being preempted and resuming with new blocks, and finishing."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm_metal.engine.block_tables import BlockTables
from vllm_metal.engine.persistent_batch import PersistentBatch
from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs

GROUPS = 2


def scheduler_output(new, cached, scheduled, finished) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()), scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, num_common_prefix_blocks=[0] * GROUPS, finished_req_ids=set(finished),
        free_encoder_mm_hashes=[])


class FakeScheduler:
    """Random scheduler decisions over a pool of requests; `owned` is the
    truth: each live request's blocks per group."""

    def __init__(self, rng):
        self.rng = rng
        self.next_id = 0
        self.next_block = 1
        self.owned: dict[str, list[list[int]]] = {}
        self.computed: dict[str, int] = {}
        self.preempted: set[str] = set()

    def blocks(self, n):
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def step(self) -> SchedulerOutput:
        rng = self.rng
        finished = [r for r in self.owned if rng.random() < 0.1]
        for r in finished:
            del self.owned[r], self.computed[r]
            self.preempted.discard(r)
        new = []
        for _ in range(rng.integers(0, 4)):
            rid = f"r{self.next_id}"
            self.next_id += 1
            self.owned[rid] = [self.blocks(int(rng.integers(1, 6))) for _ in range(GROUPS)]
            self.computed[rid] = 0
            new.append(NewRequestData(rid, [1] * 4, [], SamplingParams(max_tokens=64), None,
                                      tuple(list(b) for b in self.owned[rid]), 0, None))
        new_ids = {n.req_id for n in new}
        cached = CachedRequestData.make_empty()
        scheduled = {n.req_id: 1 for n in new}
        for rid in self.owned:
            if rid in new_ids:
                continue
            u = rng.random()
            if rid in self.preempted:
                if u < 0.5:  # resumes, with all-new blocks
                    self.preempted.discard(rid)
                    self.owned[rid] = [self.blocks(int(rng.integers(1, 5))) for _ in range(GROUPS)]
                    self.add_cached(cached, rid, tuple(list(b) for b in self.owned[rid]), resumed=True)
                    scheduled[rid] = 1
            elif u < 0.1:
                self.preempted.add(rid)  # not scheduled, its blocks gone
            elif u < 0.2:
                pass  # sits this step out (token budget), keeps its blocks
            else:
                grow = [self.blocks(int(rng.integers(0, 3))) for _ in range(GROUPS)]
                for mine, ids in zip(self.owned[rid], grow):
                    mine.extend(ids)
                self.add_cached(cached, rid, tuple(grow) if any(grow) else None)
                scheduled[rid] = 1
        return scheduler_output(new, cached, scheduled, finished)

    def add_cached(self, cached, rid, new_blocks, resumed=False):
        cached.req_ids.append(rid)
        if resumed:
            cached.resumed_req_ids.add(rid)
        cached.new_token_ids.append([])
        cached.new_block_ids.append(new_blocks)
        cached.num_computed_tokens.append(self.computed[rid])
        cached.num_output_tokens.append(0)


@pytest.mark.parametrize("seed", range(6))
def test_kept_tables_equal_tables_built_from_scratch(seed):
    rng = np.random.default_rng(seed)
    sched = FakeScheduler(rng)
    batch = PersistentBatch(SimpleNamespace(all=[]))
    checked = 0
    for _ in range(120):
        so = sched.step()
        batch.update(so)
        if not batch.rows:
            continue
        assert None not in batch.rows and set(batch.rows) == set(so.num_scheduled_tokens)
        assert batch.row_of == {r: i for i, r in enumerate(batch.rows)}
        states = batch.states()
        for s in states:  # the lists the batch keeps are vLLM's truth
            assert s.block_ids == sched.owned[s.req_id]
        kept = batch.block_table_view()
        rows = [ScheduledRow([1], 0, sched.owned[s.req_id]) for s in states]
        fresh = build_step_inputs(rows, [16, 8])
        via_kept = build_step_inputs([ScheduledRow([1], 0) for _ in states], [16, 8], tables=kept)
        for g in range(GROUPS):
            np.testing.assert_array_equal(via_kept.block_tables[g], fresh.block_tables[g])
            np.testing.assert_array_equal(via_kept.slot_mappings[g], fresh.slot_mappings[g])
        checked += 1
    assert checked > 50 and batch.num_resumed > 0


def test_view_is_a_copy_padded_with_the_null_block():
    t = BlockTables(rows=1, blocks=1)
    t.set_row(0, [[5, 6, 7]])
    t.set_row(3, [[9]])  # grows rows and width
    t.set_row(1, [[1, 2]])
    t.set_row(2, [[]])
    t.move(3, 2)
    (table, counts), = t.view(3)
    assert table.tolist() == [[5, 6, 7], [1, 2, 0], [9, 0, 0]] and counts.tolist() == [3, 2, 1]
    table[:] = -1  # a step masking its copy leaves the kept table alone
    t.append(1, [[3, 4]])
    (table, counts), = t.view(2)
    assert table.tolist() == [[5, 6, 7, 0], [1, 2, 3, 4]] and counts.tolist() == [3, 4]


def test_tables_that_do_not_match_the_rows_are_refused():
    t = BlockTables()
    t.set_row(0, [[1]])
    with pytest.raises(ValueError, match="do not match 2 rows in 1 groups"):
        build_step_inputs([ScheduledRow([1], 0), ScheduledRow([1], 0)], [16], tables=t.view(1))
    with pytest.raises(ValueError, match="row 0: 1 blocks of 16 cannot hold 17 tokens"):
        build_step_inputs([ScheduledRow([1], 16)], [16], tables=t.view(1))
