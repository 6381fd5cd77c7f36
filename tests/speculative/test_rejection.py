"""vLLM's rejection sampling for n-gram drafts (speculative/rejection.py)
against its definition: greedy rows keep drafts while they equal the
target's argmax; random rows return tokens distributed exactly as the
target (chi-square against the exact distribution, and a mutation of the
rule is caught)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from vllm_metal.speculative import rejection
from vllm_metal.speculative.ngram import NgramDrafter, TokenHistory


def chi_square_p(counts: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's goodness of fit; bins with expected count < 5 merged into one."""
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_greedy_keeps_drafts_while_they_equal_the_argmax():
    assert rejection.accept_greedy([5, 6, 7], [5, 6, 7], 9) == [5, 6, 7, 9]  # all kept, then the bonus
    assert rejection.accept_greedy([5, 6, 7], [5, 2, 7], 9) == [5, 2]  # first mismatch replaced, row ends
    assert rejection.accept_greedy([5, 6, 7], [1, 6, 7], 9) == [1]
    assert rejection.accept_greedy([-1, -1], [3, 4], 9) == [3]  # padding is always rejected


def test_greedy_from_logits_is_the_logits_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    params = SamplingParams(temperature=0)
    assert rejection.accept([1, 0], params, None, 2, logits=logits) == [1, 0, 2]
    assert rejection.accept([1, 2], params, None, 2, logits=logits) == [1, 0]


P = np.array([0.05, 0.4, 0.25, 0.2, 0.1])  # the target's next-token distribution (at temperature 1)


@pytest.mark.parametrize("draft", [1, 4])  # a likely and an unlikely draft
def test_random_rows_keep_the_target_distribution(draft):
    """One draft per row: the returned first token must follow P exactly,
    whichever token was drafted (accepted with P(d), else drawn from P
    without d); the bonus follows only an accepted draft."""
    logits = torch.log(torch.tensor(P, dtype=torch.float32)).reshape(1, -1)
    params = SamplingParams(temperature=1.0, seed=0)
    g = torch.Generator().manual_seed(1234)
    n = 20000
    first = np.zeros(len(P))
    bonus_after = 0
    for _ in range(n):
        out = rejection.accept([draft], params, g, bonus=99, logits=logits)
        first[out[0]] += 1
        bonus_after += len(out) == 2
        assert (len(out) == 2) == (out[0] == draft)
    assert chi_square_p(first, n * P) > 1e-3
    assert abs(bonus_after / n - P[draft]) < 4 * np.sqrt(P[draft] * (1 - P[draft]) / n)


def test_always_accepting_the_draft_would_be_caught():
    """The test above can fail: the distribution of 'always keep the draft' is rejected."""
    n = 20000
    first = np.zeros(len(P))
    first[4] = n
    assert chi_square_p(first, n * P) < 1e-6


def test_temperature_and_top_k_shape_the_target():
    """Temperature 0.5 and top_k 3 on P: the target is softmax(2 log P) over P's 3 most likely tokens."""
    logits = torch.log(torch.tensor(P, dtype=torch.float32)).reshape(1, -1)
    params = SamplingParams(temperature=0.5, top_k=3, seed=0)
    target = np.where(np.isin(np.arange(5), [1, 2, 3]), P ** 2, 0)
    target /= target.sum()
    np.testing.assert_allclose(rejection.target_probs(logits, params)[0].numpy(), target, atol=1e-6)
    g = torch.Generator().manual_seed(7)
    n = 20000
    first = np.zeros(len(P))
    for _ in range(n):
        first[rejection.accept([0], params, g, bonus=99, logits=logits)[0]] += 1
    assert first[0] == first[4] == 0  # outside top-k: never returned, even as the draft
    assert chi_square_p(first, n * target) > 1e-3


def test_seeded_rows_repeat():
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=0.9, seed=3)
    runs = [rejection.accept([1, 2, 3], params, torch.Generator().manual_seed(11), 7, logits=logits)
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_ngram_drafts_equal_vllms_proposer(rng):
    """vLLM's NgramProposer over its [requests, max_model_len] array against
    ours over per-request histories grown token by token."""
    from types import SimpleNamespace

    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    max_len, k = 256, 4
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(prompt_lookup_min=2, prompt_lookup_max=4,
                                                             num_speculative_tokens=k),
                          model_config=SimpleNamespace(max_model_len=max_len),
                          scheduler_config=SimpleNamespace(max_num_seqs=8),
                          parallel_config=SimpleNamespace(tensor_parallel_size=1))
    theirs = NgramProposer(cfg)
    ours = NgramDrafter(2, 4, k, max_len)
    seqs = [list(rng.integers(0, 6, size=int(rng.integers(3, 40)))) for _ in range(8)]
    prompts = [s[:3] for s in seqs]
    found = 0
    for cut in range(3, 41):
        token_ids = np.zeros((8, max_len), np.int32)
        lens = np.array([min(cut, len(s)) for s in seqs], np.int32)
        for i, s in enumerate(seqs):
            token_ids[i, :lens[i]] = s[:lens[i]]
        want = theirs.propose(k, [[1]] * 8, lens, token_ids)
        got = [ours.propose(str(i), prompts[i], [int(t) for t in s[3:lens[i]]], k) for i, s in enumerate(seqs)]
        assert got == want
        found += sum(map(bool, got))
    assert found > 20  # matches were found, not only empty proposals


def test_token_history_follows_rewrites():
    h = TokenHistory()
    assert h.sync([1, 2], [3]).tolist() == [1, 2, 3]
    assert h.sync([1, 2], [3, 4, 5]).tolist() == [1, 2, 3, 4, 5]
    assert h.sync([1, 2], [3]).tolist() == [1, 2, 3]  # truncated (a preempted request's tokens resent)
    assert h.sync([1, 2], [3, 7]).tolist() == [1, 2, 3, 7]
    assert h.sync([1, 2], [3, 8, 9]).tolist() == [1, 2, 3, 8, 9]  # the last kept token rewritten: rebuilt
    assert h.sync([1, 2], list(range(300))).tolist() == [1, 2, *range(300)]  # grown past the buffer
