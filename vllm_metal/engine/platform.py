"""The vLLM platform for MLX: what the device is and which config it forces.

vLLM imports this in the API process and in the engine process. It must not
touch `vllm.platforms.current_platform` at import (that re-enters platform
resolution), and it never imports MLX: the worker does, in the engine process.
"""

from __future__ import annotations

import os
import platform as _host

import torch
import vllm
from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

from vllm_metal import activation, envs, versions

# vLLM resolves the platform class by importing this module: an unsupported
# vLLM stops here, with the supported range, before anything half-works.
versions.check_vllm(vllm.__version__)

logger = init_logger("vllm." + __name__)  # under vLLM's configured "vllm" logger


def mlx_device_name() -> str:
    """'gpu' or 'cpu': the MLX device the worker will use (decided without MLX)."""
    chosen = (envs.get("VLLM_METAL_DEVICE") or "").strip().lower()
    if chosen in ("gpu", "cpu"):
        return chosen
    return "gpu" if activation.is_apple_silicon() else "cpu"


class MetalPlatform(Platform):
    # OOT, not CPU: vLLM routes is_cpu() platforms to its compiled torch.ops._C
    # sampling kernels, which this platform never loads.
    _enum = PlatformEnum.OOT
    # Host tensors (sampling, logits) are torch CPU tensors; the model runs in
    # MLX. vLLM builds torch devices from device_name (its process groups
    # under tensor/pipeline parallel: torch.device(f"{device_name}:{rank}")),
    # so it names torch's device; get_device_name says what the MLX device is.
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    ray_device_key: str = ""
    dist_backend: str = "gloo"
    device_control_env_var: str = "VLLM_METAL_DEVICE"
    # torch.compile'd helpers (logprob ranks) run eagerly: no inductor / C++ JIT.
    simple_compile_backend: str = "eager"
    supported_quantization: list[str] = []

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        # The first entry is what float32 checkpoints are served in by default:
        # Metal is fastest in bfloat16; MLX's CPU device only has fast float32
        # matmul (BLAS), so there float32 comes first.
        if mlx_device_name() == "cpu":
            return [torch.float32, torch.bfloat16, torch.float16]
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        if mlx_device_name() == "gpu":
            return f"Apple {_host.machine()} GPU (MLX Metal)"
        return f"{_host.processor() or _host.machine()} CPU (MLX)"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        from vllm_metal.native.memory import device_total_memory

        return device_total_memory(mlx_device_name())

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        import psutil

        return float(psutil.Process().memory_info().rss)

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        return None

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        # torch is seeded by vLLM itself; MLX is seeded by the worker.
        return None

    @classmethod
    def import_kernels(cls) -> None:
        # Never load vLLM's compiled CUDA/AVX512 extensions (vllm._C, _moe_C...).
        return None

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def get_punica_wrapper(cls) -> str:
        # Only vLLM's torch LoRA layers ask; here adapters run in MLX (vllm_metal/adapters/).
        raise NotImplementedError("vllm-metal applies LoRA adapters in MLX (vllm_metal/adapters), not with "
                                  "vLLM's punica kernels")

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        # vLLM's torch attention layers are never built (the model is MLX).
        from vllm_metal.engine.cuda_gate import reject_attention_backend

        reject_attention_backend(selected_backend)
        return "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"

    @classmethod
    def verify_quantization(cls, quant: str) -> None:
        from vllm_metal.engine.cuda_gate import reject_quantization

        reject_quantization(quant)

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        """Per request, in vLLM's input processing (a refusal is that
        request's error, HTTP 400). Prompt logprobs of a prompt whose prefix
        is read from the prefix cache: its cached positions are never
        computed, so they would have no scores (vLLM's GPU runner hands over
        uninitialised rows; here they crashed vLLM's detokenizer). vLLM skips
        the cache for prompt-logprob requests unless told otherwise."""
        if getattr(params, "prompt_logprobs", None) is not None and \
                getattr(params, "skip_reading_prefix_cache", None) is False:
            raise ValueError("vllm-metal cannot give prompt logprobs for a prompt read from the prefix cache "
                             "(skip_reading_prefix_cache=False): its cached positions are never computed. Leave "
                             "skip_reading_prefix_cache unset (vLLM then computes the whole prompt for prompt "
                             "logprobs) or drop prompt_logprobs.")

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        # vLLM's hybrid KV-cache manager (one KV-cache group per kind of
        # layer): hybrid linear-attention models need it for their state
        # slots (a Mamba group), sliding-window models their windows' blocks
        # (_shares_window_blocks, on both devices); off for the others.
        return True

    @classmethod
    def update_block_size_for_backend(cls, vllm_config) -> None:
        """Hybrid models: the attention block size that keeps the KV cache's
        block ids from running out first. vLLM's hybrid manager gives every
        KV-cache group the same pages (the attention page padded to the
        state page) from one pool of block ids; with 16-token attention
        blocks and a Gated DeltaNet state of 1 MiB per layer, a 576-token
        request takes 36 ids for its attention and 3 for its states, and
        the pool runs out of ids while most of the memory is idle. vLLM's
        own alignment (the base method) makes the attention page at least
        the state page, but finds no attention layers here (the model is
        MLX). So: the smallest block size the paged-attention primitive
        supports whose attention page reaches the state page, else its
        largest (128). Non-hybrid models and an explicit --block-size keep
        theirs."""
        cache, model = vllm_config.cache_config, vllm_config.model_config
        if model is None or not model.is_hybrid or cache.user_specified_block_size:
            return
        try:
            pages = _hybrid_page_sizes(vllm_config)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            # vLLM's model class cannot size this config's state (a field it
            # reads is absent, e.g. lfm2's conv_dim, whose short-convolution
            # state is small anyway): the default block size stays.
            logger.info("vllm-metal: attention block size %d kept for %s (state page size unknown: %s)",
                        cache.block_size, model.architecture, e)
            return
        cache.block_size = hybrid_attention_block_size(*pages)
        if cache.mamba_cache_mode == "align":
            cache.mamba_block_size = cache.block_size  # a state checkpoint per attention block
        logger.info("vllm-metal: attention block size %d for %s (%d bytes of K/V a token, a state page "
                    "of %d bytes)", cache.block_size, model.architecture, *pages)

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return False

    @classmethod
    def use_custom_allreduce(cls) -> bool:
        return False

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        return None

    @classmethod
    def apply_config_platform_defaults(cls, vllm_config) -> None:
        """Sees the user's config before vLLM fills in its defaults: the place
        to notice explicit requests for CUDA-only paths (see cuda_gate)."""
        from vllm_metal.engine.cuda_gate import gate_config

        gate_config(vllm_config)

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        """Runs before vLLM builds a config (and its CLI parser): GGUF
        checkpoints get their config parser and tokenizer, unreachable media
        URLs a 4xx (upstream_patches)."""
        from vllm_metal.engine.upstream_patches import patch_gguf_model_args, patch_media_fetch_status

        patch_gguf_model_args()
        patch_media_fetch_status()  # an unreachable image URL: HTTP 422 naming it, not 500

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        """Forces our worker and turns CUDA-only features off. Idempotent: vLLM
        calls it in the API process and again in the engine process."""
        from vllm.config import CompilationMode, CUDAGraphMode

        if vllm_config.use_v2_model_runner:
            # register() sets VLLM_USE_V2_MODEL_RUNNER=0 unless the user chose 1.
            raise ValueError("vllm-metal implements vLLM's V1 model-runner contract (resumed requests "
                             "arrive as cached requests with their tokens); unset VLLM_USE_V2_MODEL_RUNNER")
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = "vllm_metal.engine.worker.MetalWorker"
        cls._configure_parallel(parallel)
        from vllm_metal.native.allocator import configure_engine_process
        from vllm_metal.native.mkl_gemm import choice as sgemm_choice

        sgemm_choice()  # a VLLM_METAL_SGEMM the BLAS set-up could not honour is refused by name
        allocator = configure_engine_process(mlx_device_name())  # tcmalloc for the engine process (Linux CPU)
        logger.info_once("vllm-metal: engine allocator: %s", allocator.reason)
        if vllm_config.lora_config is not None:
            from vllm_metal.adapters.serving_config import check_lora_config
            from vllm_metal.engine.upstream_patches import patch_lora_load_status

            check_lora_config(vllm_config)
            patch_lora_load_status()  # an adapter refused at load: HTTP 400, not 500
        from vllm_metal.pooling.serving_config import check_pooling_config

        check_pooling_config(vllm_config)  # --runner pooling: what it may be combined with
        from vllm_metal.speculative.serving_config import check_speculative_config

        check_speculative_config(vllm_config)  # --speculative-config: the methods served (speculative/)
        # Async scheduling stays vLLM's choice (on by default, with speculation too): the runner
        # starts a step's evaluation and lets the engine schedule the next
        # step meanwhile (model_runner.py); not with a KV connector (below).
        cache = vllm_config.cache_config
        if not cache.user_specified_block_size:
            cache.block_size = 16
        hybrid = vllm_config.model_config is not None and vllm_config.model_config.is_hybrid
        if (not hybrid and not cls._shares_window_blocks(vllm_config)
                and vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is None):
            vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = True
        model = vllm_config.model_config
        if hybrid and (cache.mamba_cache_dtype != "auto" or cache.mamba_ssm_cache_dtype != "auto"):
            # The runner keeps mlx-lm's state dtypes (convolution: the model
            # dtype; recurrent: float32); another dtype would be ignored.
            raise ValueError(f"vllm-metal keeps linear-attention states in mlx-lm's dtypes (the model dtype for "
                             f"the convolution, float32 for the recurrent state): leave --mamba-cache-dtype and "
                             f"--mamba-ssm-cache-dtype at auto (got {cache.mamba_cache_dtype!r}, "
                             f"{cache.mamba_ssm_cache_dtype!r}).")
        if hybrid and cache.mamba_cache_mode == "align":
            # Prefix caching (vLLM's default for hybrids): a state block per
            # attention block (engine/state_align.py), as vLLM's own hybrid
            # alignment sets it; update_block_size_for_backend keeps them equal.
            cache.mamba_block_size = cache.block_size
        elif hybrid and cache.mamba_block_size is not None and cache.mamba_block_size < model.max_model_len:
            # Without prefix caching one state block covers a whole request (vLLM's default for mode "none").
            raise ValueError(f"vllm-metal keeps one linear-attention state slot per request without prefix "
                             f"caching: leave --mamba-block-size unset (got {cache.mamba_block_size}, below "
                             f"max_model_len {model.max_model_len}).")
        if model is not None and model.is_multimodal_model and model.supports_multimodal_inputs:
            from vllm_metal.multimodal.serving import configure

            configure(model, vllm_config.scheduler_config, parallel)  # images served, or the text model only
        compilation = vllm_config.compilation_config
        compilation.mode = CompilationMode.NONE
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        compilation.cudagraph_capture_sizes = []
        if vllm_config.model_config is not None:
            vllm_config.model_config.enforce_eager = True
        sched = vllm_config.scheduler_config
        if parallel.pipeline_parallel_size > 1 and sched.scheduler_cls is None and not sched.async_scheduling:
            from vllm_metal.distributed.scheduler import QUALNAME

            sched.scheduler_cls = QUALNAME  # micro-batches kept apart (distributed/scheduler.py)
        cls._configure_kv_disk(vllm_config)
        # A step's connector output needs its evaluation (no overlap to gain),
        # and a failed block load rolls the request back after vLLM has
        # already scheduled the next step on the token that load never gave.
        if vllm_config.kv_transfer_config is not None and vllm_config.scheduler_config.async_scheduling:
            logger.info("vllm-metal: async scheduling off with a KV connector (its loads and saves wait "
                        "for each step's evaluation, and a failed load must roll back before the next step)")
            vllm_config.scheduler_config.async_scheduling = False

    @staticmethod
    def _shares_window_blocks(vllm_config) -> bool:
        """vLLM's hybrid manager stays vLLM's choice for sliding-window models (Metal and
        MLX's CPU device alike): windows hold their blocks only, one array pair per vLLM
        tensor shared by a layer of each group (kv_specs.layer_shares), written by the
        later layers as an alias (native/kv_writes.py; on Metal metal/write_kv.metal's
        kernel, in place where MLX's scatter would copy the shared array)."""
        model = vllm_config.model_config
        return model is not None and bool(model.get_sliding_window())

    @classmethod
    def _configure_parallel(cls, parallel) -> None:
        """One rank: vLLM's in-process "uni" executor. Several (tensor /
        pipeline parallel, distributed/): vLLM's multiprocess executor, one
        spawned worker per rank (spawn: a fork after Metal or MLX's threads
        started crashes or deadlocks)."""
        if parallel.data_parallel_size > 1:
            raise ValueError("vllm-metal does not run data parallel (--data-parallel-size "
                             f"{parallel.data_parallel_size}): start one server per Mac and balance in front")
        for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
            if getattr(parallel, name, 1) > 1:
                raise ValueError(f"vllm-metal does not support context parallel ({name}={getattr(parallel, name)})")
        if parallel.enable_expert_parallel:
            raise ValueError("vllm-metal does not support expert parallel (--enable-expert-parallel)")
        if parallel.world_size == 1:
            if parallel.distributed_executor_backend in (None, "mp"):
                parallel.distributed_executor_backend = "uni"
            return
        if parallel.distributed_executor_backend in (None, "uni"):
            parallel.distributed_executor_backend = "mp"
        if parallel.distributed_executor_backend != "mp":
            # Ray is not installed in this project's environment, so its
            # executor with our workers is unproven: refused, not guessed.
            raise ValueError(f"vllm-metal runs several ranks with vLLM's multiprocess executor (mp, also across "
                             f"hosts: --nnodes/--node-rank/--headless), not "
                             f"{parallel.distributed_executor_backend!r}")
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        if parallel.nnodes > 1 and "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS" not in os.environ:
            # The engine waits for the answer of the last stage's first rank;
            # on another host vLLM cannot see that rank die, so a step it
            # never answers fails after this long (vLLM's default: 300 s).
            # Lost ranks are otherwise found in seconds (distributed/liveness.py).
            os.environ["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = envs.get("VLLM_METAL_STEP_TIMEOUT")
        if parallel.distributed_timeout_seconds is None:
            parallel.distributed_timeout_seconds = int(envs.get("VLLM_METAL_DISTRIBUTED_TIMEOUT"))

    @classmethod
    def _configure_kv_disk(cls, vllm_config) -> None:
        """VLLM_METAL_KV_DISK=PATH turns the disk KV cache on (the same
        kv_transfer_config a user could pass); our connector named without its
        module path gets it (vLLM's registry does not know the name)."""
        from vllm_metal.kv.connector_config import MODULE_PATH, is_ours, transfer_config_dict

        kt = vllm_config.kv_transfer_config
        path = envs.get("VLLM_METAL_KV_DISK")
        if kt is None and path:
            from vllm.config.kv_transfer import KVTransferConfig

            max_bytes = envs.get("VLLM_METAL_KV_DISK_MAX_BYTES")
            vllm_config.kv_transfer_config = KVTransferConfig(
                **transfer_config_dict(path, int(max_bytes) if max_bytes else None))
            logger.info("vllm-metal disk KV cache on: %s", path)
        kt = vllm_config.kv_transfer_config
        if is_ours(kt) and vllm_config.model_config is not None and vllm_config.model_config.is_hybrid:
            raise ValueError("vllm-metal's disk KV cache saves attention KV blocks only; hybrid "
                             "linear-attention models keep per-request recurrent state it cannot restore: "
                             "serve without --kv-transfer-config / VLLM_METAL_KV_DISK")
        if is_ours(kt):
            kt.kv_connector_module_path = MODULE_PATH
            # A block file that fails to load (corrupt, vanished) is recomputed,
            # never a failed request: vLLM's default policy is "fail".
            kt.kv_load_failure_policy = "recompute"


# Block sizes the paged-attention primitive supports (csrc/paged_attention.cpp
# is_supported_block_size; tests/engine/test_hybrid.py checks they agree).
ATTENTION_BLOCK_SIZES = (8, 16, 32, 64, 128)


def hybrid_attention_block_size(attention_page_per_token: int, state_page: int, minimum: int = 16) -> int:
    """The smallest supported block size >= `minimum` whose attention page
    (bytes per token x block size) holds at least `state_page` bytes, else
    the largest supported."""
    for size in ATTENTION_BLOCK_SIZES:
        if size >= minimum and size * attention_page_per_token >= state_page:
            return size
    return ATTENTION_BLOCK_SIZES[-1]


def _hybrid_page_sizes(vllm_config) -> tuple[int, int]:
    """(attention bytes per token of one layer, one layer's state page), as
    vLLM's own hybrid alignment computes them: the state shapes and dtypes
    from vLLM's model class for the architecture (its config resolution;
    the runner allocates mlx-lm's shapes, of the same sizes)."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model.architecture, model_config=model)
    state_page = MambaSpec(shapes=model_cls.get_mamba_state_shape_from_config(vllm_config),
                           dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
                           block_size=-1).page_size_bytes
    attention = FullAttentionSpec(block_size=1, num_kv_heads=model.get_num_kv_heads(parallel),
                                  head_size=model.get_head_size(), dtype=model.dtype).page_size_bytes
    return attention, state_page
