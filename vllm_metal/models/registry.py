"""Which mlx-lm model families vllm-metal serves: only those a parity test
proves against mlx-lm's own forward (tests/models/test_family_parity.py
builds a tiny random-weight model of every family listed here, float32 and
MLX-quantized, and checks the facts this table states about it).

A family outside this table may load and answer -- silently wrong where its
mlx-lm code adds what the paged path does not reproduce (logit softcaps,
logit scaling, per-layer sliding windows, extra norms). So it is refused at
load, with the family named and the served ones listed, never served on trust.

Most families run through the generic adapter (attention_adapter.py), which
reads what a family adds from its mlx-lm attention module (gpt_oss's sinks
included). A family whose attention computes something else has its own
small module in this package, named in `Family.module` (ministral3: a
per-token query scale; mla: latent attention; gemma4: per-layer head sizes,
keys as values, KV sharing; qwen3_next: gated full attention, qwen3_5's
too). A hybrid family (`Family.linear`) also has linear-attention layers,
run on per-request state slots: Gated DeltaNet (models/gated_delta.py:
qwen3_next's packed projections, qwen3_5's separate ones), short
gated convolutions (models/short_conv.py), Mamba-2 mixers (models/mamba2.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# The MLX quantizations every family's parity test runs (bits, group size),
# as mlx_lm.convert writes them; each family is tested in one of them (its
# index in sorted order picks), so the whole matrix covers every format.
# "mixed" = the default format plus per-layer overrides in config.json
# (8-bit MLPs' down projections, 8-bit embeddings), as mlx-lm's mixed recipes write.
QUANT_FORMATS: list[tuple[int, int, bool]] = [(4, 32, False), (8, 64, False), (4, 64, True), (8, 32, False),
                                              (4, 128, False), (4, 64, False)]


@dataclass(frozen=True)
class Family:
    notes: str  # what its parity model exercises beyond plain attention
    attention: str = "gqa"  # "gqa" (incl. MHA), "sinks" (gqa + per-head sink logits), "mla" (latent)
    sliding: bool = False  # some layers attend within a window (the parity model checks it has some)
    moe: bool = False  # mlx-lm's switch (MoE) layers (the parity model checks it has them)
    module: str | None = None  # vllm_metal.models.<module> holds its attention, else the generic adapter
    # hybrid: the kind of its linear-attention layers, as their wrapper names it
    # ("gated delta": gated_delta.py, "short conv": short_conv.py, "mamba2": mamba2.py)
    linear: str | None = None


SERVED: dict[str, Family] = {
    "llama": Family("per-layer sliding windows (layer_types); linear / llama3 / yarn RoPE pass the per-token "
                    "position probe, dynamic-NTK RoPE is refused; bf16/fp16 and MLX 4-bit on the embedded SmolLM2",
                    sliding=True),
    "mistral": Family("tied embeddings"),
    "ministral3": Family("llama-4 per-token query scale (1 + beta log(1 + floor(pos / original_max))), yarn RoPE, "
                         "sliding layers", sliding=True, module="ministral3"),
    "qwen2": Family("q/k/v biases"),
    "qwen3": Family("q/k norms"),
    "qwen2_moe": Family("shared expert", moe=True),
    "qwen3_moe": Family("q/k norms", moe=True),
    "gemma": Family("scaled embeddings, tied head"),
    "gemma2": Family("attention logit softcap (the primitive's softcap), final logit softcap (the model's own "
                     "head), query_pre_attn_scalar"),
    "gemma3_text": Family("sliding windows declared on the attention module (is_sliding), per-layer RoPE bases, "
                          "q/k norms", sliding=True),
    "gemma3": Family("gemma3_text's layers under `language_model`, the config under `text_config` (Gemma 3's "
                     "vision-language checkpoints; images: multimodal/)", sliding=True),
    "qwen2_5_vl": Family("qwen2's layers under `language_model` (mlx-lm's qwen2_vl), M-RoPE that equals plain "
                         "RoPE on text (images: multimodal/, with their 3-D positions)"),
    "gemma4_text": Family("head sizes per layer kind (sliding 16, full 32: caches of different page sizes), keys "
                          "as values on full layers, V norms, later layers reading earlier layers' caches (KV "
                          "sharing), per-layer input embeddings, partial (proportional) RoPE on full layers, "
                          "the MoE block beside the dense MLP, final logit softcap (one parity model holds "
                          "all of them)", sliding=True, moe=True, module="gemma4"),
    "starcoder2": Family("biases, layer norms"),
    "glm4": Family("partial rotary, attention biases"),
    "seed_oss": Family("attention biases"),
    "ernie4_5": Family(""),
    "helium": Family(""),
    "smollm3": Family("NoPE layers (every second layer without RoPE)"),
    "glm4_moe": Family("shared expert, grouped routing, q/k norms, partial rotary", moe=True),
    "olmo2": Family("q/k norms over the whole projection, before the heads are split"),
    "olmoe": Family("q/k norms over the whole projection", moe=True),
    "hunyuan_v1_dense": Family("per-head q/k norms after RoPE (query_layernorm / key_layernorm), NTK-alpha RoPE"),
    "mixtral": Family("attention attributes under other names (num_heads)", moe=True),
    "stablelm": Family("per-head q/k layer norms (q_layernorm), partial rotary, computed scale, qkv biases"),
    "phi": Family("output projection `dense`, partial rotary, computed scale, head with a bias"),
    "cohere2": Family("sliding windows on the attention module (use_sliding_window), RoPE only on sliding layers "
                      "(NoPE global layers), logit_scale", sliding=True),
    "exaone4": Family("local/global layer pattern (is_local), global layers without RoPE, q/k norms", sliding=True),
    "phi3": Family("packed qkv_proj, partial rotary, longrope (SuScaledRoPE) scaling"),
    "olmo3": Family("windows declared only in the model's layer_types, RoPE differing between sliding and full "
                    "layers, q/k norms over the whole projection", sliding=True),
    "cohere": Family("logit_scale (the model's own head)"),
    "granite": Family("logits_scaling, attention / embedding / residual multipliers"),
    "granitemoe": Family("logits_scaling, multipliers", moe=True),
    "gpt_oss": Family("attention sinks (one learned logit per head in the softmax), alternating sliding / full "
                      "layers from the model's default layer_types, q/k/v/o biases, SwiGLU-OAI experts",
                      attention="sinks", sliding=True, moe=True),
    "deepseek_v2": Family("latent KV cache (kv_lora_rank + rope dims per token), kv_b_proj absorbed at load, "
                          "q LoRA, traditional RoPE, grouped MoE routing with shared experts",
                          attention="mla", moe=True, module="mla"),
    "deepseek_v3": Family("latent KV cache with mlx-lm's absorbed embed_q / unembed_out, q LoRA, sigmoid "
                          "group routing with a correction bias, shared experts", attention="mla", moe=True,
                          module="mla"),
    "kimi_k2": Family("Kimi K2's model_type: mlx-lm builds it as deepseek_v3 (latent attention, sigmoid group "
                      "routing), vLLM reads its config as DeepSeek-V3's", attention="mla", moe=True, module="mla"),
    "minicpm3": Family("latent KV cache (kv_b_proj absorbed at load), embedding / depth scaling, "
                       "v_head_dim = hidden / heads", attention="mla", module="mla"),
    "qwen3_next": Family("hybrid: Gated DeltaNet linear-attention layers (conv kernel 4, recurrent state per "
                         "request in vLLM's Mamba-style state slots) between gated full-attention layers "
                         "(sigmoid output gate, q/k norms, partial RoPE); MoE with a shared expert",
                         moe=True, module="qwen3_next", linear="gated delta"),
    "qwen3_5": Family("hybrid like qwen3_next: Gated DeltaNet layers with separate qkv, z, b and a projections "
                      "(two linear layers per full one), qwen3_next's gated full attention (partial RoPE); the "
                      "text model under `language_model`, its config under `text_config`; tied head",
                      module="qwen3_next", linear="gated delta"),
    "qwen3_5_moe": Family("qwen3_5's hybrid layers (as many value heads as key heads) with MoE and a shared "
                          "expert on every layer", moe=True, module="qwen3_next", linear="gated delta"),
    "glm4_moe_lite": Family("latent KV cache with mlx-lm's absorbed embed_q / unembed_out, shared experts",
                            attention="mla", moe=True, module="mla"),
    "lfm2": Family("hybrid: short gated convolutions (kernel 3, conv bias; only a convolution state per "
                   "request, in vLLM's Mamba-style state slots) between full-attention layers (per-head q/k "
                   "layer norms, out_proj); tied head", linear="short conv"),
    "lfm2_moe": Family("lfm2's hybrid layers (short convolutions without bias) with a dense first MLP, then "
                       "sigmoid-routed experts picked with an expert bias, routing weights scaled", moe=True,
                       linear="short conv"),
    "granitemoehybrid": Family("hybrid: Mamba-2 mixers (8 heads in 2 groups sharing B / C, state size 16, "
                               "conv kernel 4; convolution and SSM states per request in vLLM's Mamba-style "
                               "state slots) between NoPE attention layers; embedding / attention / residual "
                               "multipliers, logits_scaling, MoE beside a shared MLP", moe=True,
                               linear="mamba2"),
}


# Families mlx-lm has that are known not to fit yet, and what is missing
# (docs/models.md, "Not served yet", says more); the refusal names it.
NOT_YET: dict[str, str] = {
    "nemotron_h": "its decoder is not the one-cache-per-layer decoder the loader assumes (under `backbone`, "
                  "every block's module called `mixer`, MLP / MoE blocks without a cache, caches handed to the "
                  "Mamba and attention blocks by a counter over them)",
    "falcon_h1": "each layer runs a Mamba-2 mixer and attention side by side, so one layer would own both a "
                 "KV cache and state slots (the runner keeps one cache per layer)",
    "kimi_linear": "its Kimi Delta Attention layers keep four states each (q / k / v convolution states and the "
                   "recurrent matrix) with a per-channel decay, and its latent attention (no RoPE on "
                   "q_pe / k_pe) is not proven by models/mla.py's parity models",
}


class UnservedModelError(NotImplementedError):
    pass


def check_served(model_type: str | None) -> Family:
    if model_type in SERVED:
        return SERVED[model_type]
    known = f" For {model_type}: {NOT_YET[model_type]}." if model_type in NOT_YET else ""
    raise UnservedModelError(
        f"model type {model_type!r} is not served by vllm-metal yet: no parity test proves the paged "
        f"path against mlx-lm for it, and serving it unproven risks silently wrong answers (a dropped "
        f"softcap, logit scale or sliding window).{known} Served: {', '.join(sorted(SERVED))}.")


def quant_format(model_type: str) -> tuple[int, int, bool]:
    """The MLX quantization (bits, group size, mixed) the family's parity test runs."""
    return QUANT_FORMATS[sorted(SERVED).index(model_type) % len(QUANT_FORMATS)]


def markdown_table() -> str:
    """docs/models.md's table (regenerate: python -m vllm_metal.models.registry)."""
    lines = ["| model_type | attention | sliding window | MoE | tested precisions | what its parity model "
             "exercises |", "|---|---|---|---|---|---|"]
    for name in sorted(SERVED):
        f = SERVED[name]
        bits, group, mixed = quant_format(name)
        quant = f"float32, MLX {bits}-bit g{group}" + (" mixed per layer, 8-bit embeddings" if mixed else "")
        if name == "llama":
            quant += "; bf16, fp16, 4-bit kept quantized (SmolLM2)"
        attention = f"{f.attention} + {f.linear} (linear)" if f.linear else f.attention
        lines.append(f"| `{name}` | {attention} | {'yes' if f.sliding else '-'} | {'yes' if f.moe else '-'} "
                     f"| {quant} | {f.notes or '-'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
