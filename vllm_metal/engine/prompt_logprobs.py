"""Prompt logprobs, gathered chunk by chunk and handed to vLLM exactly once.

vLLM's contract (its GPU runner, `_get_prompt_logprobs_dict`, and the
scheduler's `update_from_output`): a request's prompt logprobs travel in the
ModelRunnerOutput of the step that samples its first token, never with a
partial prefill (the scheduler asserts that), and never again, not even when
a preempted request recomputes its prompt. Row i of the prompt's logits
predicts prompt token i + 1, so a prompt of L tokens has L - 1 rows; a chunk
that ends exactly at the prompt's last position has computed them all but
samples nothing, and its hand-over waits for the next step.

vLLM 0.33's fixed-id scoring (`prompt_logprob_token_ids`) needs its V2 model
runner, and vLLM refuses such requests on the V1 runner contract this plugin
implements (see platform.py), so it never reaches this module.
"""

from __future__ import annotations

import torch
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.sampler import Sampler

from vllm_metal.engine.persistent_batch import RequestState

LOGIT_MODES = ("raw_logits", "processed_logits")


def wants_prompt_logprobs(state: RequestState) -> bool:
    """True while the request has prompt scores still to compute or hand over."""
    return not state.prompt_logprobs_sent and state.sampling_params.prompt_logprobs is not None


def rows_this_step(state: RequestState, start: int, num_scheduled: int) -> int:
    """How many prompt-logprob rows this step's logits cover (positions
    start .. start + rows - 1; row p predicts prompt token p + 1)."""
    if not wants_prompt_logprobs(state):
        return 0
    return max(min(start + num_scheduled, len(state.prompt_token_ids) - 1) - start, 0)


def record(state: RequestState, logits: torch.Tensor, start: int, vocab_size: int, logprobs_mode: str) -> None:
    """Stores the scores of prompt rows start .. start + len(logits) - 1."""
    k = state.sampling_params.prompt_logprobs
    k = vocab_size if k == -1 else k
    n = logits.shape[0]
    if state.prompt_logprobs is None:
        state.prompt_logprobs = LogprobsTensors.empty_cpu(len(state.prompt_token_ids) - 1, k + 1)
    # As vLLM's GPU runner: prompt rows skip the sampling processors, and the
    # logit modes report logits instead of logprobs.
    scores = logits.float() if logprobs_mode in LOGIT_MODES else Sampler.compute_logprobs(logits)
    targets = torch.tensor(state.prompt_token_ids[start + 1:start + 1 + n], dtype=torch.int64)
    ids, values, ranks, *_ = Sampler.gather_logprobs(scores, k, targets)
    state.prompt_logprobs.logprob_token_ids[start:start + n] = ids
    state.prompt_logprobs.logprobs[start:start + n] = values
    state.prompt_logprobs.selected_token_ranks[start:start + n] = ranks


def hand_over(state: RequestState) -> LogprobsTensors:
    """The request's prompt logprobs, once: call only in a step that samples
    a token for it. Afterwards the request never produces them again."""
    state.prompt_logprobs_sent = True
    logprobs, state.prompt_logprobs = state.prompt_logprobs, None
    if logprobs is None:  # a one-token prompt has no rows
        k = state.sampling_params.prompt_logprobs
        logprobs = LogprobsTensors.empty_cpu(0, 1 + (0 if k == -1 else k))
    return logprobs
