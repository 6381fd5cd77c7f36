"""Async scheduling's placeholder drafts replaced by the runner's own
(speculative/async_drafts.py), against vLLM's scheduler semantics: the
scheduler's optimistic position (every draft of the last step accepted)
rolled back by that step's rejections lands on the row's real position."""

from dataclasses import dataclass, field

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

from vllm_metal.speculative.async_drafts import finished, substitute


@dataclass
class State:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def scheduler_output(num_scheduled: dict[str, int], spec: dict[str, list[int]]) -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                           num_scheduled_tokens=num_scheduled,
                           total_num_scheduled_tokens=sum(num_scheduled.values()),
                           scheduled_spec_decode_tokens=spec, scheduled_encoder_inputs={},
                           num_common_prefix_blocks=[], finished_req_ids=set(), free_encoder_mm_hashes=[])


def test_placeholders_take_the_runners_drafts_from_the_real_position():
    k = 3
    params = SamplingParams(max_tokens=50)
    # "a": the last step verified 3 drafts and accepted 1 (2 tokens out); the scheduler assumed 3
    # accepted: its num_computed is 2 past the real one. "b": prefilling (no placeholders).
    # "c": decoding, drafted only 1 of 3 after its step. "d": its last step reached max_tokens.
    a = State("a", list(range(10)), params, 0, [7, 8, 9, 5, 6])  # 15 tokens known, 14 in the cache
    b = State("b", list(range(40)), params, 16)
    c = State("c", list(range(8)), params, 0, [1, 2])
    d = State("d", list(range(8)), SamplingParams(max_tokens=2), 0, [1, 2])
    a.num_computed_tokens = 14 + 2
    c.num_computed_tokens = 9
    d.num_computed_tokens = 9
    so = scheduler_output({"a": 1 + k, "b": 16, "c": 1 + k, "d": 1 + k},
                          {"a": [-1] * k, "c": [-1] * k, "d": [-1] * k})
    drafts = {"a": [4, 4, 4, 4], "c": [9], "d": []}
    out = substitute(so, [a, b, c, d], drafts, max_model_len=1000, newest=k + 1)
    assert out.so.scheduled_spec_decode_tokens == {"a": [4, 4, 4], "c": [9]}  # as many as placeholders
    assert out.so.num_scheduled_tokens == {"a": 4, "b": 16, "c": 2, "d": 1}
    assert out.so.total_num_scheduled_tokens == 23
    assert (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens, d.num_computed_tokens) == \
        (14, 16, 9, 9)
    # vLLM counts c's 2 missing drafts as proposed (rejected); d finished: vLLM counts nothing for it.
    assert (out.padded_rows, out.padded_drafts) == (0, 2)
    assert drafts["a"] == [4, 4, 4, 4]  # the proposal itself is left alone
    assert so.scheduled_spec_decode_tokens["a"] == [-1] * k  # vLLM's own output is left alone


def test_a_request_without_drafts_is_counted_as_vllm_counts_it():
    s = State("a", [1, 2, 3], SamplingParams(max_tokens=50), 5, [4, 5, 6])
    out = substitute(scheduler_output({"a": 3}, {"a": [-1, -1]}), [s], {}, 1000, 3)
    assert out.so.num_scheduled_tokens == {"a": 1} and out.so.scheduled_spec_decode_tokens == {}
    assert (out.padded_rows, out.padded_drafts) == (1, 2) and s.num_computed_tokens == 5


def test_real_drafts_pass_through():
    """Synchronous scheduling, or drafts a grammar check wrote back: nothing to substitute."""
    s = State("a", [1, 2, 3], SamplingParams(max_tokens=50), 3, [4])
    so = scheduler_output({"a": 3}, {"a": [7, -1]})
    assert substitute(so, [s], {"a": [9, 9]}, 1000, 3).so.scheduled_spec_decode_tokens == {"a": [7, -1]}
    assert s.num_computed_tokens == 3


def test_finished_is_vllms_check_stop_over_the_newest_tokens():
    eos = SamplingParams(max_tokens=50)
    eos.update_from_generation_config({}, eos_token_id=2)
    stop = SamplingParams(max_tokens=50, stop_token_ids=[9])
    assert finished(State("a", [1], eos, 0, [5, 2, 6]), 1000, newest=3)  # an accepted EOS before the bonus
    assert not finished(State("a", [1], eos, 0, [2, 5, 6, 7]), 1000, newest=3)  # older: not this step's
    assert finished(State("a", [1], stop, 0, [5, 9]), 1000, newest=2)
    assert finished(State("a", [1], SamplingParams(max_tokens=3), 0, [5, 6, 7]), 1000, newest=1)
    assert finished(State("a", [1, 2, 3], stop, 0, [5]), 4, newest=1)  # max_model_len
    assert not finished(State("a", [1], stop, 0, []), 1000, newest=1)
    ignore = SamplingParams(max_tokens=50, ignore_eos=True)
    assert not finished(State("a", [1], ignore, 0, [5, 2]), 1000, newest=2)
