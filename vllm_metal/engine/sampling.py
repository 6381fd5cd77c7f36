"""Sampling: in the step's graph where the answer is an argmax, else
through vLLM's own torch Sampler on CPU tensors.

A step whose every row is greedy with nothing that edits its logits first
(`greedy_in_graph`) samples inside the MLX graph: vLLM's Sampler would take
the argmax of the raw logits for it, so the graph takes it and only the
token ids reach the host. Any other step's logits come out of the graph as
float32 numpy; everything after that (temperature, top-k/top-p/min-p,
penalties, bad words, allowed ids, logit bias, min_tokens, seeds, logprobs,
grammar bitmasks) is vLLM's code, so the semantics are exactly vLLM's.
"""

from __future__ import annotations

import torch
from vllm.sampling_params import SamplingType
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                                     MinTokensLogitsProcessor)
from vllm.v1.sample.sampler import Sampler

from vllm_metal.engine.persistent_batch import RequestState


BUILTIN_LOGITSPROCS = (MinPLogitsProcessor, LogitBiasLogitsProcessor, MinTokensLogitsProcessor)


def only_builtin_logitsprocs(logitsprocs) -> bool:
    """No custom logits processor is configured (one may edit any row's
    logits or read its tokens at any time: such a server samples on the host)."""
    return all(isinstance(p, BUILTIN_LOGITSPROCS) for p in logitsprocs.all)


def greedy_in_graph(state: RequestState) -> bool:
    """vLLM's Sampler would answer this row with the argmax of its raw logits:
    greedy, no logprobs, and nothing that edits the logits before the argmax
    (penalties, bad words, allowed ids, logit bias, min_tokens not yet reached)."""
    p = state.sampling_params
    return (p is not None and p.sampling_type == SamplingType.GREEDY and p.logprobs is None
            and p.prompt_logprobs is None and p.frequency_penalty == 0 and p.presence_penalty == 0
            and p.repetition_penalty == 1.0 and not p.bad_words_token_ids and not p.allowed_token_ids
            and not p.logit_bias and (not p.min_tokens or len(state.output_token_ids) >= p.min_tokens))


def sampling_metadata(states: list[RequestState], vocab_size: int, logitsprocs) -> SamplingMetadata:
    params = [s.sampling_params for s in states]
    greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
    # Greedy rows carry temperature 0: the sampler takes argmax where temp < eps.
    temperature = torch.tensor([0.0 if g else p.temperature for g, p in zip(greedy, params)],
                               dtype=torch.float32)
    top_p = [p.top_p for p in params]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    no_penalties = all(p.frequency_penalty == 0 and p.presence_penalty == 0
                       and p.repetition_penalty == 1.0 for p in params)
    prompt_ids = None
    if not no_penalties:
        width = max(len(s.prompt_token_ids) for s in states)
        prompt_ids = torch.full((len(states), width), vocab_size, dtype=torch.int64)
        for i, s in enumerate(states):
            prompt_ids[i, :len(s.prompt_token_ids)] = torch.tensor(s.prompt_token_ids, dtype=torch.int64)
    num_logprobs = [vocab_size if p.logprobs == -1 else p.logprobs for p in params if p.logprobs is not None]
    allowed = None
    if any(p.allowed_token_ids for p in params):
        allowed = torch.zeros(len(params), vocab_size, dtype=torch.bool)
        for i, p in enumerate(params):
            if p.allowed_token_ids:
                allowed[i] = True  # True = masked out
                allowed[i, p.allowed_token_ids] = False
    return SamplingMetadata(
        temperature=None if all(greedy) else temperature,
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=None if all(p >= 1.0 for p in top_p) else torch.tensor(top_p, dtype=torch.float32),
        top_k=None if all(k >= vocab_size for k in top_k) else torch.tensor(top_k, dtype=torch.int32),
        generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
        max_num_logprobs=max(num_logprobs) if num_logprobs else None,
        no_penalties=no_penalties,
        prompt_token_ids=prompt_ids,
        frequency_penalties=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
        presence_penalties=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
        repetition_penalties=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
        output_token_ids=[s.output_token_ids for s in states],
        allowed_token_ids_mask=allowed,
        bad_words_token_ids={i: p.bad_words_token_ids for i, p in enumerate(params) if p.bad_words_token_ids},
        logitsprocs=logitsprocs,
    )


def sample(sampler: Sampler, logits: torch.Tensor, states: list[RequestState], discard: list[bool],
           vocab_size: int, logitsprocs):
    """Samples one token per row. Rows still in chunked prefill (`discard`)
    are sampled for shape's sake but their seeded generators are rewound, so
    a seed gives the same tokens however the prompt was chunked."""
    saved = {i: s.generator.get_state() for i, s in enumerate(states)
             if discard[i] and s.generator is not None}
    out = sampler(logits, sampling_metadata(states, vocab_size, logitsprocs))
    for i, state in saved.items():
        states[i].generator.set_state(state)
    return out
