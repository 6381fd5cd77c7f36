"""One engine step between execute_model and its ModelRunnerOutput: its
logits (or in-graph sampled tokens) brought to the host, sampled, handed
over; and the AsyncModelRunnerOutput that hands it over under async
scheduling."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import mlx.core as mx
import numpy as np
import torch
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.outputs import AsyncModelRunnerOutput, KVConnectorOutput, LogprobsTensors, ModelRunnerOutput

from vllm_metal.engine import prompt_logprobs, step_inputs
from vllm_metal.engine.persistent_batch import RequestState
from vllm_metal.engine.sampling import sample
from vllm_metal.models import draft_states
from vllm_metal.speculative.speculator import VerifyRow

if TYPE_CHECKING:
    from vllm_metal.engine.model_runner import MetalModelRunner


@dataclass
class PendingStep:
    """One engine step from execute_model until its ModelRunnerOutput exists."""

    scheduler_output: SchedulerOutput
    states: list[RequestState]  # the step's rows, in batch order
    discard: list[bool]  # rows still in chunked prefill (or failed KV loads): no token this step
    prompt_rows: list[tuple[RequestState, int, int]]  # (state, first position, rows) of prompt scores
    logits_mx: mx.array | None  # [rows + prompt rows, vocab] float32, evaluated or being evaluated
    # Sampled in the graph (every row greedy, sampling.greedy_in_graph): int32
    # [rows], evaluated or being evaluated; the logits never leave the graph.
    tokens_mx: mx.array | None = None
    # The step whose in-graph tokens this step's graph reads (token feed,
    # engine/step_rows.py): finished (its tokens appended) before this one.
    prev: PendingStep | None = None
    # Starts the step's evaluation when it was deferred (model_runner: async
    # scheduling on MLX's CPU device); None once started.
    launch: Callable[[], None] | None = None
    kv_connector_output: KVConnectorOutput | None = None
    verify: list[VerifyRow] = field(default_factory=list)  # rows with drafts (speculative/)
    # Filled when the logits reach the host (collect):
    logits: torch.Tensor | None = None  # [num_rows, vocab]: each row's last token
    target_logits: torch.Tensor | None = None  # [drafts, vocab]: the verified rows' draft positions
    prompt_logprobs: dict[str, LogprobsTensors | None] | None = None
    # Set by sample_tokens / finish:
    sample_requested: bool = False
    grammar_output: GrammarOutput | None = None
    output: ModelRunnerOutput | None = None
    error: BaseException | None = None

    @property
    def feeds_tokens(self) -> bool:
        """Its tokens exist in the graph before they reach the host: a next
        step may read them there (only while it is unfinished)."""
        return self.tokens_mx is not None and self.output is None and self.error is None

    def start(self) -> None:
        """Starts the evaluation if it was deferred (once)."""
        launch, self.launch = self.launch, None
        if launch is not None:
            launch()

    def sampling_rows(self) -> dict[str, int]:
        """req_id -> the row of tokens_mx holding that request's new token."""
        return {s.req_id: i for i, (s, dropped) in enumerate(zip(self.states, self.discard)) if not dropped}


def collect(step: PendingStep, kv_arrays, vocab_size: int, logprobs_mode) -> None:
    """The step's logits to the host (waiting for its evaluation), its
    prompt scores recorded and, for rows that sample now, handed over."""
    if step.logits is not None or step.tokens_mx is not None:
        return
    mx.eval(step.logits_mx, kv_arrays)  # a no-op when already evaluated
    logits = torch.from_numpy(np.array(step.logits_mx, copy=False))
    step.logits_mx = None
    cursor = len(step.states)
    for state, start, m in step.prompt_rows:
        prompt_logprobs.record(state, logits[cursor:cursor + m], start, vocab_size, logprobs_mode)
        cursor += m
    # Handed over with the step that samples the request's first token,
    # exactly once (never with a partial prefill, never after a resume).
    step.prompt_logprobs = {state.req_id: prompt_logprobs.hand_over(state)
                            for state, dropped in zip(step.states, step.discard)
                            if not dropped and prompt_logprobs.wants_prompt_logprobs(state)}
    # A view, not a copy: the first rows of the step's own logits buffer (MLX's, writable,
    # kept alive by the tensor), which grammar masks and the sampler may edit in place.
    step.logits = logits[:len(step.states)]
    step.target_logits = logits[cursor:] if step.verify else None


def sample_step(runner: MetalModelRunner, step: PendingStep) -> ModelRunnerOutput:
    """The step's tokens (from the graph, or vLLM's Sampler on its logits),
    appended to each request's state, as vLLM's ModelRunnerOutput."""
    states, logprobs = step.states, None
    target_argmax = target_logits = None
    if step.tokens_mx is not None:
        # tolist() waits for the evaluation (only this array: it is all the host needs).
        ids = step.tokens_mx.tolist()
        sampled, target_argmax = [[t] for t in ids[:len(states)]], ids[len(states):]
        step.tokens_mx = None
    else:
        collect(step, runner.kv.arrays(), runner.vocab_size, runner.model_config.logprobs_mode)
        if step.grammar_output is not None:
            apply_grammar(step, step.grammar_output)
        out = sample(runner.sampler, step.logits, states, step.discard, runner.vocab_size, runner.logitsprocs)
        sampled = out.sampled_token_ids.tolist()
        logprobs = out.logprobs_tensors.tolists() if out.logprobs_tensors is not None else None
        target_logits, step.logits, step.target_logits = step.target_logits, None, None
    spec = runner.speculator
    if step.verify:  # accepted drafts + one token (speculative/rejection.py)
        sampled = spec.accept(step.verify, states, sampled, target_argmax, target_logits)
    if runner.kv.drafts is not None:  # a hybrid's verify rows: their accepted states kept (models/draft_states.py)
        draft_states.select(runner.kv, np.array([max(len(sampled[r]) - 1, 0) for r in runner.kv.drafts.rows]),
                            runner.block_sizes)
    tokens: list[list[int]] = []
    for state, row, dropped in zip(states, sampled, step.discard):
        if dropped:
            tokens.append([])
            continue
        state.output_token_ids.extend(row)
        tokens.append(row)
    if spec is not None:  # the next step's drafts, handed over by take_draft_token_ids
        room = inputs_for = None
        if spec.model is not None:  # a draft model: its passes run now, over the batch's block tables
            tables = runner.batch.block_table_view()
            room = step_inputs.room(tables, runner.block_sizes)
            inputs_for = step_inputs.rows_inputs(runner)
        spec.propose(states, tokens, step.scheduler_output.num_spec_tokens_to_schedule, time.perf_counter(),
                     room, inputs_for)
    req_ids = [state.req_id for state in states]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=tokens,
        logprobs=logprobs,
        prompt_logprobs_dict=step.prompt_logprobs if step.prompt_logprobs is not None else {},
        kv_connector_output=step.kv_connector_output,
    )


def apply_grammar(step: PendingStep, grammar: GrammarOutput) -> None:
    """vLLM's grammar bitmask applied to the step's logits in place. Per
    request with a grammar it has `stride` rows: one per scheduled draft
    position, then the position after them (rows past a draft the grammar
    refuses do not matter: that draft is rejected by its own row). Here a
    request's draft positions are its rows of `step.target_logits`, the
    position after its drafts its row of `step.logits`."""
    import xgrammar as xgr

    bits = torch.from_numpy(grammar.grammar_bitmask)
    stride = bits.shape[0] // len(grammar.structured_output_request_ids)
    row_of = {s.req_id: i for i, s in enumerate(step.states)}
    verify_of = {v.row: v for v in step.verify}
    rows, draft_rows = {}, {}  # logits row -> bitmask row, for step.logits and step.target_logits
    for n, req_id in enumerate(grammar.structured_output_request_ids):
        i = row_of.get(req_id)
        if i is None:
            continue
        v = verify_of.get(i)
        drafts = len(v.drafts) if v is not None else 0
        for j in range(drafts):  # draft position j: the grammar's state after drafts 1 .. j
            draft_rows[v.target + j] = n * stride + j
        rows[i] = n * stride + drafts
    for logits, picked in ((step.logits, rows), (step.target_logits, draft_rows)):
        if picked:
            aligned = torch.full((logits.shape[0], bits.shape[1]), -1, dtype=bits.dtype)
            aligned[list(picked)] = bits[list(picked.values())]
            xgr.apply_token_bitmask_inplace(logits, aligned, indices=list(picked))


class AsyncStepOutput(AsyncModelRunnerOutput):
    """What sample_tokens returns under async scheduling: the engine calls
    get_output once, after it has scheduled (and usually started) the next
    step. The step may already be finished by then (the next execute_model
    finishes it first); then this only hands the output over."""

    def __init__(self, runner: MetalModelRunner, step: PendingStep):
        self._runner, self._step = runner, step

    def get_output(self) -> ModelRunnerOutput:
        return self._runner._finish(self._step)

    def get_kv_connector_output(self) -> KVConnectorOutput | None:
        return self._step.kv_connector_output


def connector_output(so: SchedulerOutput, connector) -> KVConnectorOutput:
    """A KV connector's report for the step (vLLM's kv_connector_model_runner_mixin):
    saves waited for, finished transfers, blocks that failed to load."""
    connector.wait_for_save()
    results = connector.get_transfer_results(so.finished_req_ids)
    return KVConnectorOutput(finished_sending=results.finished_sending or None,
                             finished_recving=results.finished_recving or None,
                             failed_recving=results.failed_recving,
                             invalid_block_ids=connector.get_block_ids_with_load_errors())
