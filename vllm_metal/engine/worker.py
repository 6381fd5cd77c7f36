"""The vLLM worker: process and device lifecycle, memory, and the KV cache size.

Runs inside vLLM's engine process (the "uni" executor, one worker), or one
per rank in worker processes of vLLM's multiprocess executor (tensor /
pipeline parallel: distributed/join.py). Model execution is the
MetalModelRunner's job; this class picks the MLX device, joins the other
ranks, loads the model, tells the engine how much KV cache fits, and
forwards steps.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

from vllm.logger import init_logger
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from vllm_metal.native import fast_blas

fast_blas.preload()  # before anything imports mlx.core

import mlx.core as mx  # noqa: E402
import torch  # noqa: E402

from vllm_metal.engine import upstream_patches  # noqa: E402
from vllm_metal.native import memory
from vllm_metal.engine.startup_line import startup_line  # noqa: E402
from vllm_metal.engine.model_runner import MetalModelRunner  # noqa: E402
from vllm_metal.engine.platform import mlx_device_name  # noqa: E402

logger = init_logger("vllm." + __name__)  # under vLLM's configured "vllm" logger


class MetalWorker(WorkerBase):
    def init_device(self) -> None:
        self.device_name = mlx_device_name()
        if self.device_name == "gpu":
            if not mx.metal.is_available():
                raise RuntimeError("VLLM_METAL_DEVICE=gpu but MLX has no Metal device here; "
                                   "use VLLM_METAL_DEVICE=cpu")
            mx.set_default_device(mx.gpu)
        else:
            mx.set_default_device(mx.cpu)
            # One thread budget on the CPU device: the model's compute runs on MLX's
            # stream thread plus one worker of our kernels' pools (or OpenBLAS's,
            # in prefill GEMMs), one core each. torch only samples ([rows, vocab]
            # argmax/softmax, a fraction of a millisecond); its OpenMP workers
            # would spin on the cores those pools need after every call.
            torch.set_num_threads(1)
        upstream_patches.patch_torch_accelerator()  # see the module: vLLM's shutdown path
        set_random_seed(self.model_config.seed)
        mx.random.seed(self.model_config.seed or 0)
        logger.info("vllm-metal: %s", startup_line(self.device_name))
        self.joined = None
        if self.parallel_config.world_size > 1:
            from vllm_metal.distributed.join import join

            self.joined = join(self.vllm_config, self.rank, self.local_rank, self.distributed_init_method,
                               self.device_name)
        self.model_runner = MetalModelRunner(self.vllm_config, self.device_name,
                                             self.joined.plan if self.joined is not None else None)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("vllm-metal loads real weights only (no dummy load format)")
        self.check_fit()
        self.model_runner.load_model()

    def check_fit(self) -> None:
        """Refuses, before any weight is read, a model whose weights and one
        request of --max-model-len cannot fit in the memory this worker will
        give them, with the numbers and the flag that fixes it (native/fit.py;
        vLLM's own check after loading still runs). Here rather than in the
        platform's config check: the device's memory is Metal's to say, and
        Metal must not be touched in the API process before the engine's is
        started. A checkpoint the arithmetic cannot read is left to the load."""
        from vllm_metal import envs
        from vllm_metal.models.footprint import checkpoint_footprint
        from vllm_metal.engine.kv_specs import kv_cache_dtype
        from vllm_metal.native import fit

        config, cache, parallel = self.model_config, self.cache_config, self.parallel_config
        expand = envs.cpu_auto_switch("VLLM_METAL_DEQUANTIZE", self.device_name)
        try:
            fp = checkpoint_footprint(config.model, config.hf_config_path, self.device_name,
                                      str(config.dtype).removeprefix("torch."))
        except Exception as e:  # noqa: BLE001 -- the load says what is wrong with the checkpoint
            logger.info("vllm-metal: memory not checked before loading (%s: %s)", type(e).__name__, e)
            return
        if not fp.served:
            return  # the load refuses it, naming why
        plan = fp.plan(config.max_model_len, kv_cache_dtype(self.vllm_config), block_size=cache.block_size,
                       in_flight_tokens=self.vllm_config.max_in_flight_tokens,
                       hybrid_manager=not self.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
                       align=cache.mamba_cache_mode == "align")
        local_ranks = max(parallel.world_size // max(parallel.nnodes, 1), 1)
        device = fit.Device(self.device_name, memory.device_total_memory(self.device_name) // local_ranks,
                            cache.gpu_memory_utilization, cache.kv_cache_memory_bytes)
        how = (f"{fp.quant}, " + ("expanded to " if expand else "kept packed, the rest in ") + fp.dtype
               if fp.packed != fp.expanded else fp.dtype)
        # A pooling model's cache holds prompts in flight only; --num-gpu-blocks-override sizes it by blocks.
        judged = not self.model_runner.is_pooling and cache.num_gpu_blocks_override is None
        result = fit.check(fp.weights(expand), fp.layers if judged else [], plan, device,
                           share=parallel.world_size, label=config.model, weights_note=how,
                           smaller_weights=fp.four_bit, packed_weights=fp.packed,
                           auto_length=getattr(config, "original_max_model_len", 0) == -1)
        if not result.fits:
            raise ValueError(result.message)
        logger.info("vllm-metal: %s fits: weights %.2f GiB, one request of %d tokens %.2f GiB of KV cache, "
                    "%.2f GiB for the KV cache (before loading)", config.model, result.weights / 2**30,
                    config.max_model_len, result.kv_needed / 2**30, result.available / 2**30)

    def get_model(self):
        return self.model_runner.mlx_model

    def get_supported_tasks(self):
        pooling = self.model_runner.pooling
        return pooling.tasks() if pooling is not None else ("generate",)

    def get_kv_cache_spec(self):
        return self.model_runner.get_kv_cache_spec()

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]  # our own layout; vLLM's torch attention backends are never used

    def determine_available_memory(self) -> int:
        import psutil

        runner = self.model_runner
        if runner.sample_in_graph and runner.mlx_model is not None:
            runner.mlx_model.greedy_head()  # its probe, and on the CPU its screen: resident before memory is read
        weights = runner.weights_bytes()
        used = max(psutil.Process().memory_info().rss - weights, 0) if self.device_name == "cpu" \
            else max(mx.get_active_memory() - weights, 0)
        # Ranks on one host share its memory evenly.
        parallel = self.parallel_config
        local_ranks = max(parallel.world_size // max(parallel.nnodes, 1), 1)
        # LoRA adapters (--enable-lora) get their most, at --max-lora-rank, kept free.
        adapters = self.model_runner.adapter_reserve_bytes()
        budget = memory.kv_cache_budget(
            device=self.device_name, total=memory.device_total_memory(self.device_name) // local_ranks,
            utilization=self.cache_config.gpu_memory_utilization, weights=weights, other_used=used + adapters,
            explicit=self.cache_config.kv_cache_memory_bytes)
        if adapters:
            logger.info("vllm-metal: %.2f GiB kept for LoRA adapters (--max-cpu-loras + --max-loras at "
                        "--max-lora-rank)", adapters / 2**30)
        if self.model_runner.pooling is not None and self.cache_config.kv_cache_memory_bytes is None:
            # A pooling model's cache holds prompts in flight only (pooling/serving_config.py).
            from vllm_metal.pooling.serving_config import pooling_kv_budget

            specs = self.model_runner.get_kv_cache_spec().values()
            per_token = sum(spec.page_size_bytes / spec.block_size for spec in specs)
            budget = min(budget, pooling_kv_budget(self.vllm_config, per_token))
            logger.info("vllm-metal: a pooling model's KV cache holds prompts in flight: %.1f MiB",
                        budget / 2**20)
        # vLLM lays its cache groups over one allocation; layers here share
        # arrays only where their shapes agree (linear-attention states, say,
        # have their own: kv_specs.kv_bytes_ratio).
        ratio = self.model_runner.kv_bytes_ratio()
        logger.info("vllm-metal KV cache budget: %.2f GiB%s", budget / 2**30,
                    f" (planned as {budget / ratio / 2**30:.2f} GiB: {ratio:.2f}x per planned byte, layers "
                    "of different cache groups whose arrays differ cannot share them)" if ratio > 1 else "")
        return int(budget / ratio)

    def initialize_from_config(self, kv_cache_config) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)
        memory.set_wired_limit(self.device_name, mx.get_active_memory())
        if self.vllm_config.kv_transfer_config is not None:
            self._init_kv_connector(kv_cache_config)

    def _init_kv_connector(self, kv_cache_config) -> None:
        """The worker side of --kv-transfer-config, built by vLLM's factory
        (the gate lets only vllm-metal's MLX connectors through). Owned here
        rather than through vLLM's process-global transfer group, whose set-up
        needs torch.distributed groups this single worker never creates."""
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        connector = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        if not hasattr(connector, "register_mlx_cache"):
            raise ValueError(f"KV connector {type(connector).__name__} cannot use MLX caches")
        runner = self.model_runner
        m = runner.mlx_model
        connector.register_mlx_cache(runner.kv, {runner.layer_name(i): i for i in range(m.num_layers)},
                                     m.sliding_windows)
        runner.kv_connector = connector

    def get_kv_connector_handshake_metadata(self):
        return None  # the disk connector exchanges nothing between workers

    def compile_or_warm_up_model(self) -> CompilationTimes:
        self.model_runner.warm_up()
        set_random_seed(self.model_config.seed)
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def execute_model(self, scheduler_output):
        with self._rank_failure_exits():
            return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output):
        with self._rank_failure_exits():
            return self.model_runner.sample_tokens(grammar_output)

    @contextmanager
    def _rank_failure_exits(self):
        """In a multi-rank run a step that fails on one rank -- most often a
        peer that died or became unreachable (MLX's ring reports the lost
        connection) -- ends this worker process: vLLM hears only the output
        rank's answer, so an error elsewhere would leave the engine waiting,
        while a worker that exits is seen at once by vLLM's worker monitor
        (the engine then fails its requests and the server exits), and its
        own neighbours' transfers fail in turn, so the failure reaches the
        host running the engine."""
        try:
            yield
        except Exception as e:
            if self.joined is None:
                raise
            t = self.joined.topology
            logger.error("vllm-metal rank %d (pp %d/%d, tp %d/%d) stops: its step failed: %s: %s. The other "
                         "ranks and the server stop too.", t.rank, t.pp_rank, t.pp, t.tp_rank, t.tp,
                         type(e).__name__, e)
            for handler in logging.getLogger("vllm").handlers:
                handler.flush()
            os._exit(70)

    # vLLM's LoRA contract (engine core -> executor -> collective_rpc):
    # adapters/pool.py does the work; an adapter that cannot be served raises
    # AdapterError (a ValueError) naming it and why.

    def add_lora(self, lora_request) -> bool:
        return self._adapters().add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._adapters().remove(lora_id)

    def list_loras(self) -> set[int]:
        return self._adapters().list()

    def pin_lora(self, lora_id: int) -> bool:
        return self._adapters().pin(lora_id)

    def _adapters(self):
        pool = self.model_runner.adapters if self.model_runner is not None else None
        if pool is None:
            raise RuntimeError("LoRA is not enabled: start the engine with --enable-lora")
        return pool

    def take_draft_token_ids(self):
        return self.model_runner.take_draft_token_ids() if self.model_runner is not None else None

    def reset_encoder_cache(self) -> None:
        """Called by the engine when it pauses with cache clearing; text
        models keep no encoder cache."""
        return None

    def check_health(self) -> None:
        return None

    def memory_stats(self) -> dict[str, int]:
        """MLX and process memory and the runner's live request states, read in
        the engine process (where MLX lives). Reached through collective_rpc,
        e.g. `vllm serve`'s dev endpoint POST /collective_rpc
        {"method": "memory_stats"} (VLLM_SERVER_DEV_MODE=1); the reliability
        tests use it to bound leaks."""
        import psutil

        batch = self.model_runner.batch if self.model_runner is not None else None
        return dict(mlx_active_bytes=mx.get_active_memory(), mlx_cache_bytes=mx.get_cache_memory(),
                    mlx_peak_bytes=mx.get_peak_memory(), rss_bytes=psutil.Process().memory_info().rss,
                    request_states=len(batch.requests) if batch is not None else 0,
                    batch_rows=len(batch.rows) if batch is not None else 0)

    def shutdown(self) -> None:
        connector = getattr(self.model_runner, "kv_connector", None)
        if connector is not None:
            connector.shutdown()  # saves in flight reach the disk
        self.model_runner = None
        if getattr(self, "joined", None) is not None:
            self.joined.liveness.close()  # an orderly stop: the peers are told
