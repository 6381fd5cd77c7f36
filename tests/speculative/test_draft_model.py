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
