"""What the runner holds under `--speculative-config`: who may draft, each
verified row's accepted tokens, and the next drafts for the scheduler.

vLLM's contract (its GPU runner's, for a host-side proposer): the scheduler
sends each request's drafts in `scheduled_spec_decode_tokens` and schedules
them as extra tokens of the request's row; the runner returns every row's
accepted drafts plus one token (the scheduler rolls `num_computed_tokens`
back over the rejected ones, so their KV slots are written again next
step); after the step the engine asks `take_draft_token_ids` for the drafts
of the next one. A request drafts only when vLLM's rejection sampler would
apply nothing beyond temperature, top-k and top-p to its verify positions
(no penalties, bad words, allowed ids, logit bias, min-p, pending
min_tokens or logprobs; no custom logits processor on the server; a
grammar's bitmask masks every draft position, engine/step_output.py):
the others decode one token a step, so every request's output is the one
it gets without speculation (greedy: token for token; random: the same
distribution). Of a request's proposed drafts only those the budget
(budget.py) expects to pay for their rows are sent (VLLM_METAL_SPEC_BUDGET=0:
all of them, as vLLM does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from vllm.sampling_params import SamplingType
from vllm.v1.outputs import DraftTokenIds

from vllm_metal import envs
from vllm_metal.speculative import async_drafts, rejection
from vllm_metal.speculative.budget import DraftBudget
from vllm_metal.speculative.draft_model import InputsFor, ModelDrafter
from vllm_metal.speculative.gemma4_assistant import AssistantDrafter
from vllm_metal.speculative.gemma4_assistant_config import is_assistant
from vllm_metal.speculative.mtp import MtpDrafter
from vllm_metal.speculative.ngram import NgramDrafter


# A drafting model: a draft model, the target's MTP layer, or Gemma 4's assistant.
ModelProposer = ModelDrafter | MtpDrafter | AssistantDrafter
IN_GRAPH = (MtpDrafter, AssistantDrafter)  # drafters fed the step's hidden states (Speculator.mtp_step)


@dataclass(frozen=True)
class VerifyRow:
    row: int  # the request's row in the step
    target: int  # index of its first draft position among the step's target rows
    drafts: tuple[int, ...]  # as scheduled (-1: padding, always rejected)


def may_draft(state) -> bool:
    p = state.sampling_params
    return (p is not None and p.sampling_type in (SamplingType.GREEDY, SamplingType.RANDOM,
                                                  SamplingType.RANDOM_SEED)
            and p.logprobs is None and p.frequency_penalty == 0 and p.presence_penalty == 0
            and p.repetition_penalty == 1.0 and not p.bad_words_token_ids and not p.allowed_token_ids
            and not p.logit_bias and not p.min_p
            and (not p.min_tokens or len(state.output_token_ids) >= p.min_tokens))


def tail(state, position: int) -> list[int]:
    """A request's tokens from `position` to its newest (prompt, then output)."""
    prompt, out = state.prompt_token_ids, state.output_token_ids
    if position >= len(prompt):
        return out[position - len(prompt):]
    return [*prompt[position:], *out]


class Speculator:
    def __init__(self, spec_config, max_model_len: int, custom_logitsprocs: bool, async_scheduling: bool = False):
        self.k = spec_config.num_speculative_tokens
        # vLLM's async scheduling: the drafts go straight into the next step's placeholders (async_drafts.py).
        self.async_scheduling = async_scheduling
        self.max_model_len = max_model_len
        # n-gram lookup on the host, or a model: a draft model (draft_model.py) or the target's MTP
        # layer (mtp.py), set by the runner's load_model through `load_model`
        self.drafter = NgramDrafter(spec_config.prompt_lookup_min, spec_config.prompt_lookup_max, self.k,
                                    max_model_len) if spec_config.method == "ngram" else None
        self.model: ModelProposer | None = None
        self.enabled = not custom_logitsprocs  # a custom processor may edit any position's logits
        # How many of its drafts each request verifies (budget.py); None: all of them, as vLLM does.
        # A drafting model's acceptance is pooled across requests (the prior of a new one); n-gram's is the prompt's.
        self.budget = DraftBudget(pooled=spec_config.method != "ngram",
                                  passes=spec_config.method in ("draft_model", "mtp", "eagle3")) \
            if envs.get_bool("VLLM_METAL_SPEC_BUDGET") else None
        self._step: tuple[float, int] | None = None  # a decode step's start and rows, timed for the budget
        self._drafts: DraftTokenIds | None = None
        # Instrumentation (tests, benchmarks): drafts verified, accepted, rows verified.
        self.drafted = 0
        self.accepted = 0
        self.verified_rows = 0

    def load_model(self, spec_config, target, dtype: str, dequantize: bool, fuse: bool, norm_rope: bool) -> None:
        """The drafting model of `--speculative-config`, loaded as the target is."""
        if is_assistant(spec_config):  # Gemma 4's assistant: its layers over the target's cache
            from vllm_metal.speculative.gemma4_assistant import load_assistant

            self.model = load_assistant(target, spec_config, dtype)
            return
        if spec_config.method == "eagle3":  # an EAGLE-3 head: fed the target's aux states in the step's graph
            from vllm_metal.speculative.eagle3 import load_eagle3

            self.model = load_eagle3(target, spec_config, dtype, dequantize, fuse, norm_rope)
            return
        if spec_config.method == "mtp":
            from vllm_metal.speculative.mtp import load_mtp
            from vllm_metal.speculative.qwen_mtp import QWEN_MTP_FAMILIES, load_qwen_mtp

            # Qwen3-Next / Qwen3.5 keep theirs under `mtp.*` (qwen_mtp.py), the others as a layer after the last.
            load = load_qwen_mtp if getattr(spec_config.target_model_config.hf_config, "model_type",
                                            None) in QWEN_MTP_FAMILIES else load_mtp
            # vLLM's draft_model_config.model: the target itself unless "model" names another checkpoint
            self.model = load(target, spec_config.draft_model_config.model, spec_config, dtype, dequantize,
                              fuse, norm_rope)
        else:
            from vllm_metal.speculative.draft_model import load_drafter

            self.model = load_drafter(spec_config, dtype, dequantize, fuse, norm_rope)

    def mtp_step(self, rows, states, spec: dict, inputs_for_factory):
        """The MTP layer's (or EAGLE-3 head's, an MtpDrafter) share of the step graph (a callable of the
        step's hidden states -- an EAGLE-3 head's: the aux states -- MtpDrafter.write_step), or None without one.
        inputs_for_factory(): the runner's step inputs for given rows (step_inputs.rows_inputs)."""
        if not isinstance(self.model, IN_GRAPH):
            return None
        return lambda hidden: self.model.write_step(rows, states, spec, hidden, inputs_for_factory())

    def accept(self, verify: list[VerifyRow], states, sampled: list[list[int]],
               target_argmax: list[int] | None, target_logits: torch.Tensor | None) -> list[list[int]]:
        """`sampled` (one token per row: the bonus) with each verified row's
        accepted drafts put in front of it, or its replacement token."""
        out = list(sampled)
        for v in verify:
            k, state = len(v.drafts), states[v.row]
            span = slice(v.target, v.target + k)
            tokens = rejection.accept(
                list(v.drafts), state.sampling_params, state.generator, sampled[v.row][0],
                target_argmax=target_argmax[span] if target_argmax is not None else None,
                logits=target_logits[span] if target_logits is not None else None)
            out[v.row] = tokens
            if self.budget is not None:
                self.budget.observe_verify(state.req_id, k, len(tokens) - 1)
            self.verified_rows += 1
            self.drafted += k  # counted as vLLM's metrics count them (placeholders too)
            self.accepted += len(tokens) - 1
        return out

    def count_padding(self, rows: int, drafts: int) -> None:
        """Rows vLLM padded with placeholder drafts: run as plain rows, counted as drafts none of which was kept."""
        self.verified_rows += rows
        self.drafted += drafts

    def begin_step(self, so, states, now: float):
        """The step as the runner runs it: finished requests forgotten, preempted and resumed requests'
        draft caches started over, under async scheduling the placeholders filled with the drafts
        proposed after each request's last step (async_drafts.py); a step whose every row decodes (one
        token, or one plus its drafts) is timed for the budget's cost fit."""
        self.forget(so.finished_req_ids)
        if self.model is not None:
            self.model.restart([*(so.preempted_req_ids or ()), *so.scheduled_cached_reqs.resumed_req_ids])
        if self.async_scheduling:
            proposed = dict(zip(self._drafts.req_ids, self._drafts.draft_token_ids)) if self._drafts else {}
            filled = async_drafts.substitute(so, states, proposed, self.max_model_len, self.k + 1)
            so = filled.so
            self.count_padding(filled.padded_rows, filled.padded_drafts)
        spec = so.scheduled_spec_decode_tokens
        drafts = sum(len(d) for d in spec.values())
        decode_only = so.total_num_scheduled_tokens == len(so.num_scheduled_tokens) + drafts
        self._step = (now, so.total_num_scheduled_tokens) if decode_only else None
        return so

    def propose(self, states, tokens: list[list[int]], k: int, now: float | None = None,
                room: np.ndarray | None = None, inputs_for: InputsFor | None = None) -> None:
        """The next step's drafts: for each request that got tokens this step
        and may draft, vLLM's n-gram proposal or the draft model's, kept
        (n-gram) or drafted (model) as far as the budget says it pays.
        room, inputs_for: the tokens each batch row's blocks hold, and the
        step inputs of given tokens per row (the runner's; a draft model's passes)."""
        candidates = [i for i, (state, new) in enumerate(zip(states, tokens)) if new and self.enabled and
                      may_draft(state) and not async_drafts.finished(state, self.max_model_len, len(new))]
        if self.model is not None:
            reach = {states[i].req_id: self.model.reach(states[i].num_tokens - 1, int(room[i])) for i in candidates}
            lengths = {r: min(n, k) for r, n in reach.items() if min(n, k) > 0}
        else:
            proposals = {states[i].req_id: self.drafter.propose(states[i].req_id, states[i].prompt_token_ids,
                                                                states[i].output_token_ids, k) for i in candidates}
            lengths = {r: len(d) for r, d in proposals.items() if d}
        keep = self.budget.allot(lengths, len(states)) if self.budget is not None else lengths
        if isinstance(self.model, IN_GRAPH):  # every row with a token: drafts as kept, pending pairs
            rows = np.array([i for i, new in enumerate(tokens) if new], np.int64)
            drafted = self.model.propose(rows, [states[i].req_id for i in rows],
                                         np.array([states[i].num_tokens - 1 for i in rows], np.int64),
                                         [states[i].output_token_ids[-1] for i in rows],
                                         [keep.get(states[i].req_id, 0) for i in rows], inputs_for)
            proposals = {states[i].req_id: d for i, d in zip(rows, drafted)}
        elif self.model is not None:  # only the drafts the budget keeps are drafted
            keep = self.model.gate.step(keep, self.model.written, self.budget)
            rows = np.array([i for i in candidates if keep.get(states[i].req_id, 0)], np.int64)
            by_id = {states[i].req_id: states[i] for i in rows}
            drafted = self.model.propose(rows, [states[i].req_id for i in rows],
                                         np.array([states[i].num_tokens - 1 for i in rows], np.int64),
                                         lambda r, p: tail(by_id[r], p), [keep[states[i].req_id] for i in rows],
                                         inputs_for)
            proposals = {states[i].req_id: d for i, d in zip(rows, drafted)}
        if self.model is not None:
            now = time.perf_counter() if now is not None else None  # the passes are part of the step's time
        if self._step is not None and now is not None and self.budget is not None:
            self.budget.observe_step(self._step[1], now - self._step[0],
                                     max(keep.values(), default=0) if self.model is not None else 0)
        self._step = None
        drafts = [proposals.get(s.req_id, [])[:keep.get(s.req_id, 0)] for s in states]
        self._drafts = DraftTokenIds([s.req_id for s in states], drafts)

    def take(self) -> DraftTokenIds | None:
        drafts, self._drafts = self._drafts, None
        return drafts

    def forget(self, req_ids) -> None:
        if self.drafter is not None:
            self.drafter.forget(req_ids)
        if self.model is not None:
            self.model.restart(req_ids)
        if self.budget is not None:
            self.budget.forget(req_ids)
