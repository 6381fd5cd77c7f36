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
logits processors' state are exactly those of synchronous scheduling. On
MLX's CPU device a step starts only once the previous step's output is
handed over (mx.async_eval blocks there until near the step's end).
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.sampler import Sampler

from vllm_metal import envs
from vllm_metal.adapters.pool import AdapterPool
from vllm_metal.distributed.plan import ParallelPlan
from vllm_metal.engine import kv_specs, step_rows, warm_up
from vllm_metal.engine.persistent_batch import PersistentBatch
from vllm_metal.engine.pooling_runner import PoolingSide
from vllm_metal.engine.sampling import greedy_in_graph, only_builtin_logitsprocs
from vllm_metal.engine.state_align import AlignedStateIndex
from vllm_metal.engine.step_inputs import build_step_inputs, rows_inputs
from vllm_metal.engine.step_output import AsyncStepOutput, PendingStep, collect, connector_output, sample_step
from vllm_metal.models.attention_adapter import PagedKVCache
from vllm_metal.models.cpu_norm_rope import cpu_norm_rope_enabled
from vllm_metal.models.fused_projections import fuse_projections_enabled
from vllm_metal.models.loader import LoadedModel, load_model
from vllm_metal.multimodal.serving import MultimodalStep, build as build_multimodal
from vllm_metal.multimodal.serving import weights_bytes as weights_bytes_of_tower
from vllm_metal.speculative.speculator import ModelProposer, Speculator

logger = init_logger("vllm." + __name__)  # under vLLM's configured "vllm" logger

TORCH_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class MetalModelRunner:
    def __init__(self, vllm_config, device: str, parallel: ParallelPlan | None = None):
        self.vllm_config = vllm_config
        # Tensor / pipeline parallel: this rank's share (distributed/); None on one rank.
        self.parallel = parallel
        self.model_config = vllm_config.model_config
        self.device = device
        self.sync_per_layer = envs.get_bool("VLLM_METAL_SYNC_PER_LAYER")
        self.async_scheduling = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        self.sampler = Sampler(logprobs_mode=self.model_config.logprobs_mode)
        self.is_pooling = self.model_config.runner_type == "pooling"
        self.logitsprocs = build_logitsprocs(vllm_config, torch.device("cpu"), False, is_pooling_model=self.is_pooling,
                                             custom_logitsprocs=self.model_config.logits_processors or ())
        # --runner pooling: the model and its pooler (engine/pooling_runner.py), set at load.
        self.pooling: PoolingSide | None = None
        self.batch = PersistentBatch(self.logitsprocs)
        # Sampling inside the graph (engine/sampling.py) and the token feed
        # (engine/step_rows.py): off with a custom logits processor, which may
        # edit any row's logits and read its tokens at any time.
        self.sample_in_graph = only_builtin_logitsprocs(self.logitsprocs) and \
            envs.get_bool("VLLM_METAL_SAMPLE_IN_GRAPH")
        self.steps_sampled_in_graph = 0
        self.tokens_fed = 0  # input tokens read from the previous step's graph (instrumentation)
        self.steps_deferred = 0  # steps started after the previous step's output was handed over
        self.mlx_model: LoadedModel | None = None
        self.kv: PagedKVCache | None = None
        self.block_sizes: list[int] = []
        self.group_windows: list[int | None] = []  # per KV-cache group: sliding window or None
        # Hybrid models under prefix caching: the state groups whose states
        # move block to block (vLLM's "align" mode), and where each request's is.
        self.align_groups: list[int] = []
        self.state_index: AlignedStateIndex | None = None
        self.vocab_size = self.model_config.get_vocab_size()
        # Instrumentation (tests, logs): forward passes run and graph
        # evaluations made; equal unless VLLM_METAL_SYNC_PER_LAYER=1.
        self.forward_passes = 0
        self.evaluations = 0
        # Steps whose output was still unasked for when the next step arrived
        # (async scheduling: the engine ran ahead; tests read it).
        self.finished_by_next_step = 0
        self._pending: PendingStep | None = None
        # Under async scheduling vLLM's multiprocess executor asks for a step's
        # output on its own thread while the next execute_model may arrive.
        self._finish_lock = threading.RLock()  # a step finishes the step it reads tokens from first
        # The worker side of a KV connector (--kv-transfer-config: our disk
        # cache), driven here as vLLM's GPU runner drives its connector.
        self.kv_connector = None
        # LoRA adapters (--enable-lora): the loaded ones and each step's deltas (adapters/pool.py).
        self.adapters: AdapterPool | None = None
        self.multimodal: MultimodalStep | None = None  # a vision-language model serving images
        spec = vllm_config.speculative_config  # --speculative-config: drafts and their verify (speculative/)
        self.speculator = Speculator(spec, self.model_config.max_model_len, not only_builtin_logitsprocs(
            self.logitsprocs), self.async_scheduling) if spec is not None and not self.is_pooling else None

    # ---- start-up -------------------------------------------------------

    def load_model(self) -> None:
        dtype = TORCH_DTYPES.get(self.model_config.dtype)
        if dtype is None:
            raise ValueError(f"dtype {self.model_config.dtype} is not supported by vllm-metal "
                             "(use float32, float16 or bfloat16)")
        dequantize = envs.cpu_auto_switch("VLLM_METAL_DEQUANTIZE", self.device)
        if self.is_pooling:
            self.pooling = PoolingSide(self, dtype, dequantize, fuse_projections_enabled(self.device),
                                       cpu_norm_rope_enabled(self.device))
            self.batch.pooling = self.pooling
            return
        start = time.perf_counter()
        self.mlx_model = load_model(self.model_config.model, dtype=dtype, dequantize=dequantize,
                                    fuse=fuse_projections_enabled(self.device),
                                    norm_rope=cpu_norm_rope_enabled(self.device), parallel=self.parallel,
                                    config_path=self.model_config.hf_config_path)
        m = self.mlx_model
        spec = self.speculator
        if spec is not None and spec.drafter is None:  # --speculative-config with a draft model or MTP layer
            spec.load_model(self.vllm_config.speculative_config, m, dtype, dequantize,
                            fuse_projections_enabled(self.device), cpu_norm_rope_enabled(self.device))
        mm = getattr(self.model_config, "multimodal_config", None)
        if mm is not None and self.model_config.is_multimodal_model and not mm.language_model_only:
            self.multimodal = build_multimodal(self.model_config, m, m.dtype)  # images (multimodal/)
        lora = getattr(self.vllm_config, "lora_config", None)
        if lora is not None:
            self.adapters = AdapterPool(m, m.dtype, lora.max_lora_rank, lora.max_loras,
                                        lora.max_cpu_loras or lora.max_loras)
        logger.info("vllm-metal loaded %s (%s%s) on MLX %s in %.1fs%s", self.model_config.model, dtype,
                    ", MLX-quantized" if m.quantized else "", self.device, time.perf_counter() - start,
                    "".join(f"; {e}" for e in m.load_notes(self.parallel)))

    def weights_bytes(self) -> int:
        if self.pooling is not None:
            return self.pooling.weights_bytes
        tower = weights_bytes_of_tower(self.multimodal) if self.multimodal is not None else 0
        draft = self.draft.model.weights_bytes if self.draft is not None else 0
        return self.mlx_model.weights_bytes + tower + draft  # resident weights (loader.py; vision tower, draft model)

    def adapter_reserve_bytes(self) -> int:
        return self.adapters.reserve_bytes() if self.adapters is not None else 0

    def layer_name(self, i: int) -> str:
        return f"model.layers.{i}.self_attn"

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """One spec per layer with a cache of its own (layers reading an
        earlier layer's cache have none, as vLLM's KV sharing does).
        Linear-attention layers declare vLLM's Mamba-style state spec: one
        slot per request (mode "none"), or with prefix caching a block per
        attention block (mode "align", engine/state_align.py)."""
        if self.mlx_model is None:  # an encoder: no cache
            return {}
        specs = kv_specs.kv_cache_spec(self.vllm_config, self.mlx_model, self.layer_name)
        if self.draft is not None:  # the draft model's layers join vLLM's plan beside the target's
            specs.update(kv_specs.kv_cache_spec(self.vllm_config, self.draft.model, self.draft.layer_name))
        return specs

    @property
    def draft(self) -> ModelProposer | None:  # --speculative-config with a draft model / MTP
        return self.speculator.model if self.speculator is not None else None

    def kv_bytes_ratio(self) -> float:
        """Bytes allocated per byte vLLM plans for the KV cache (>= 1; kv_specs.kv_bytes_ratio)."""
        return kv_specs.kv_bytes_ratio(self.vllm_config, self.get_kv_cache_spec())

    def initialize_kv_cache(self, config: KVCacheConfig) -> None:
        m = self.mlx_model
        if m is None:  # an encoder: no cache
            return
        self.block_sizes, self.group_windows, _ = kv_specs.cache_groups(config, m, self.layer_name)
        self.align_groups = kv_specs.align_state_groups(config)
        if self.align_groups:
            self.state_index = AlignedStateIndex(self.block_sizes[self.align_groups[0]])
        # Block 0 is vLLM's null block: allocated, never handed to a request.
        self.kv = kv_specs.allocate(self.vllm_config, config, m, self.layer_name, self.block_sizes)
        if self.draft is not None:  # the draft's own cache (Gemma 4's assistant: the target's), same block tables
            self.draft.kv = self.kv if self.draft.reads_target_cache else kv_specs.allocate(
                self.vllm_config, config, self.draft.model, self.draft.layer_name, self.block_sizes)
        if self.sync_per_layer:
            self.kv.after_layer = lambda *arrays: self._evaluate(*arrays)
        logger.info("vllm-metal KV cache: %d blocks x %s tokens, %d layers, %.2f GiB", config.num_blocks,
                    self.block_sizes, len(m.owned) if m.owned is not None else m.num_layers,
                    sum(a.nbytes for a in self.kv.arrays()) / 2**30)

    def warm_up(self) -> None:
        warm_up.run(self)

    # ---- per step -------------------------------------------------------

    def _evaluate(self, *arrays) -> None:
        self.evaluations += 1
        mx.eval(*arrays)

    def _start_evaluation(self, *arrays) -> None:
        """The step's one evaluation, awaited now (synchronous scheduling) or
        only started (async scheduling: awaited when its output is asked for)."""
        if not self.async_scheduling:
            self._evaluate(*arrays)
            return
        self.evaluations += 1
        mx.async_eval(*arrays)

    def _forward(self, inputs, logit_rows: np.ndarray, argmax: bool = False,
                 after: mx.array | None = None, defer: bool = False, mtp=None):
        """The whole model over the packed step as one graph, its evaluation
        started (awaited unless async scheduling is on) or, with `defer`,
        returned as a callable that starts it (PendingStep.launch); the
        logits, lazy (None on a pipeline stage before the last: its output is
        sent), or with `argmax` each row's greedy token (int32, the logits stay in the graph).

        `after`: the previous step's tokens, which this graph reads (token
        feed). The graph is built while that step computes, but its
        evaluation starts only once that step is done: MLX's CPU backend
        decides at dispatch whether a cache write may reuse its input's
        buffer, and a buffer still held by the previous step's work would
        be copied whole (the KV cache, every layer, every step). `mtp`: the
        MTP layer's share of the graph, from the hidden states (speculative/mtp.py)."""
        self.forward_passes += 1
        m = self.mlx_model
        # An adapter may target the head: then its tokens come from the model's own logits.
        hidden = [] if mtp is not None else None  # (the MTP layer reads the final hidden states)
        out = m.forward(self.kv, inputs, logit_rows, greedy=argmax, fused_head=self.adapters is None, hidden_out=hidden)
        sends = m.transport.take_pending() if m.transport is not None else []
        arrays = [*([out] if out is not None else []), *sends, self.kv.arrays(), *(mtp(hidden[0]) if hidden else [])]

        def launch():
            if after is not None:
                mx.eval(after)
            self._start_evaluation(*arrays)

        if defer:
            return out, launch
        launch()
        return out, None

    def execute_model(self, so: SchedulerOutput):
        # The previous step is finished before the batch changes (async
        # scheduling: its output may not have been asked for yet).
        pending, self._pending = self._pending, None
        if pending is not None:  # a deferred start (one rank: the engine's own thread, MLX's streams are per thread)
            with self._finish_lock:
                pending.start()
        prev = None  # an unfinished step whose in-graph tokens this step may read (step_rows.py)
        if pending is not None and pending.sample_requested:
            if pending.feeds_tokens and self._may_feed():
                prev = pending
            else:
                if pending.output is None and pending.error is None:
                    self.finished_by_next_step += 1
                self._finish(pending)
        connector = self.kv_connector
        if connector is None:
            return self._execute(so, None, prev)
        # vLLM's connector lifecycle (kv_connector_model_runner_mixin): bind
        # the step's metadata, load before the forward, save after it, report
        # finished transfers and load errors, clear.
        connector.bind_connector_metadata(so.kv_connector_metadata)
        try:
            return self._execute(so, connector, prev)
        finally:
            connector.clear_connector_metadata()

    def _may_feed(self) -> bool:
        """The next step's graph may take this step's tokens from its graph:
        async scheduling, one rank, text only (images and pipeline stages
        read the input ids on the host)."""
        m = self.mlx_model
        return self.async_scheduling and self.multimodal is None and m.transport is None and \
            self.kv_connector is None and self.speculator is None  # drafts: proposed from the tokens

    def _execute(self, so: SchedulerOutput, connector, prev: PendingStep | None = None):
        self.batch.update(so)
        if self.speculator is not None:  # under async scheduling: its drafts in vLLM's placeholders
            so = self.speculator.begin_step(so, self.batch.states(), time.perf_counter())
        if self.state_index is not None:
            self.state_index.forget(so)
        if so.kv_cache_block_copies:  # the prefix cache's copy-on-write, before anything reads the blocks
            self.kv.copy_blocks(so.kv_cache_block_copies)
        if self.pooling is not None and so.total_num_scheduled_tokens and self.batch.rows:
            states = self.batch.states()
            return self.pooling.execute(states, [so.num_scheduled_tokens[s.req_id] for s in states])
        if so.total_num_scheduled_tokens == 0 or not self.batch.rows:
            if connector is None:
                return EMPTY_MODEL_RUNNER_OUTPUT
            # Nothing to compute: let saves in flight finish now, so finished
            # requests are reported (their blocks freed) before the engine idles.
            connector.fence()
            return ModelRunnerOutput.with_kv_conn_output_only(connector_output(so, connector))
        failed_loads: set[str] = set()
        if connector is not None:
            connector.start_load_kv(None)
            # A request whose blocks did not load computed on a bad prefix this
            # step: it samples nothing (vLLM recomputes it from the bad block).
            failed_loads = connector.failed_load_req_ids
        states = self.batch.states()
        spec = so.scheduled_spec_decode_tokens
        plan = step_rows.plan(states, so.num_scheduled_tokens, failed_loads,
                              prev.sampling_rows() if prev is not None else None, spec)
        if plan is None:  # a token the feed cannot give: the previous step finishes first
            self.finished_by_next_step += 1
            self._finish(prev)
            prev = None
            plan = step_rows.plan(states, so.num_scheduled_tokens, failed_loads, None, spec)
        rows = plan.rows
        if plan.padded_rows:
            self.speculator.count_padding(plan.padded_rows, plan.padded_drafts)
        inputs = build_step_inputs(rows, self.block_sizes, self.group_windows, self.batch.block_table_view())
        if plan.fed_at:
            inputs.token_ids_mx = step_rows.token_ids(inputs.token_ids, plan.fed_at, plan.fed_from, prev.tokens_mx)
            self.tokens_fed += len(plan.fed_at)
        # Even with no row reading them, `prev` stays this step's predecessor: its evaluation
        # is waited for before this one starts (the caches' buffers) and it finishes first.
        if self.multimodal is not None:  # the step's images: encoded, scattered, positioned (multimodal/step.py)
            self.multimodal.encode(so, self.batch.requests)
            self.multimodal.prepare(states, rows, inputs, self.mlx_model.embed_tokens)
        if self.state_index is not None:
            moved = self.state_index.plan([s.req_id for s in states], np.array([r.num_computed for r in rows]),
                                          np.diff(inputs.cu_seqlens_q), [inputs.block_tables[g] for g in self.align_groups])
            inputs.state_slots = dict(zip(self.align_groups, moved))
        if self.adapters is not None:
            self.adapters.begin_step([s.lora_request for s in states], np.diff(inputs.cu_seqlens_q))
        argmax = self.sample_in_graph and not plan.prompt_rows and not so.has_structured_output_requests \
            and all(greedy_in_graph(s) for s in states)
        defer = self.async_scheduling and self.device == "cpu" and connector is None and self.parallel is None
        mtp = self.speculator.mtp_step(rows, states, spec, lambda: rows_inputs(self)) if self.speculator else None
        try:
            out, launch = self._forward(inputs, np.array(plan.logit_rows, np.int64), argmax,
                                        prev.tokens_mx if prev is not None else None, defer, mtp)
        finally:
            if self.adapters is not None:
                self.adapters.end_step()
        if out is None:
            # A pipeline stage before the last: its part is done (evaluated
            # under the synchronous scheduling vLLM uses with pipelines);
            # the last stage samples and answers the engine.
            return None
        step = PendingStep(so, states, plan.discard, plan.prompt_rows, None if argmax else out,
                           tokens_mx=out if argmax else None, prev=prev, launch=launch, verify=plan.verify)
        self.steps_sampled_in_graph += argmax
        self.steps_deferred += launch is not None
        if not self.async_scheduling and not argmax:
            collect(step, self.kv.arrays(), self.vocab_size, self.model_config.logprobs_mode)
        # A disk save reads the written blocks: it waits for the evaluation
        # (the platform keeps async scheduling off with a connector).
        step.kv_connector_output = connector_output(so, connector) if connector is not None else None
        self._pending = step
        return None  # the engine calls sample_tokens next

    def sample_tokens(self, grammar_output: GrammarOutput | None):
        step = self._pending
        if step is None or step.sample_requested:
            return EMPTY_MODEL_RUNNER_OUTPUT
        step.sample_requested, step.grammar_output = True, grammar_output
        if self.async_scheduling:
            return AsyncStepOutput(self, step)
        self._pending = None
        return self._finish(step)

    def take_draft_token_ids(self):
        """The drafts proposed after the last step (vLLM's GPU runner's contract; None without speculation)."""
        return self.speculator.take() if self.speculator is not None else None

    def _finish(self, step: PendingStep) -> ModelRunnerOutput:
        """Waits for the step, samples it and builds its output, once (after
        the step it read tokens from); a failure (an evaluation error
        surfaces here) is kept and raised again to whoever asks for the
        output later."""
        with self._finish_lock:
            if step.prev is not None:
                prev, step.prev = step.prev, None
                self._finish(prev)
            step.start()
            if step.output is None and step.error is None:
                try:
                    step.output = sample_step(self, step)
                except BaseException as e:
                    step.error = e
                    raise
            if step.error is not None:
                raise step.error
            return step.output
