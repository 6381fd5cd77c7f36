"""EAGLE-3 heads at start (vLLM's method "eagle3"): which head layer a
checkpoint is, which target layers feed it, and why a head or target cannot
be served -- from the configs alone (no MLX import: the platform's start-up
check runs it; speculative/eagle3.py checks the tensors at load).

vLLM's contract: the head's config.json (architectures renamed by
EAGLEConfig: "X" -> "Eagle3X" unless it starts or ends with "Eagle3")
picks llama_eagle3.py (Eagle3LlamaForCausalLM, LlamaForCausalLMEagle3) or
qwen3_eagle3.py (Eagle3Qwen3ForCausalLM: the same layer with Qwen3's
per-head q/k norms). The target's auxiliary hidden states come from the
layers `eagle_aux_hidden_state_layer_ids` names (top level, or in
`eagle_config`), else the target's default (2, n // 2, n - 3), sorted and
de-duplicated (EagleModelMixin: id i is the residual stream before layer
i, id n the last layer's output before the final norm).
"""

from __future__ import annotations

# Targets vLLM runs EAGLE-3 for (SupportsEagle3) whose mlx-lm decoder passes the residual stream
# from layer to layer unscaled, as vLLM's Llama / Qwen2 / Qwen3 models sum it (models/loaded_model.py
# taps it there; tests/speculative/test_eagle3.py checks each against mlx-lm's own forward).
TARGET_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
# vLLM's head architectures (after EAGLEConfig's renaming) -> the family of mlx-lm's block the layer is built on.
HEAD_LAYERS = {"Eagle3LlamaForCausalLM": "llama", "LlamaForCausalLMEagle3": "llama",
               "Eagle3Qwen3ForCausalLM": "qwen3"}
# Head variants vLLM's eagle3 layers know that vllm-metal does not run (unverified here).
VARIANTS = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual", "attention_bias")
ALTERNATIVE = "use method 'ngram' or 'draft_model', or serve without --speculative-config"


def architecture(head: dict) -> str:
    """The head's architecture as vLLM's EAGLEConfig renames it."""
    arch = (head.get("architectures") or ["?"])[0]
    return arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"


def aux_layer_ids(head: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers whose incoming residual streams the head reads (vLLM's order: sorted, unique)."""
    ids = head.get("eagle_aux_hidden_state_layer_ids") or \
        (head.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return tuple(sorted(set(ids or (2, num_layers // 2, num_layers - 3))))


def problem(head: dict, target: dict) -> str | None:
    """Why the head (its config.json as a dict) cannot draft for the target (its config), or None."""
    family = target.get("model_type")
    if family not in TARGET_FAMILIES:
        return (f"EAGLE-3 drafting for a {family} target is not served by vllm-metal (targets: "
                f"{', '.join(TARGET_FAMILIES)}); {ALTERNATIVE}")
    arch = architecture(head)
    if arch not in HEAD_LAYERS:
        return (f"the EAGLE-3 head is a {arch}; vllm-metal runs {', '.join(sorted(HEAD_LAYERS))} heads "
                f"(one Llama / Qwen3 layer); {ALTERNATIVE}")
    if head.get("quantization_config") or head.get("quantization"):
        return ("the EAGLE-3 head is quantized, which vllm-metal does not run; use an unquantized head, or "
                + ALTERNATIVE)
    hidden, vocab = target.get("hidden_size"), target.get("vocab_size")
    if head.get("hidden_size") != hidden or head.get("target_hidden_size", hidden) != hidden:
        return (f"the EAGLE-3 head has hidden size {head.get('hidden_size')} (target hidden size "
                f"{head.get('target_hidden_size', head.get('hidden_size'))}), the target {hidden}: a head trained "
                "for another model; use the head made for this target")
    draft_vocab = head.get("draft_vocab_size") or head.get("vocab_size")
    if head.get("vocab_size") != vocab or not draft_vocab or draft_vocab > vocab:
        return (f"the EAGLE-3 head's vocabulary ({head.get('vocab_size')} tokens, {draft_vocab} drafted) is not the "
                f"target's ({vocab}): a head trained for another tokenizer; use the head made for this target")
    if "sliding_attention" in (head.get("layer_types") or []):
        return f"EAGLE-3 heads with a sliding-window layer are not served by vllm-metal yet; {ALTERNATIVE}"
    if (head.get("num_hidden_layers") or 1) != 1:
        return (f"the EAGLE-3 head has {head['num_hidden_layers']} layers; vllm-metal runs one-layer heads "
                f"(as published); {ALTERNATIVE}")
    variants = [v for v in VARIANTS if head.get(v) or (head.get("eagle_config") or {}).get(v)]
    if (head.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        variants.append("use_aux_hidden_state: false")
    if variants:
        return f"EAGLE-3 heads with {', '.join(variants)} are not served by vllm-metal yet; {ALTERNATIVE}"
    n = target.get("num_hidden_layers") or 0
    ids = aux_layer_ids(head, n)
    if any(not 0 <= i <= n for i in ids):
        return (f"the EAGLE-3 head reads target layers {list(ids)}, outside the target's 0 .. {n}: a head trained "
                "for another model; use the head made for this target")
    return None


def refusal(vllm_config) -> str | None:
    """The start-up check of method "eagle3" (speculative/serving_config.refusal)."""
    spec = vllm_config.speculative_config
    if getattr(spec, "parallel_drafting", False):
        return ("EAGLE-3 parallel drafting (P-EAGLE) is not served by vllm-metal yet; drop parallel_drafting, or "
                + ALTERNATIVE)
    if vllm_config.cache_config.cache_dtype not in (None, "auto"):
        return (f"--kv-cache-dtype {vllm_config.cache_config.cache_dtype} with EAGLE-3 is not verified by vllm-metal "
                "yet: drop --kv-cache-dtype, or use method 'ngram'")
    head = spec.draft_model_config.hf_config.to_dict()
    target = vllm_config.model_config.hf_config.to_dict()
    return problem(head, target)
