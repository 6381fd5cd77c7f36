"""The drafting budget (speculative/budget.py): vLLM's drafts kept until a
step's cost has been measured; then a draft is kept only while its expected
tokens (the product of the acceptance rates of its depth and every depth
before it) pay for the row it adds at the step's measured cost."""

from __future__ import annotations

import numpy as np

from vllm_metal.speculative.budget import DraftBudget


def fitted(base: float, per_row: float, rng) -> DraftBudget:
    b = DraftBudget()
    for rows in rng.integers(8, 41, size=40):
        b.observe_step(int(rows), base + per_row * rows + rng.normal(0, 1e-4))
    return b


def with_acceptance(b: DraftBudget, req: str, accepted: int, rejected: int) -> None:
    for _ in range(rejected):
        b.observe_verify(req, 4, 0)
    for _ in range(accepted // 4):
        b.observe_verify(req, 4, 4)


def test_every_draft_is_kept_until_the_cost_is_measured():
    b = DraftBudget()
    assert b.allot({"a": 4, "b": 2}, 8) == {"a": 4, "b": 2}
    for _ in range(20):  # a step of constant size fits nothing
        b.observe_step(8, 0.05)
    assert b.per_row is None and b.allot({"a": 4}, 8) == {"a": 4}


def test_the_cost_fit_recovers_base_and_per_row(rng):
    b = fitted(0.025, 0.003, rng)
    assert abs(b.per_row - 0.003) < 2e-4 and abs(b.base - 0.025) < 5e-3


def test_cheap_rows_keep_every_draft(rng):
    b = fitted(0.025, 0.00001, rng)  # a GPU-like step: rows nearly free (10 us)
    for r in "abcdefgh":
        with_acceptance(b, r, 4, 8)  # acceptance ~0.3
    assert b.allot(dict.fromkeys("abcdefgh", 4), 8) == dict.fromkeys("abcdefgh", 4)


def test_expensive_rows_keep_only_the_drafts_that_pay(rng):
    """Eight requests, rows at 3 ms on a 25 ms step (the 2-core CPU's
    numbers): a request accepting ~98% keeps all four drafts; requests at
    ~50% keep at most one (a second is worth 0.25 token for 3 ms, against
    the step's ~0.15 token/ms); and no single draft more or fewer makes the
    step's tokens per second higher."""
    b = fitted(0.025, 0.003, rng)
    for r in "abcdefg":
        with_acceptance(b, r, 8, 8)
    with_acceptance(b, "h", 200, 2)
    proposed = dict.fromkeys("abcdefgh", 4)
    keep = b.allot(proposed, 8)
    assert keep["h"] == 4 and all(keep[r] <= 1 for r in "abcdefg"), keep
    assert b.trimmed == sum(proposed.values()) - sum(keep.values())

    def rate(k):
        tokens = 8 + sum(sum(b.worth(r, j) for j in range(1, n + 1)) for r, n in k.items())
        return tokens / (b.base + b.per_row * (8 + sum(k.values())))
    for r in keep:
        for other in (keep[r] - 1, keep[r] + 1):
            if 0 <= other <= proposed[r]:
                assert rate(keep) >= rate({**keep, r: other}) - 1e-12, (r, other)


def test_a_request_keeps_a_prefix_of_its_drafts(rng):
    b = fitted(0.025, 0.003, rng)
    with_acceptance(b, "a", 12, 4)
    keep = b.allot({"a": 3, "b": 4}, 2)
    assert all(0 <= keep[r] <= n for r, n in {"a": 3, "b": 4}.items())
    b.forget(["a"])
    assert b.acceptance("a") == 0.5  # the prior again


def test_a_drafting_models_passes_are_fitted_and_paid_once_per_depth():
    """t = base + per_row x rows + per_pass x passes is recovered from steps whose rows and
    passes vary apart; a depth opens only when the drafts sharing its pass pay for it."""
    from vllm_metal.speculative.budget import DraftBudget

    b = DraftBudget(passes=True)
    rng = np.random.default_rng(0)
    for _ in range(40):
        rows, passes = int(rng.integers(8, 30)), int(rng.integers(0, 4))
        b.observe_step(rows, 0.020 + 0.002 * rows + 0.010 * passes, passes)
    assert abs(b.base - 0.020) < 1e-9 and abs(b.per_row - 0.002) < 1e-9 and abs(b.per_pass - 0.010) < 1e-9
    for r in "abcdefgh":  # acceptance 0.8 at each depth (prior 1:1 included)
        b.observe_verify(r, 4, 4)
        b.accepted[r], b.tried[r] = [7.0] * 3, [8.0] * 3
    everyone = b.allot(dict.fromkeys("abcdefgh", 3), 8)
    # Eight requests share the first pass: 6.4 tokens for 26 ms on a 36 ms step pays; the second
    # depth's 5.1 tokens for another 26 ms would lower the rate.
    assert everyone == dict.fromkeys("abcdefgh", 1)
    alone = b.allot({"a": 3}, 8)  # one drafting request in a batch of 8: a pass for 0.8 tokens does not pay
    assert alone == {"a": 0}
    b.per_pass = 0.0  # without pass costs the same request drafts
    assert b.allot({"a": 3}, 8)["a"] > 0


def test_each_depth_has_its_own_acceptance(rng):
    """A chained drafter (an MTP layer fed its own output) whose first drafts are taken 90% of the
    time and its second ones 10%: one draft pays, a second does not (one rate for every depth,
    (accepted drafts / rows) ~ 0.5 a depth, would have kept two)."""
    b = DraftBudget(passes=True)
    for _ in range(40):
        rows, passes = int(rng.integers(1, 5)), int(rng.integers(0, 4))
        b.observe_step(rows, 0.040 + 0.004 * rows + 0.006 * passes, passes)
    for accepted, rows in ((0, 10), (1, 81), (2, 9)):  # depth 1: 90 of 100 taken; depth 2: 9 of 90
        for _ in range(rows):
            b.observe_verify("a", 3, accepted)
    assert abs(b.acceptance("a", 1) - 0.9) < 0.02 and abs(b.acceptance("a", 2) - 0.1) < 0.03
    assert b.worth("a", 2) < 0.1
    assert b.allot({"a": 3}, 1) == {"a": 1}
    b.observe_verify("c", 3, 3)
    assert b.acceptance("c", 1) == b.acceptance("c", 3) == 2 / 3  # each depth tried and taken once, prior 1:1
    b.forget(["a", "c"])
    assert b.acceptance("a", 2) == 0.5 and "c" not in b.tried
