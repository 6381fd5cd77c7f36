"""The pipeline scheduler's decode cadence (vllm_metal/distributed/scheduler.py)
and the vLLM 0.33 scheduler internals it relies on."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from vllm_metal.distributed.scheduler import PipelineScheduler, stagger_decodes


def req(step=0, prefill=False):
    return SimpleNamespace(next_decode_eligible_step=step, is_prefill_chunk=prefill)


def test_requests_ready_together_spread_over_the_lanes():
    requests = {r: req() for r in "abcd"}
    stagger_decodes(requests, list("abcd"), current_step=10, stages=2)
    steps = [requests[r].next_decode_eligible_step for r in "abcd"]
    assert steps == [12, 13, 12, 13]  # at least 2 steps on, alternating lanes
    requests = {r: req() for r in "abc"}
    stagger_decodes(requests, list("abc"), current_step=7, stages=3)
    assert sorted(requests[r].next_decode_eligible_step % 3 for r in "abc") == [0, 1, 2]


def test_a_request_joins_the_least_busy_lane_and_stays():
    # "a" decodes on even steps; "b" finishes its prefill on an even step too.
    requests = {"a": req(12), "b": req()}
    stagger_decodes(requests, ["b"], current_step=10, stages=2)
    assert requests["b"].next_decode_eligible_step == 13  # one step later, the other lane
    stagger_decodes(requests, ["a"], current_step=12, stages=2)
    stagger_decodes(requests, ["b"], current_step=13, stages=2)
    assert (requests["a"].next_decode_eligible_step, requests["b"].next_decode_eligible_step) == (14, 15)


def test_prefill_chunks_are_not_held_back():
    requests = {"p": req(prefill=True), "d": req()}
    stagger_decodes(requests, ["p", "d"], current_step=4, stages=2)
    assert requests["p"].next_decode_eligible_step == 0 and requests["d"].next_decode_eligible_step == 6


def test_the_vllm_internals_it_uses_are_there():
    # vLLM 0.33: the base scheduler skips running requests before their
    # next_decode_eligible_step, counts steps in current_step, and calls
    # _update_after_schedule once per schedule(). If this fails, vLLM changed
    # them: revisit distributed/scheduler.py.
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    schedule = inspect.getsource(Scheduler.schedule)
    assert "self.current_step < request.next_decode_eligible_step" in schedule
    assert "self.current_step += 1" in schedule and "self._update_after_schedule(" in schedule
    assert "next_decode_eligible_step" in inspect.getsource(Request.__init__)
    assert PipelineScheduler._update_after_schedule is not Scheduler._update_after_schedule
    assert list(inspect.signature(Scheduler._update_after_schedule).parameters) == ["self", "scheduler_output"]
