"""One engine step between execute_model and its ModelRunnerOutput, and the
AsyncModelRunnerOutput that hands it over under async scheduling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import torch
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.outputs import AsyncModelRunnerOutput, KVConnectorOutput, LogprobsTensors, ModelRunnerOutput

from vllm_metal.engine.persistent_batch import RequestState

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
    kv_connector_output: KVConnectorOutput | None = None
    # Filled when the logits reach the host (collect):
    logits: torch.Tensor | None = None  # [num_rows, vocab]: each row's last token
    prompt_logprobs: dict[str, LogprobsTensors | None] | None = None
    # Set by sample_tokens / finish:
    sample_requested: bool = False
    grammar_output: GrammarOutput | None = None
    output: ModelRunnerOutput | None = None
    error: BaseException | None = None


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
