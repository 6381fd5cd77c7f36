"""Tiny random-weight models of mlx-lm families, and the reference they are
checked against (tests/models/test_family_parity.py).

Each model is built by mlx-lm's own `ModelArgs`/`Model` for its model_type
(2-3 layers, hidden 64, the embedded tokenizer's 49,152-token vocabulary),
with weights drawn so its logits are peaked (greedy decoding well defined)
and saved as an HF-style directory: config.json (the HF field names, which
mlx-lm's ModelArgs reads too, plus `architectures` for vLLM), safetensors, the
embedded model's tokenizer. Family features are switched on with values that
matter (logit scales, softcaps, windows shorter than the prompts).
"""

from __future__ import annotations

import copy
import importlib
import json
import shutil
from pathlib import Path

from vllm_metal.native import ops  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

DROP = object()  # an override that removes a COMMON field

COMMON = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=VOCAB, rope_theta=10000.0,
              max_position_embeddings=4096, tie_word_embeddings=False)

# Latent attention (MLA): rank 32 + rope 16 = one 48-wide cache row per
# token; values 24 wide per head after the up-projection.
MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
           head_dim=DROP, attention_bias=False)

# model_type -> (HF architecture, config overrides). Only families in
# vllm_metal.models.registry.SERVED appear here, and every served family must.
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaForCausalLM", dict(num_hidden_layers=3, sliding_window=24,
                                       layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "mistral": ("MistralForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2ForCausalLM", dict(head_dim=DROP)),
    "qwen3": ("Qwen3ForCausalLM", dict()),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(head_dim=DROP, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32, shared_expert_intermediate_size=64)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                                              mlp_only_layers=[], moe_intermediate_size=32, norm_topk_prob=True)),
    "gemma": ("GemmaForCausalLM", dict()),
    "gemma2": ("Gemma2ForCausalLM", dict(query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=6.0)),
    "gemma3_text": ("Gemma3ForCausalLM", dict(num_hidden_layers=3, sliding_window=24, sliding_window_pattern=3,
                                              query_pre_attn_scalar=16, rope_local_base_freq=10000.0,
                                              rope_scaling=None)),
    # Gemma 3's vision-language checkpoints: the text model under `language_model`.
    "gemma3": ("Gemma3ForConditionalGeneration", dict(
        num_hidden_layers=3, sliding_window=24, sliding_window_pattern=3, query_pre_attn_scalar=16,
        rope_local_base_freq=10000.0, rope_scaling=None)),
    # Qwen2.5-VL: qwen2 under `language_model`, M-RoPE sections (plain RoPE on text).
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", dict(
        head_dim=DROP, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})),
    # Every gemma4 trait in one model: layers S F S F, the last two reading
    # layers 0 and 1's caches; full layers with 32-wide heads, keys as
    # values and 2 KV heads (twice the sliding layers' page size); per-layer
    # inputs; the MoE block; a final softcap that bites.
    "gemma4_text": ("Gemma4ForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, global_head_dim=32, num_key_value_heads=2, num_global_key_value_heads=2,
        attention_k_eq_v=True, num_kv_shared_layers=2, sliding_window=24, sliding_window_pattern=2,
        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB, final_logit_softcapping=6.0, enable_moe_block=True, num_experts=4,
        top_k_experts=2, moe_intermediate_size=32, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                            "rope_type": "proportional"},
                         "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
                                               "rope_type": "default"}})),
    "starcoder2": ("Starcoder2ForCausalLM", dict(head_dim=DROP, norm_epsilon=1e-5, tie_word_embeddings=True)),
    "glm4": ("Glm4ForCausalLM", dict(attention_bias=True, partial_rotary_factor=0.5)),
    "seed_oss": ("SeedOssForCausalLM", dict(attention_bias=True)),
    "ernie4_5": ("Ernie4_5ForCausalLM", dict(use_bias=False)),
    "helium": ("HeliumForCausalLM", dict(attention_bias=False, mlp_bias=False)),
    "smollm3": ("SmolLM3ForCausalLM", dict(num_hidden_layers=3, no_rope_layer_interval=2)),
    "glm4_moe": ("Glm4MoeForCausalLM", dict(moe_intermediate_size=32, norm_topk_prob=True, n_group=1, topk_group=1,
                                            n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.5,
                                            num_experts_per_tok=2, first_k_dense_replace=1, use_qk_norm=True,
                                            attention_bias=True, partial_rotary_factor=0.5, rope_scaling=None)),
    "olmo2": ("Olmo2ForCausalLM", dict()),
    "olmoe": ("OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)),
    "hunyuan_v1_dense": ("HunYuanDenseV1ForCausalLM", dict(use_qk_norm=True)),
    "mixtral": ("MixtralForCausalLM", dict(head_dim=DROP, num_local_experts=4, num_experts_per_tok=2)),
    "stablelm": ("StableLmForCausalLM", dict(head_dim=DROP, use_qkv_bias=True, partial_rotary_factor=0.5,
                                             layer_norm_eps=1e-5, qk_layernorm=True)),
    "phi": ("PhiForCausalLM", dict(head_dim=DROP, num_key_value_heads=4, partial_rotary_factor=0.5,
                                   layer_norm_eps=1e-5)),
    "cohere2": ("Cohere2ForCausalLM", dict(num_hidden_layers=4, layer_norm_eps=1e-5, logit_scale=0.5,
                                           sliding_window=24, sliding_window_pattern=2, tie_word_embeddings=True)),
    "exaone4": ("Exaone4ForCausalLM", dict(num_hidden_layers=4, rope_scaling=None, sliding_window=24,
                                           sliding_window_pattern="LLLG",
                                           layer_types=["sliding_attention"] * 3 + ["full_attention"])),
    "phi3": ("Phi3ForCausalLM", dict(head_dim=DROP, partial_rotary_factor=0.5, original_max_position_embeddings=64,
                                     rope_scaling={"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0],
                                                   "long_factor": [1.0, 1.5, 2.5, 4.0]})),
    "olmo3": ("Olmo3ForCausalLM", dict(num_hidden_layers=4, sliding_window=24)),
    "cohere": ("CohereForCausalLM", dict(head_dim=DROP, layer_norm_eps=1e-5, logit_scale=0.25,
                                         tie_word_embeddings=True)),
    "granite": ("GraniteForCausalLM", dict(head_dim=DROP, logits_scaling=4.0, attention_multiplier=0.2,
                                           embedding_multiplier=6.0, residual_multiplier=0.5,
                                           attention_bias=False, mlp_bias=False)),
    "ministral3": ("Ministral3ForCausalLM", dict(
        num_hidden_layers=3, sliding_window=24, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        # Queries scaled by 1 + 0.5 log(1 + floor(pos / 64)): prompts reach position 360.
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "llama_4_scaling_beta": 0.5,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # layer_types left out: mlx-lm's decoder defaults to sliding / full pairs.
    "gpt_oss": ("GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=24,
                                          num_hidden_layers=4, rope_scaling=None)),
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(MLA, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2,
                                                  n_shared_experts=1, moe_intermediate_size=32,
                                                  first_k_dense_replace=1, routed_scaling_factor=1.5,
                                                  rope_scaling={"type": "yarn", "factor": 2.0,
                                                                "original_max_position_embeddings": 64,
                                                                "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                                                                "mscale_all_dim": 0.707})),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(MLA, q_lora_rank=48, n_routed_experts=4, num_experts_per_tok=2,
                                                  n_shared_experts=1, moe_intermediate_size=32, n_group=2,
                                                  topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
                                                  norm_topk_prob=True, topk_method="noaux_tc",
                                                  # yarn with mscale_all_dim: the softmax scale grows by mscale^2
                                                  rope_scaling={"type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 64,
                                                                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                                                "mscale_all_dim": 1.0})),
    # Kimi K2 checkpoints: model_type kimi_k2, DeepSeek-V3's architecture.
    "kimi_k2": ("DeepseekV3ForCausalLM", dict(MLA, q_lora_rank=48, n_routed_experts=4, num_experts_per_tok=2,
                                              n_shared_experts=1, moe_intermediate_size=32, n_group=1, topk_group=1,
                                              first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                              topk_method="noaux_tc", rope_scaling=None)),
    "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", dict(MLA, q_lora_rank=48, n_routed_experts=4,
                                                     num_experts_per_tok=2, n_shared_experts=1,
                                                     moe_intermediate_size=32, first_k_dense_replace=1,
                                                     routed_scaling_factor=1.5, norm_topk_prob=True,
                                                     rope_scaling=None)),
    "minicpm3": ("MiniCPM3ForCausalLM", dict(MLA, q_lora_rank=48, v_head_dim=DROP, dim_model_base=16,
                                             scale_depth=1.4, scale_emb=2.0,
                                             rope_scaling={"type": "longrope", "original_max_position_embeddings": 64,
                                                           "short_factor": [1.0, 1.1, 1.2, 1.4, 1.6, 2.0, 2.5, 3.0],
                                                           "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]})),
    # Hybrid: layers L F L F (Gated DeltaNet linear attention, gated full
    # attention with partial RoPE), conv kernel 4, 4 value heads per 2 key
    # heads (key head dim 32: the smallest the fused gated-delta primitive
    # runs), MoE with a shared expert on every layer but the first.
    "qwen3_next": ("Qwen3NextForCausalLM", dict(
        num_hidden_layers=4, full_attention_interval=2, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0], moe_intermediate_size=32,
        shared_expert_intermediate_size=64, norm_topk_prob=True, partial_rotary_factor=0.25,
        rope_scaling=None)),
    "granitemoe": ("GraniteMoeForCausalLM", dict(head_dim=DROP, logits_scaling=4.0, attention_multiplier=0.2,
                                                 embedding_multiplier=6.0, residual_multiplier=0.5,
                                                 attention_bias=False, num_local_experts=4,
                                                 num_experts_per_tok=2)),
    # Hybrid: layers C F C (short gated convolutions, kernel 3 as in LFM2,
    # with biases; full attention with per-head q/k layer norms), tied head.
    "lfm2": ("Lfm2ForCausalLM", dict(
        num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, conv_bias=True,
        norm_eps=1e-5, rms_norm_eps=DROP, head_dim=DROP, block_dim=64, block_multiple_of=16,
        block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True, tie_word_embeddings=True)),
    # LFM2's MoE: lfm2's layers C F C, the first MLP dense, then sigmoid-routed
    # experts chosen with an expert bias, scaled routing weights.
    "lfm2_moe": ("Lfm2MoeForCausalLM", dict(
        num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, conv_bias=False,
        norm_eps=1e-5, rms_norm_eps=DROP, head_dim=DROP, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=1.5,
        tie_word_embeddings=True)),
    # Hybrid: layers M A M (Mamba-2 mixers: 8 heads of 16 in 2 groups, state
    # size 16, conv kernel 4; NoPE attention as Granite 4.0-H has), granite's
    # multipliers, MoE beside a shared MLP, tied head.
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", dict(
        num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], head_dim=DROP,
        position_embedding_type="nope", embedding_multiplier=6.0, attention_multiplier=0.2, logits_scaling=4.0,
        residual_multiplier=0.5, attention_bias=False, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=32, shared_intermediate_size=64, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
        mamba_d_conv=4, mamba_n_groups=2, mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False,
        tie_word_embeddings=True)),
    # Qwen3.5 (hybrid, the text model under `language_model`, its config
    # nested in `text_config`: TEXT_CONFIG). Dense: layers L L F (Gated
    # DeltaNet with separate q|k|v, z, b, a projections; gated full attention
    # with partial RoPE), conv kernel 4, 4 value heads per 2 key heads, tied head.
    "qwen3_5": ("Qwen3_5ForCausalLM", dict(
        num_hidden_layers=3, full_attention_interval=3, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=True,
        rms_norm_eps=1e-6, rope_theta=DROP, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                              "partial_rotary_factor": 0.25})),
    # MoE: layers L F L, MoE with a shared expert on every layer, as many
    # value heads as key heads.
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", dict(
        num_hidden_layers=3, full_attention_interval=2, linear_num_value_heads=4, linear_num_key_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=24, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=DROP, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                              "partial_rotary_factor": 0.25})),
}

# Families whose checkpoints nest the text model's config under
# `text_config` (model_type -> the text config's model_type), as Qwen3.5's do.
# Vision-language architectures (vLLM's multimodal models): their parity models are served text-only.
VISION_LANGUAGE = {"gemma3", "qwen2_5_vl"}

TEXT_CONFIG = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "gemma3": "gemma3_text",
               "qwen2_5_vl": "qwen2_5_vl_text"}


def config_of(model_type: str) -> dict:
    arch, overrides = FAMILIES[model_type]
    config = {**COMMON, **overrides, "model_type": model_type, "architectures": [arch], "torch_dtype": "float32"}
    # A copy: mlx-lm's ModelArgs edit nested dicts in place (qwen3_5's rope_parameters).
    config = copy.deepcopy({k: v for k, v in config.items() if v is not DROP})
    if model_type in TEXT_CONFIG:
        text = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}
        config = {"model_type": model_type, "architectures": [arch], "torch_dtype": "float32",
                  "tie_word_embeddings": text["tie_word_embeddings"],
                  "text_config": {**text, "model_type": TEXT_CONFIG[model_type]}}
        if model_type in VISION_LANGUAGE:  # read at the top by mlx-lm's gemma3 (its default: Gemma 3's vocabulary)
            config["vocab_size"] = text["vocab_size"]
    return config


def build(model_type: str, out: Path, tokenizer_dir: str, seed: int = 0, bits: int | None = None,
          group_size: int = 32, mixed: bool = False, overrides: dict | None = None) -> str:
    """Writes the tiny `model_type` model to `out`; returns its path. With
    `bits`, MLX-quantized as `mlx_lm.convert -q` writes it (`quantization`
    and `quantization_config` in config.json); `mixed` adds per-layer
    overrides as mlx-lm's mixed recipes write them (8-bit embeddings and MLP
    down projections, group size 32). overrides: config fields over the family's."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes

    config = {**config_of(model_type), **(overrides or {})}
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(seed)
    params = {}
    for name, value in tree_flatten(model.parameters()):
        if value.ndim >= 2:  # matrices (and expert stacks): unit-variance activations
            fan_in = value.shape[-1]
            w = rng.standard_normal(value.shape) / np.sqrt(fan_in)
            if "embed_tokens" in name or "lm_head" in name:
                w *= 4.0  # peaked logits: greedy well defined, logprobs far from uniform
            params[name] = mx.array(w.astype(np.float32))
        elif name.endswith("sinks"):  # attention sinks that compete with the scores
            params[name] = mx.array((1.5 * rng.standard_normal(value.shape)).astype(np.float32))
        else:  # norms and biases: near their defaults, not exactly
            params[name] = value + mx.array(0.05 * rng.standard_normal(value.shape).astype(np.float32))
    model.update(tree_unflatten(list(params.items())))
    if bits is not None:
        import mlx.nn as nn

        quantization = {"group_size": group_size, "bits": bits}

        def predicate(path, m):
            if not hasattr(m, "to_quantized"):
                return False
            if mixed and (path.endswith("down_proj") or path.endswith("embed_tokens")) \
                    and m.weight.shape[-1] % 32 == 0:
                quantization[path] = {"group_size": 32, "bits": 8}
                return quantization[path]
            return m.weight.shape[-1] % group_size == 0

        nn.quantize(model, class_predicate=predicate, group_size=group_size, bits=bits)
        config["quantization"] = config["quantization_config"] = quantization
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_dir) / name, out / name)
    return str(out)


def reference_logprobs(model_dir: str):
    """tokens -> float64 log-softmax rows of mlx-lm's own forward, float32
    weights (row i predicts token i + 1)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    return logprobs_of(model)


def logprobs_of(model):
    """tokens -> float64 log-softmax rows of `model` (an mlx-lm model, run in
    float32). MLX's float32 logsumexp on the CPU is off by ~1e-4, so the
    normalisation is numpy float64."""
    model.set_dtype(mx.float32)

    def logprobs(tokens):
        logits = np.array(model(mx.array(tokens)[None])[0].astype(mx.float32)).astype(np.float64)
        logits -= logits.max(axis=-1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))

    return logprobs


def module_of(model_type: str):
    return importlib.import_module(f"mlx_lm.models.{model_type}")
