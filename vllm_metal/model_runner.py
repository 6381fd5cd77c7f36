"""Runs vLLM's scheduler output on an MLX model: one lazy graph per step.

execute_model: update the persistent batch, pack every scheduled token of
every request (decode, prefill, chunked prefill) into one varlen batch, build
the whole forward pass -- every layer's K/V write and paged attention -- as a
single lazy MLX graph, and evaluate it once together with the new caches.
sample_tokens: apply the grammar bitmask and sample with vLLM's Sampler.

With vLLM's async scheduling (its default; --no-async-scheduling turns it
off) the evaluation is started, not awaited (`mx.async_eval`), and
sample_tokens hands back an AsyncModelRunnerOutput: the engine schedules the
next step and processes the previous step's output while this one computes.
A step is finished (waited for, sampled) when its output is asked for or,
at the latest, when the next execute_model arrives -- always before the
persistent batch changes, so the tokens, the order of random draws and the
logits processors' state are exactly those of synchronous scheduling.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec,
                                        MLAAttentionSpec, SlidingWindowSpec)
from vllm.v1.outputs import (EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput, KVConnectorOutput, LogprobsTensors,
                              ModelRunnerOutput)
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.sampler import Sampler
from vllm.v1.structured_output.utils import apply_grammar_bitmask

from vllm_metal import envs, prompt_logprobs
from vllm_metal.models.attention_adapter import PagedKVCache
from vllm_metal.models.cpu_norm_rope import cpu_norm_rope_enabled
from vllm_metal.models.fused_projections import fuse_projections_enabled
from vllm_metal.models.loader import LoadedModel, ParallelPlan, load_model
from vllm_metal.persistent_batch import PersistentBatch, RequestState
from vllm_metal.sampling import sample
from vllm_metal.step_inputs import ScheduledRow, build_step_inputs

logger = init_logger("vllm." + __name__)  # under vLLM's configured "vllm" logger

TORCH_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
MX_TO_TORCH = {mx.float32: torch.float32, mx.float16: torch.float16, mx.bfloat16: torch.bfloat16}


@dataclass
class _PendingStep:
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


class _AsyncStepOutput(AsyncModelRunnerOutput):
    """What sample_tokens returns under async scheduling: the engine calls
    get_output once, after it has scheduled (and usually started) the next
    step. The step may already be finished by then (the next execute_model
    finishes it first); then this only hands the output over."""

    def __init__(self, runner: MetalModelRunner, step: _PendingStep):
        self._runner, self._step = runner, step

    def get_output(self) -> ModelRunnerOutput:
        return self._runner._finish(self._step)

    def get_kv_connector_output(self) -> KVConnectorOutput | None:
        return self._step.kv_connector_output


class MetalModelRunner:
    def __init__(self, vllm_config, device: str, parallel: ParallelPlan | None = None):
        self.vllm_config = vllm_config
        # Tensor / pipeline parallel: this rank's share (distributed/); None on one rank.
        self.parallel = parallel
        self.model_config = vllm_config.model_config
        self.device = device
        self.sync_per_layer = envs.get_bool("VLLM_METAL_SYNC_PER_LAYER")
        # vLLM decides (on by default, --no-async-scheduling): see the module docstring.
        self.async_scheduling = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        self.sampler = Sampler(logprobs_mode=self.model_config.logprobs_mode)
        self.logitsprocs = build_logitsprocs(vllm_config, torch.device("cpu"), False, is_pooling_model=False,
                                             custom_logitsprocs=self.model_config.logits_processors or ())
        self.batch = PersistentBatch(self.logitsprocs)
        self.mlx_model: LoadedModel | None = None
        self.kv: PagedKVCache | None = None
        self.block_sizes: list[int] = []
        self.group_windows: list[int | None] = []  # per KV-cache group: sliding window or None
        self.vocab_size = self.model_config.get_vocab_size()
        # Instrumentation (tests, logs): forward passes run and graph
        # evaluations made; equal unless VLLM_METAL_SYNC_PER_LAYER=1.
        self.forward_passes = 0
        self.evaluations = 0
        # Steps whose output was still unasked for when the next step arrived
        # (async scheduling: the engine ran ahead; tests read it).
        self.finished_by_next_step = 0
        self._pending: _PendingStep | None = None
        # Under async scheduling vLLM's multiprocess executor asks for a step's
        # output on its own thread while the next execute_model may arrive.
        self._finish_lock = threading.Lock()
        # The worker side of a KV connector (--kv-transfer-config: our disk
        # cache), driven here as vLLM's GPU runner drives its connector.
        self.kv_connector = None

    # ---- start-up -------------------------------------------------------

    def load_model(self) -> None:
        dtype = TORCH_DTYPES.get(self.model_config.dtype)
        if dtype is None:
            raise ValueError(f"dtype {self.model_config.dtype} is not supported by vllm-metal "
                             "(use float32, float16 or bfloat16)")
        choice = (envs.get("VLLM_METAL_DEQUANTIZE") or "auto").strip().lower()
        dequantize = self.device == "cpu" if choice == "auto" else choice in ("1", "true", "yes")
        start = time.perf_counter()
        self.mlx_model = load_model(self.model_config.model, dtype=dtype, dequantize=dequantize,
                                    fuse=fuse_projections_enabled(self.device),
                                    norm_rope=cpu_norm_rope_enabled(self.device), parallel=self.parallel)
        m = self.mlx_model
        extras = []
        if m.tp_projections:
            extras.append(f"tensor parallel rank {self.parallel.tp_rank} of {self.parallel.tp}: "
                          f"{m.tp_projections} projections split")
        if m.owned is not None:
            extras.append(f"pipeline stage {self.parallel.pp_rank} of {self.parallel.pp}: layers "
                          f"{m.owned.start}-{m.owned.stop - 1} of {m.num_layers}")
        if m.fused:
            extras.append("fused projections: {qkv} q/k/v, {gate_up} gate/up, {swiglu} SwiGLU".format(**m.fused))
        if m.norm_rope:
            extras.append("CPU primitives: {rms_norm} RMSNorms, RoPE of {rope} layers from {rope_tables} "
                          "table(s) a step".format(**m.norm_rope))
        logger.info("vllm-metal loaded %s (%s%s) on MLX %s in %.1fs%s", self.model_config.model, dtype,
                    ", MLX-quantized" if m.quantized else "", self.device, time.perf_counter() - start,
                    "".join(f"; {e}" for e in extras))

    def weights_bytes(self) -> int:
        return self.mlx_model.weights_bytes  # this rank's resident weights (loader.py)

    def layer_name(self, i: int) -> str:
        return f"model.layers.{i}.self_attn"

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """One spec per layer with a cache of its own (layers reading an
        earlier layer's cache have none, as vLLM's KV sharing does).
        Linear-attention layers declare vLLM's Mamba-style state spec: one
        slot per request (block size mamba_block_size, mode "none")."""
        m = self.mlx_model
        block_size = self.vllm_config.cache_config.block_size
        dtype = MX_TO_TORCH[m.dtype]
        specs: dict[str, KVCacheSpec] = {}
        for i, (kv, window) in enumerate(zip(m.layer_kv, m.sliding_windows)):
            if kv.source is not None or not m.owns(i):  # a shared cache, or another stage's layer
                continue
            if kv.layout == "state":
                cache = self.vllm_config.cache_config
                # The convolution state in the model dtype, a recurrent state (if any) in float32.
                dtypes = (dtype,) + (torch.float32,) * (len(kv.state_shapes) - 1)
                specs[self.layer_name(i)] = MambaSpec(block_size=cache.mamba_block_size, shapes=kv.state_shapes,
                                                      dtypes=dtypes, mamba_cache_mode=cache.mamba_cache_mode)
                continue
            common = dict(block_size=block_size, num_kv_heads=kv.num_kv_heads, head_size=kv.head_dim, dtype=dtype)
            if kv.layout == "latent":  # one latent row per token, no separate V (MLA has no windows)
                specs[self.layer_name(i)] = MLAAttentionSpec(**common)
            else:
                specs[self.layer_name(i)] = (SlidingWindowSpec(sliding_window=window, **common) if window
                                             else FullAttentionSpec(**common))
        return specs

    def kv_bytes_ratio(self) -> float:
        """How many bytes this runner allocates per byte vLLM plans for the
        KV cache (>= 1). vLLM's hybrid manager lets one layer of each cache
        group share a tensor (block ids never overlap between groups); MLX's
        functional cache writes cannot alias, so every layer here has its own
        arrays. The worker divides its budget by this so the memory really
        used stays within it. 1.0 with a single group."""
        from copy import deepcopy

        from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
        from vllm.v1.core.kv_cache_planning import _pool_bytes_per_block_from_builder, get_global_kv_cache_groups
        from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

        # The grouping vLLM's engine makes from these specs, and the bytes per
        # block it divides the budget by (a private helper of vLLM 0.33's
        # planner: tests/plugin/test_hybrid.py fails if its meaning changes).
        groups = get_global_kv_cache_groups(self.vllm_config, [deepcopy(self.get_kv_cache_spec())])
        if len(groups) <= 1:
            return 1.0
        planned_per_block = _pool_bytes_per_block_from_builder(
            get_kv_cache_config_builder(self.vllm_config), self.vllm_config, groups)
        ours_per_block = 0
        for group in groups:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                ours_per_block += sum(spec.kv_cache_specs[name].real_page_size_bytes for name in group.layer_names)
            else:
                ours_per_block += len(group.layer_names) * spec.real_page_size_bytes
        vllm_per_block = planned_per_block
        return max(1.0, ours_per_block / vllm_per_block)

    def initialize_kv_cache(self, config: KVCacheConfig) -> None:
        m = self.mlx_model
        layer_group = [0] * m.num_layers
        index = {self.layer_name(i): i for i in range(m.num_layers)}
        self.block_sizes, self.group_windows = [], []
        for g, group in enumerate(config.kv_cache_groups):
            self.block_sizes.append(group.kv_cache_spec.block_size)
            self.group_windows.append(group.kv_cache_spec.sliding_window
                                      if isinstance(group.kv_cache_spec, SlidingWindowSpec) else None)
            for name in group.layer_names:
                if name in index:  # (pipeline parallel: groups list every stage's layers)
                    layer_group[index[name]] = g
        for i, kv in enumerate(m.layer_kv):  # a shared layer reads its source's blocks
            if kv.source is not None:
                layer_group[i] = layer_group[kv.source]
        # Block 0 is vLLM's null block: allocated, never handed to a request.
        self.kv = m.allocate_kv(config.num_blocks, self.block_sizes, layer_group)
        if self.sync_per_layer:
            self.kv.after_layer = lambda *arrays: self._evaluate(*arrays)
        logger.info("vllm-metal KV cache: %d blocks x %s tokens, %d layers, %.2f GiB", config.num_blocks,
                    self.block_sizes, len(m.owned) if m.owned is not None else m.num_layers,
                    sum(a.nbytes for a in self.kv.arrays()) / 2**30)

    def warm_up(self) -> None:
        """A small step shaped like real traffic, into the null block: one row
        prefilling several tokens from position 0, one continuing past a block
        boundary, one decoding. The first request then pays no lazy set-up,
        and whatever the adapter cannot do for this model fails here, at
        start-up, with the model named -- never on a user's request."""
        groups = len(self.block_sizes)
        block = min(self.block_sizes)
        rows = [ScheduledRow([1, 2, 3, 4], 0, [[0]] * groups),
                ScheduledRow([5, 6, 7], block - 1, [[0, 0]] * groups),
                ScheduledRow([8], 2 * block + 5, [[0, 0, 0]] * groups)]
        inputs = build_step_inputs(rows, self.block_sizes)
        try:
            logits = self._forward(inputs, inputs.last_token_indices.astype(np.int64))
            mx.eval(logits if logits is not None else [], self.kv.arrays())
        except Exception as e:  # noqa: BLE001 -- reported with the model's name, then start-up stops
            raise RuntimeError(f"vllm-metal cannot serve {self.model_config.model}: a warm-up step "
                               f"(prefill + chunk + decode rows) failed: {type(e).__name__}: {e}") from e
        if logits is not None and not np.isfinite(np.array(logits, copy=False)).all():
            raise RuntimeError(f"vllm-metal cannot serve {self.model_config.model}: the warm-up step gave "
                               "non-finite logits")

    # ---- per step -------------------------------------------------------

    def _evaluate(self, *arrays) -> None:
        self.evaluations += 1
        mx.eval(*arrays)

    def _start_evaluation(self, *arrays) -> None:
        """The step's one evaluation, awaited now (synchronous scheduling) or
        only started (async scheduling: awaited in _collect)."""
        if not self.async_scheduling:
            self._evaluate(*arrays)
            return
        self.evaluations += 1
        mx.async_eval(*arrays)

    def _forward(self, inputs, logit_rows: np.ndarray) -> mx.array | None:
        """The whole model over the packed step as one graph, its evaluation
        started (awaited unless async scheduling is on); the logits, lazy
        (None on a pipeline stage before the last: its output is sent)."""
        self.forward_passes += 1
        m = self.mlx_model
        logits = m.forward(self.kv, inputs, logit_rows)
        sends = m.transport.take_pending() if m.transport is not None else []
        self._start_evaluation(*([logits] if logits is not None else []), *sends, self.kv.arrays())
        return logits

    def execute_model(self, so: SchedulerOutput):
        # The previous step is finished before the batch changes (async
        # scheduling: its output may not have been asked for yet).
        pending, self._pending = self._pending, None
        if pending is not None and pending.sample_requested:
            if pending.output is None and pending.error is None:
                self.finished_by_next_step += 1
            self._finish(pending)
        connector = self.kv_connector
        if connector is None:
            return self._execute(so, None)
        # vLLM's connector lifecycle (kv_connector_model_runner_mixin): bind
        # the step's metadata, load before the forward, save after it, report
        # finished transfers and load errors, clear.
        connector.bind_connector_metadata(so.kv_connector_metadata)
        try:
            return self._execute(so, connector)
        finally:
            connector.clear_connector_metadata()

    def _connector_output(self, so: SchedulerOutput, connector) -> KVConnectorOutput:
        connector.wait_for_save()
        results = connector.get_transfer_results(so.finished_req_ids)
        return KVConnectorOutput(finished_sending=results.finished_sending or None,
                                 finished_recving=results.finished_recving or None,
                                 failed_recving=results.failed_recving,
                                 invalid_block_ids=connector.get_block_ids_with_load_errors())

    def _execute(self, so: SchedulerOutput, connector):
        self.batch.update(so)
        if so.total_num_scheduled_tokens == 0 or not self.batch.rows:
            if connector is None:
                return EMPTY_MODEL_RUNNER_OUTPUT
            # Nothing to compute: let saves in flight finish now, so finished
            # requests are reported (their blocks freed) before the engine idles.
            connector.fence()
            return ModelRunnerOutput.with_kv_conn_output_only(self._connector_output(so, connector))
        failed_loads: set[str] = set()
        if connector is not None:
            connector.start_load_kv(None)
            # A request whose blocks did not load computed on a bad prefix this
            # step: it samples nothing (vLLM recomputes it from the bad block).
            failed_loads = connector.failed_load_req_ids
        states = self.batch.states()
        rows, discard, logit_rows, prompt_rows, extra = [], [], [], [], []
        offset = 0
        for state in states:
            n = so.num_scheduled_tokens[state.req_id]
            start = state.num_computed_tokens
            rows.append(ScheduledRow(state.tokens(start, start + n), start))
            # still prefilling: no token this step
            discard.append(start + n < state.num_tokens or state.req_id in failed_loads)
            logit_rows.append(offset + n - 1)
            m = prompt_logprobs.rows_this_step(state, start, n) if state.req_id not in failed_loads else 0
            if m:
                prompt_rows.append((state, start, m))
                extra.extend(range(offset, offset + m))  # after every row's last token
            offset += n
        inputs = build_step_inputs(rows, self.block_sizes, self.group_windows, self.batch.block_table_view())
        logits = self._forward(inputs, np.array(logit_rows + extra, np.int64))
        if logits is None:
            # A pipeline stage before the last: its part is done (evaluated
            # under the synchronous scheduling vLLM uses with pipelines);
            # the last stage samples and answers the engine.
            return None
        step = _PendingStep(so, states, discard, prompt_rows, logits)
        if not self.async_scheduling:
            self._collect(step)
        # A disk save reads the written blocks: it waits for the evaluation
        # (the platform keeps async scheduling off with a connector).
        step.kv_connector_output = self._connector_output(so, connector) if connector is not None else None
        self._pending = step
        return None  # the engine calls sample_tokens next

    def _collect(self, step: _PendingStep) -> None:
        """The step's logits to the host (waiting for its evaluation), its
        prompt scores recorded and, for rows that sample now, handed over."""
        if step.logits is not None:
            return
        mx.eval(step.logits_mx, self.kv.arrays())  # a no-op when already evaluated
        logits = torch.from_numpy(np.array(step.logits_mx, copy=False))
        step.logits_mx = None
        cursor = len(step.states)
        for state, start, m in step.prompt_rows:
            prompt_logprobs.record(state, logits[cursor:cursor + m], start, self.vocab_size,
                                   self.model_config.logprobs_mode)
            cursor += m
        # Handed over with the step that samples the request's first token,
        # exactly once (never with a partial prefill, never after a resume).
        step.prompt_logprobs = {state.req_id: prompt_logprobs.hand_over(state)
                                for state, dropped in zip(step.states, step.discard)
                                if not dropped and prompt_logprobs.wants_prompt_logprobs(state)}
        # A view, not a copy: the first rows of the step's own logits buffer (MLX's, writable,
        # kept alive by the tensor), which grammar masks and the sampler may edit in place.
        step.logits = logits[:len(step.states)]

    def sample_tokens(self, grammar_output: GrammarOutput | None):
        step = self._pending
        if step is None or step.sample_requested:
            return EMPTY_MODEL_RUNNER_OUTPUT
        step.sample_requested, step.grammar_output = True, grammar_output
        if self.async_scheduling:
            return _AsyncStepOutput(self, step)
        self._pending = None
        return self._finish(step)

    def _finish(self, step: _PendingStep) -> ModelRunnerOutput:
        """Waits for the step, samples it and builds its output, once; a
        failure (an evaluation error surfaces here) is kept and raised again
        to whoever asks for the output later."""
        with self._finish_lock:
            if step.output is None and step.error is None:
                try:
                    step.output = self._sample(step)
                except BaseException as e:
                    step.error = e
                    raise
            if step.error is not None:
                raise step.error
            return step.output

    def _sample(self, step: _PendingStep) -> ModelRunnerOutput:
        self._collect(step)
        states = step.states
        if step.grammar_output is not None:
            apply_grammar_bitmask(step.scheduler_output, step.grammar_output, self.batch, step.logits)
        out = sample(self.sampler, step.logits, states, step.discard, self.vocab_size, self.logitsprocs)
        sampled = out.sampled_token_ids.tolist()
        tokens: list[list[int]] = []
        for state, row, dropped in zip(states, sampled, step.discard):
            if dropped:
                tokens.append([])
                continue
            state.output_token_ids.extend(row)
            tokens.append(row)
        req_ids = [state.req_id for state in states]
        step.logits = None
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=tokens,
            logprobs=out.logprobs_tensors.tolists() if out.logprobs_tensors is not None else None,
            prompt_logprobs_dict=step.prompt_logprobs,
            kv_connector_output=step.kv_connector_output,
        )
