"""The draft-model proposer's bookkeeping without a model: how far a request may draft,
and that only the drafts the budget keeps are drafted (the passes cost a step each)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from vllm import SamplingParams
from vllm_metal.speculative.draft_model import ModelDrafter
from vllm_metal.speculative.speculator import Speculator


def test_reach_stays_within_the_blocks_and_max_model_len():
    d = ModelDrafter(model=None, k=4, max_model_len=100)
    assert d.reach(10, room=32) == 4  # vLLM's k lookahead slots: the full k
    assert d.reach(30, room=32) == 2  # passes write positions 30, 31 only
    assert d.reach(32, room=32) == 0
    assert d.reach(97, room=128) == 2  # drafts at 98, 99: the last positions a request may have
    assert d.reach(99, room=128) == 0


class FakeDrafter(ModelDrafter):
    def __init__(self):
        super().__init__(model=None, k=4, max_model_len=512)
        self.asked = None

    def propose(self, rows, positions, last_tokens, want, inputs_for):
        self.asked = (rows.tolist(), positions.tolist(), list(last_tokens), list(want))
        return [[7] * n for n in want]


def state(req_id, n_prompt, output, **params):
    return SimpleNamespace(req_id=req_id, prompt_token_ids=list(range(n_prompt)), output_token_ids=output,
                           num_tokens=n_prompt + len(output),
                           sampling_params=SamplingParams(temperature=0, **params))


def test_the_budget_decides_before_the_passes_run(monkeypatch):
    monkeypatch.setenv("VLLM_METAL_SPEC_BUDGET", "1")
    spec = Speculator(SimpleNamespace(method="draft_model", num_speculative_tokens=4), 512, custom_logitsprocs=False)
    spec.model = FakeDrafter()
    states = [state("a", 10, [5]), state("b", 20, [6], logprobs=1), state("c", 30, []), state("d", 40, [8, 9])]
    room = np.array([64, 64, 64, 42])
    spec.propose(states, [[5], [6], [], [9]], 4, None, room, inputs_for=None)
    # b asks for logprobs (no drafts), c got no token this step; d's blocks end at 42 (next token at 41)
    assert spec.model.asked == ([0, 3], [10, 41], [5, 9], [4, 1])
    assert spec.take().draft_token_ids == [[7] * 4, [], [], [7]]
    # a fitted cost that no draft pays for: nothing is drafted, no pass runs
    spec.budget.per_row, spec.budget.base = 1.0, 0.001
    spec.model.asked = None
    spec.propose(states, [[5], [6], [], [9]], 4, None, room, inputs_for=None)
    assert spec.model.asked == ([], [], [], [])
    assert spec.take().draft_token_ids == [[], [], [], []]


def test_a_budget_without_a_spread_of_rows_probes_a_step_without_drafts():
    """A draft model proposes k every step: rows never vary and no fit exists. Every
    PROBE_EVERY-th step drafts nothing, the fit appears, and the budget decides from it."""
    from vllm_metal.speculative.budget import PROBE_EVERY, DraftBudget

    b = DraftBudget()
    kept = []
    for _ in range(40):
        keep = b.allot({"a": 4}, 1)
        kept.append(keep["a"])
        rows = 1 + keep["a"]
        b.observe_step(rows, 0.030 + (0.020 * keep["a"]))  # each draft costs a whole 20 ms draft pass
        b.observe_verify("a", keep["a"], 0) if keep["a"] else None  # nothing is ever accepted
    assert kept[:PROBE_EVERY] == [4] * PROBE_EVERY and 0 in kept[PROBE_EVERY:2 * PROBE_EVERY + 1]
    assert b.per_row is not None and abs(b.per_row - 0.020) < 1e-9
    assert kept[-10:] == [0] * 10  # the fit says no draft pays: none is kept


def test_the_draft_model_stops_writing_when_no_draft_pays_and_comes_back():
    from types import SimpleNamespace

    from vllm_metal.speculative.draft_model import OFF_AFTER, REPROBE, WritingSwitch

    sw, fitted = WritingSwitch(), SimpleNamespace(per_row=0.01)
    assert sw.step(["a", "b"], {"a": 2, "b": 0}, fitted) == {"a": 2, "b": 0}
    assert sw.step(["a"], {"a": 0}, SimpleNamespace(per_row=None)) == {"a": 0}  # no fit: no verdict
    for i in range(OFF_AFTER):
        assert sw.writing
        sw.step(["a", "b"], {"a": 0, "b": 0}, fitted)
    assert not sw.writing and sw.turned_off == 1
    for _ in range(REPROBE - 1):
        assert sw.step(["a", "c"], {"a": 3, "c": 3}, fitted) == {}  # off: nobody drafts
    assert not sw.writing
    sw.step(["c"], {"c": 3}, fitted)
    assert sw.writing  # back on: requests seen while it was off have holes in their draft cache
    assert sw.step(["a", "c", "d"], {"a": 3, "c": 3, "d": 3}, fitted) == {"d": 3}
    sw.forget(["a", "c"])
    assert not sw.holed & {"a", "c"}
    assert WritingSwitch().step(["a"], {"a": 0}, None) == {"a": 0}  # without a budget it never turns off
