"""What `--runner pooling` may be combined with here, checked in the API and
engine processes before anything loads (no MLX import: the platform runs
it), and how much KV cache a pooling model gets.

Served: embedding models and sequence classifiers (rerankers), decoder
families through `--convert embed|classify` or `*ForSequenceClassification`
checkpoints, encoder families (models/encoders.py) natively; every vLLM
pooling task of the model (embed, token_embed, classify, token_classify,
score through them), with vLLM's defaults (chunked prefill and prefix
caching where vLLM turns them on: causal models with last-token pooling).
Refused with the alternative: tensor / pipeline parallel, LoRA adapters,
and speculative decoding with a pooling model.
"""

from __future__ import annotations

from vllm.logger import init_logger

logger = init_logger("vllm." + __name__)

ENCODER_TYPES = ("bert", "modernbert", "roberta", "xlm-roberta")  # models/encoders.py's ENCODERS (checked by a test)


def is_pooling(vllm_config) -> bool:
    model = vllm_config.model_config
    return model is not None and getattr(model, "runner_type", "generate") == "pooling"


def is_encoder_config(model_config) -> bool:
    return getattr(model_config.hf_config, "model_type", None) in ENCODER_TYPES


def check_pooling_config(vllm_config) -> None:
    if not is_pooling(vllm_config):
        return
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise ValueError(f"vllm-metal serves pooling models on one rank: --runner pooling with tensor parallel "
                         f"{parallel.tensor_parallel_size} / pipeline parallel {parallel.pipeline_parallel_size} "
                         "is refused. Embedding and reranker models fit one Mac; run one server per Mac.")
    if vllm_config.lora_config is not None:
        raise ValueError("vllm-metal serves LoRA adapters on generation models: --enable-lora with --runner "
                         "pooling is refused. Merge the adapter into the model (PEFT merge_and_unload, "
                         "mlx_lm.fuse) and serve the merged checkpoint.")
    if vllm_config.kv_transfer_config is not None:
        raise ValueError("the disk KV cache (--kv-transfer-config) serves generation models; a pooling model "
                         "keeps no cache between requests: drop --kv-transfer-config")
    if vllm_config.speculative_config is not None:
        raise ValueError("a pooling model generates no tokens: drop --speculative-config")
    if is_encoder_config(model) and getattr(model.hf_config, "is_causal", False):
        raise ValueError(f"{model.model}: a causal {model.hf_config.model_type} is not served; "
                         "vllm-metal serves encoders with bidirectional attention")


def pooling_kv_budget(vllm_config, bytes_per_token: float) -> int:
    """The most KV cache a causal pooling model can use: a pooling request
    holds blocks only while its prompt is prefilled (it never decodes), so
    the cache needs room for one step's tokens (--max-num-batched-tokens),
    one prompt of --max-model-len prefilled chunk by chunk (vLLM requires
    one to fit) and each running request's partial block -- not the
    generator's share of the machine's memory. An explicit
    --kv-cache-memory-bytes still wins (the worker applies it)."""
    sched = vllm_config.scheduler_config
    block = vllm_config.cache_config.block_size
    tokens = sched.max_num_batched_tokens + vllm_config.model_config.max_model_len + sched.max_num_seqs * block
    return int(tokens * bytes_per_token)


def pooling_capability() -> dict:
    """What `vllm-metal doctor` reports."""
    return {"served": True,
            "runner": "--runner pooling; --convert embed | classify",
            "encoders": ", ".join(ENCODER_TYPES) + " (bidirectional: the paged-attention primitive's non-causal mode; no KV cache)",
            "decoders": "every served text family, as embedder (--convert embed) or classifier "
                        "(*ForSequenceClassification, --convert classify, classifier_from_token hf_overrides)",
            "endpoints": "/v1/embeddings (float, base64), /pooling, /classify, /score, /rerank, /v1/rerank; "
                         "LLM.embed / classify / score",
            "refused": ["tensor / pipeline parallel with --runner pooling", "--enable-lora with --runner pooling",
                        "encoder types other than " + ", ".join(ENCODER_TYPES),
                        "multi-vector (ColBERT) and sparse (SPLADE, BGE-M3 sparse) outputs"]}
