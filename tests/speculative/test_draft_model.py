"""The draft-model proposer's bookkeeping without a model: how far a request may draft,
that only the drafts the budget keeps are drafted (the passes cost a step each), which
tokens a pass-1 catch-up writes, and who may start drafting (a catch-up costs a prefill)."""

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

    def propose(self, rows, req_ids, positions, tail, want, inputs_for):
        self.asked = (rows.tolist(), positions.tolist(), [tail(r, int(p))[-1] for r, p in zip(req_ids, positions)],
                      list(want))
        return [[7] * n for n in want]


def state(req_id, n_prompt, output, **params):
    return SimpleNamespace(req_id=req_id, prompt_token_ids=list(range(n_prompt)), output_token_ids=output,
                           num_tokens=n_prompt + len(output),
                           sampling_params=SamplingParams(temperature=0, **params))


def test_the_budget_decides_before_the_passes_run(monkeypatch):
    monkeypatch.setenv("VLLM_METAL_SPEC_BUDGET", "1")
    spec = Speculator(SimpleNamespace(method="draft_model", num_speculative_tokens=4), 512, custom_logitsprocs=False)
    spec.model = FakeDrafter()
    spec.model.written = {"a": 10, "d": 41}  # both drafted before (no catch-up to wait for: the gate below)
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


def test_pass_one_writes_every_token_since_the_request_last_drafted(monkeypatch):
    """Pass 1's rows: the request's whole history the first time (a catch-up), then only
    the tokens since (a rejected draft's slot is written again with the accepted token);
    a preempted request starts over."""
    import mlx.core as mx

    from vllm_metal.speculative.speculator import tail

    seen = []

    class Model:  # records the rows of each pass, drafts token 100 + pass
        def forward(self, kv, inputs, logit_rows, greedy):
            seen.append((inputs.rows, inputs.starts, list(logit_rows)))
            return mx.full((len(logit_rows),), 100 + len(seen) - 1, mx.int32)

    def inputs_for(rows, tokens, starts):
        return SimpleNamespace(rows=[list(t) for t in tokens], starts=[int(s) for s in starts])

    d = ModelDrafter(Model(), k=3, max_model_len=512)
    d.kv = SimpleNamespace(arrays=lambda: [])
    a, b = state("a", 5, [50]), state("b", 3, [60, 61])
    tails = {"a": a, "b": b}
    drafts = d.propose(np.array([0, 1]), ["a", "b"], np.array([5, 4]), lambda r, p: tail(tails[r], p), [3, 1],
                       inputs_for)
    assert drafts == [[100, 101, 102], [100]]
    assert seen[0] == ([[0, 1, 2, 3, 4, 50], [0, 1, 2, 60, 61]], [0, 0], [5, 10])  # both whole histories
    assert seen[1][0] == [[0]] and seen[1][1] == [6] and seen[2][1] == [7]  # a alone: positions 6, 7
    assert d.written == {"a": 6, "b": 5} and d.caught_up == 11
    seen.clear()
    a.output_token_ids += [100, 7]  # its first draft accepted, then the target's own token
    a.num_tokens += 2
    d.propose(np.array([0]), ["a"], np.array([7]), lambda r, p: tail(tails[r], p), [1], inputs_for)
    assert seen == [([[100, 7]], [6], [1])]  # positions 6 (rewritten) and 7 only
    d.restart(["a"])
    seen.clear()
    d.propose(np.array([0]), ["a"], np.array([7]), lambda r, p: tail(tails[r], p), [1], inputs_for)
    assert seen[0][1] == [0] and len(seen[0][0][0]) == 8


def test_one_request_at_a_time_catches_up_until_drafts_are_known_to_pay():
    from vllm_metal.speculative.budget import DraftBudget
    from vllm_metal.speculative.draft_model import MIN_POOLED, REPROBE, CatchUpGate

    gate, b = CatchUpGate(), DraftBudget(pooled=True)
    keep = {"a": 4, "b": 4, "c": 4}
    assert gate.step(dict(keep), set(), b) == {"a": 4, "b": 0, "c": 0}  # no evidence: one catch-up
    assert gate.step(dict(keep), {"a"}, b) == {"a": 4, "b": 0, "c": 0}  # ... while it drafts
    assert gate.step({"a": 0, "b": 4, "c": 4}, {"a"}, b) == {"a": 0, "b": 4, "c": 0}  # a stopped: the next one
    assert gate.step(dict(keep), set(), None) == keep  # without a budget everybody drafts (vLLM's way)
    b.per_row, b.base = 0.01, 0.03
    for _ in range(MIN_POOLED):
        b.observe_verify("a", 4, 4)
    assert gate.step(dict(keep), {"a"}, b) == keep  # a fit and the evidence: the budget decides
    # A draft model whose drafts are rejected: a new request's prior is the pool's (it is not kept).
    bad = DraftBudget(pooled=True)
    bad.per_row, bad.base = 0.01, 0.03
    for _ in range(3 * MIN_POOLED):
        bad.observe_verify("a", 4, 0)
    assert bad.acceptance("new") < 0.1 and DraftBudget().acceptance("new") == 0.5
    assert bad.allot({"new": 4}, 8) == {"new": 0}
    for _ in range(REPROBE - 1):
        assert gate.step({"new": 0}, {"a"}, bad) == {"new": 0}
    assert bad.pool_rows == 3 * MIN_POOLED
    gate.step({"new": 0}, {"a"}, bad)
    assert bad.pool_rows == 0 and gate.reprobes == 1  # the evidence dropped: one request may probe again
    assert bad.acceptance("new") == 0.5
    assert gate.step({"new": 4, "other": 4}, {"a"}, bad) == {"new": 4, "other": 0}


def test_mtp_pairs_in_the_step_graph_and_the_rows_pass_one_reads():
    """Each position pairs with the token after it where the host knows that token
    before the step (the next prompt chunk's first token, a scheduled draft); a
    row's last position waits for its sampled token (pass 1), which reads one of
    the hidden rows of its last 1 + drafts positions; placeholder drafts pair with nothing."""
    import mlx.core as mx

    from vllm_metal.engine.persistent_batch import RequestState
    from vllm_metal.engine.step_inputs import ScheduledRow
    from vllm_metal.speculative.mtp import MtpDrafter

    class Fake(MtpDrafter):
        def __init__(self):
            self.kv = SimpleNamespace(arrays=lambda: [])
            self.ran = None
            self.pending = {}

        def run(self, inputs, tokens, previous):
            self.ran = (inputs, tokens.tolist(), previous.tolist())

    def req(req_id, prompt, output=()):
        return SimpleNamespace(req_id=req_id, prompt_token_ids=list(prompt), output_token_ids=list(output),
                               num_tokens=len(prompt) + len(output),
                               tokens=lambda a, b, p=list(prompt) + list(output): p[a:b])

    assert callable(RequestState.tokens)  # the real states' method the fakes stand in for
    prompt = list(range(100, 110))
    states = [req("chunk", prompt), req("last", prompt), req("verify", prompt, [7]), req("padded", prompt, [8])]
    rows = [ScheduledRow(prompt[0:4], 0),  # a middle chunk: its next token (104) is known
            ScheduledRow(prompt[6:10], 6),  # the prompt's last chunk: samples
            ScheduledRow([7, 51, 52], 10),  # its newest token and two drafts
            ScheduledRow([8, 0, 0], 10)]  # placeholders
    spec = {"verify": [51, 52], "padded": [-1, -1]}
    hidden = mx.arange(14)[:, None].astype(mx.float32)  # packed row r's hidden state = r
    m = Fake()
    inputs_for = lambda rows, tokens, starts: (rows.tolist(), tokens, starts.tolist())  # noqa: E731
    out = m.write_step(rows, states, spec, hidden, inputs_for)
    batch_rows, tokens, starts = m.ran[0]
    assert batch_rows == [0, 1, 2] and starts == [0, 6, 10]
    assert tokens == [[101, 102, 103, 104], [107, 108, 109], [51, 52]]
    assert m.ran[2] == [[0], [1], [2], [3], [4], [5], [6], [8], [9]]  # the hidden rows before each pair
    assert m.frontier_at == {1: (0, 9), 2: (1, 10), 3: (4, 10)}
    assert m.frontier.tolist() == [[7], [8], [9], [10], [11]] and len(out) == 1
    # "verify" did not draft after that step (it got 61 at 11): its pair at 10 waits for its next row.
    m.pending = {"verify": (10, 61, mx.array([[50.0]])), "chunk": (99, 1, mx.array([[0.0]]))}  # chunk's: stale
    states[2] = req("verify", prompt, [7, 61])
    m.write_step([rows[0], ScheduledRow([61], 11)], [states[0], states[2]], {}, hidden, inputs_for)
    batch_rows, tokens, starts = m.ran[0]
    assert batch_rows == [0, 1] and starts == [0, 10] and tokens == [[101, 102, 103, 104], [61]]
    assert m.ran[2] == [[0], [1], [2], [3], [50]] and m.pending == {}  # the carried row after the step's
