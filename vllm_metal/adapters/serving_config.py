"""What `--enable-lora` may be combined with here, checked in the API and
engine processes before anything loads (no MLX import: the platform runs it).

Served: --max-loras adapters per step, --max-lora-rank, --max-cpu-loras
adapters kept loaded, runtime loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING).
Refused with the alternative: adapters across tensor / pipeline parallel
ranks, and vLLM's multimodal-tower adapters (images are not served).
"""

from __future__ import annotations

from vllm.logger import init_logger

logger = init_logger("vllm." + __name__)


def check_lora_config(vllm_config) -> None:
    lora = vllm_config.lora_config
    if lora is None:
        return
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise ValueError(f"vllm-metal serves LoRA adapters on one rank: --enable-lora with tensor parallel "
                         f"{parallel.tensor_parallel_size} / pipeline parallel {parallel.pipeline_parallel_size} "
                         "is refused. Serve the adapters on one Mac, or merge an adapter into the model "
                         "(mlx_lm.fuse) and serve that model across ranks.")
    if getattr(lora, "enable_tower_connector_lora", False) or getattr(lora, "default_mm_loras", None):
        raise ValueError("vllm-metal serves text models only: multimodal LoRA options (--enable-tower-connector-"
                         "lora, --default-mm-loras) are refused; drop them.")
    if getattr(lora, "target_modules", None):
        raise ValueError(f"vllm-metal applies each adapter to every module it holds: --lora-target-modules "
                         f"{lora.target_modules} (a deployment-time restriction) is refused; drop it, or train / "
                         "save the adapter with only those modules.")
    model = vllm_config.model_config
    lora_dtype = getattr(lora, "lora_dtype", "auto")
    if model is not None and lora_dtype not in ("auto", None, model.dtype):
        logger.warning("vllm-metal computes LoRA deltas in the model dtype %s; --lora-dtype %s is inert",
                       model.dtype, lora_dtype)


# What `vllm-metal doctor` reports (docs/lora.md says the same at length).
REFUSED_ADAPTERS = (
    "tensor / pipeline parallel with --enable-lora",
    "adapters on the embedding or the output head (lora_embedding_*, lm_head), modules_to_save",
    "DoRA (PEFT use_dora, mlx-lm fine_tune_type dora), adapter biases, PEFT variants vLLM refuses "
    "(aLoRA, QALoRA, PiSSA/OLoRA/LoftQ inits, layer replication)",
    "per-expert MoE adapters (PEFT experts.N, mlx-lm switch_mlp)",
    "latent attention's kv_b_proj (absorbed at load)",
    "a full fine-tune (mlx-lm fine_tune_type full) named as an adapter",
    "rank above --max-lora-rank; tensors that do not match the model's projections",
)


def lora_capability() -> dict:
    return {"served": True,
            "formats": ["PEFT (adapter_config.json + adapter_model.safetensors)",
                        "mlx-lm (mlx_lm.lora: adapter_config.json + adapters.safetensors)"],
            "targets": "every projection a decoder layer computes: attention (fused q/k/v included), dense and "
                       "shared-expert MLPs (fused gate/up included), MoE routers",
            "batching": "up to --max-loras adapters per step mixed with the base model in the step's one graph; "
                        "--max-cpu-loras kept loaded (least recently used out, pinned kept)",
            "refused": list(REFUSED_ADAPTERS)}
