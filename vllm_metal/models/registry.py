"""Which mlx-lm model families vllm-metal serves: only those a parity test
proves against mlx-lm's own forward (tests/plugin/test_family_parity.py,
which builds a tiny random-weight model of every family listed here).

A family outside this table may load and answer -- silently wrong where its
mlx-lm code adds what the paged adapter does not reproduce (logit softcaps,
logit scaling, per-layer sliding windows, extra norms). So it is refused at
load, with the family named and the served ones listed, never served on trust.
"""

from __future__ import annotations

# model_type -> what the parity test covers.
SERVED: dict[str, str] = {
    "llama": "per-layer sliding windows (layer_types); linear / llama3 / yarn RoPE pass the per-token "
             "position probe, dynamic-NTK RoPE is refused; bf16/fp16 and MLX 4-bit on the embedded SmolLM2",
    "mistral": "tied embeddings",
    "qwen2": "q/k/v biases",
    "qwen3": "q/k norms",
    "qwen2_moe": "mlx-lm's switch MoE with a shared expert",
    "qwen3_moe": "mlx-lm's switch MoE",
    "gemma": "scaled embeddings, tied head",
    "gemma2": "attention logit softcap (the primitive's softcap), final logit softcap (the model's own head), "
              "query_pre_attn_scalar",
    "gemma3_text": "sliding windows declared on the attention module (is_sliding), per-layer RoPE bases, "
                   "q/k norms",
    "starcoder2": "biases, layer norms",
    "glm4": "partial rotary, attention biases",
    "seed_oss": "attention biases",
    "ernie4_5": "",
    "helium": "",
    "smollm3": "NoPE layers (every second layer without RoPE)",
    "glm4_moe": "mlx-lm's switch MoE with a shared expert and grouped routing, q/k norms, partial rotary",
    "olmo2": "q/k norms over the whole projection, before the heads are split",
    "olmoe": "q/k norms over the whole projection, mlx-lm's switch MoE",
    "hunyuan_v1_dense": "per-head q/k norms after RoPE (query_layernorm / key_layernorm), NTK-alpha RoPE",
    "mixtral": "mlx-lm's switch MoE; attention attributes under other names (num_heads)",
    "stablelm": "per-head q/k layer norms (q_layernorm), partial rotary, computed scale, qkv biases",
    "phi": "output projection `dense`, partial rotary, computed scale, head with a bias",
    "cohere2": "sliding windows on the attention module (use_sliding_window), RoPE only on sliding layers "
               "(NoPE global layers), logit_scale",
    "exaone4": "local/global layer pattern (is_local), global layers without RoPE, q/k norms",
    "phi3": "packed qkv_proj, partial rotary, longrope (SuScaledRoPE) scaling",
    "olmo3": "windows declared only in the model's layer_types, RoPE differing between sliding and full "
             "layers, q/k norms over the whole projection",
    "cohere": "logit_scale (the model's own head)",
    "granite": "logits_scaling, attention / embedding / residual multipliers",
    "granitemoe": "logits_scaling, multipliers, mlx-lm's switch MoE",
}


class UnservedModelError(NotImplementedError):
    pass


def check_served(model_type: str | None) -> None:
    if model_type in SERVED:
        return
    raise UnservedModelError(
        f"model type {model_type!r} is not served by vllm-metal yet: no parity test proves the paged "
        f"path against mlx-lm for it, and serving it unproven risks silently wrong answers (a dropped "
        f"softcap, logit scale or sliding window). Served: {', '.join(sorted(SERVED))}.")


def markdown_table() -> str:
    """docs/models.md's table (regenerate: python -m vllm_metal.models.registry)."""
    lines = ["| model_type | what its parity model exercises beyond plain attention |", "|---|---|"]
    lines += [f"| `{name}` | {SERVED[name] or '-'} |" for name in sorted(SERVED)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
