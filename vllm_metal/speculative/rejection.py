"""vLLM's rejection sampling for drafts without draft probabilities (n-gram):
the tokens a verified row returns, given its target logits or argmaxes.

Greedy row: each draft is kept while it equals the target's argmax at its
position; the first that differs is replaced by that argmax and ends the
row; all kept, the bonus token (the row's own sample) follows. Random row
(arXiv 2211.17192 with a one-hot draft distribution, as vLLM's
`rejection_random_sample_kernel` runs it with NO_DRAFT_PROBS): draft d at
position i is kept when p_i(d) >= u_i, u_i uniform in [0, 1) (float64);
the first rejected one is replaced by a token drawn from p_i with d's mass
removed (vLLM's recovered token: argmax of p / q, q ~ Exponential(1), one q
per request); all kept, the bonus follows. p_i is the target softmax after
vLLM's temperature, top-k and top-p (`apply_sampling_constraints`), so the
returned tokens follow the target distribution exactly. Placeholder drafts
(-1: scheduled padding) are always rejected. Seeded requests draw u and q
from their own generator in vLLM's order (bonus, then u, then q).
"""

from __future__ import annotations

import torch
from vllm.sampling_params import SamplingType
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch


def accept_greedy(drafts: list[int], target_argmax: list[int], bonus: int) -> list[int]:
    out = []
    for d, t in zip(drafts, target_argmax):
        out.append(t)
        if d != t:
            return out
    out.append(bonus)
    return out


def target_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """float32 [k, vocab]: the target distribution at each draft position."""
    logits = logits.to(torch.float32) / params.temperature
    vocab = logits.shape[-1]
    k = p = None
    if 0 < params.top_k < vocab:
        k = torch.full((logits.shape[0],), params.top_k, dtype=torch.int32)
    if params.top_p < 1.0:
        p = torch.full((logits.shape[0],), params.top_p, dtype=torch.float32)
    if k is not None or p is not None:
        logits = apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)
    return logits.softmax(dim=-1, dtype=torch.float32)


def accept_random(drafts: list[int], logits: torch.Tensor, params, generator: torch.Generator | None,
                  bonus: int) -> list[int]:
    probs = target_probs(logits, params)
    u = torch.empty(len(drafts), dtype=torch.float64)
    q = torch.empty(probs.shape[-1], dtype=torch.float32)
    if generator is not None:
        u.uniform_(generator=generator)
        q.exponential_(generator=generator)
    else:
        u.uniform_()
        q.exponential_()
    out = []
    for i, d in enumerate(drafts):
        if d >= 0 and float(probs[i, d]) >= float(u[i]):
            out.append(d)
            continue
        p = probs[i].clone()
        if d >= 0:
            p[d] = 0.0
        out.append(int(torch.argmax(p * q.reciprocal())))
        return out
    out.append(bonus)
    return out


def accept(drafts: list[int], params, generator, bonus: int, target_argmax: list[int] | None = None,
           logits: torch.Tensor | None = None) -> list[int]:
    """The row's tokens: from the in-graph argmaxes (greedy steps) or from
    its target logits [k, vocab] (any row)."""
    if params.sampling_type == SamplingType.GREEDY:
        if target_argmax is None:
            target_argmax = logits.argmax(dim=-1).tolist()
        return accept_greedy(drafts, target_argmax, bonus)
    return accept_random(drafts, logits, params, generator, bonus)
