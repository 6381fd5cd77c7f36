"""What `--speculative-config` may ask for here, checked in the API and
engine processes before anything loads (no MLX import: the platform runs it).

Served: method "ngram" (prompt lookup; vLLM's prompt_lookup_min/max),
"draft_model" (a smaller model of the same vocabulary, any served family
without linear-attention layers) and "mtp" (the checkpoint's own
multi-token-prediction layer: MTP_FAMILIES and the Gated DeltaNet hybrids
HYBRID_FAMILIES; or Gemma 4's assistant, a gemma4_assistant checkpoint as
the speculative model: gemma4_assistant_config.refusal says what of it is
refused), "eagle3" (an EAGLE-3 head for an EAGLE3_TARGETS target:
eagle3_config.problem says which heads), num_speculative_tokens up to
vLLM's rejection-sampler limit of 128 (the scheduler's count for the next
step, `num_spec_tokens_to_schedule`, caps a request's drafts). Refused with
the alternative: the other model proposers (EAGLE-1, Medusa, MTP of other
families, ...), a draft model of another vocabulary (or hybrid, image,
sliding-window, or with an 8-bit KV cache), an 8-bit KV cache with MTP, LoRA
adapters, rejection methods other than vLLM's standard one, speculation
across tensor / pipeline parallel ranks, over linear-attention (recurrent)
state other than HYBRID_FAMILIES', with images or
with a KV connector. Async scheduling stays as vLLM sets it (on for a draft
model, MTP and EAGLE-3; off for n-gram): the runner fills the scheduler's
placeholder drafts with its own (async_drafts.py).
"""

from __future__ import annotations

from vllm_metal.speculative.eagle3_config import TARGET_FAMILIES as EAGLE3_TARGETS, refusal as eagle3_refusal
from vllm_metal.speculative.gemma4_assistant_config import is_assistant, refusal as assistant_refusal

# vLLM's rejection sampler verifies at most this many drafts per request a step.
MAX_DRAFTS = 128

SERVED_METHODS = ("ngram", "draft_model", "mtp", "eagle3")
# Families whose checkpoints' multi-token-prediction layer vllm-metal runs (speculative/mtp.py).
# (kimi_k2 is DeepSeek-V3's architecture, but vLLM 0.33 maps only model_type deepseek_v3 to its MTP model.)
MTP_FAMILIES = ("glm4_moe", "glm4_moe_lite", "deepseek_v3")
# Hybrids whose linear-attention states are kept per draft position (Gated DeltaNet layers:
# models/draft_states.py): every method served, their own MTP layer by speculative/qwen_mtp.py.
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def refused_method(spec_config) -> str | None:
    """The method, when it is one vllm-metal does not serve (cuda_gate's row)."""
    if spec_config is None or spec_config.method in SERVED_METHODS:
        return None
    return str(spec_config.method)


def refusal(vllm_config) -> str | None:
    """Why this speculative config cannot be served (None: it can, or there is none)."""
    spec = vllm_config.speculative_config
    if spec is None:
        return None
    method = refused_method(spec)
    if method is not None:
        alt = "method 'ngram': the same prompt lookup, on the host" if method == "ngram_gpu" else \
            "method 'ngram' (prompt lookup), 'draft_model' (a smaller model of the same vocabulary) or 'mtp' " \
            f"(the checkpoint's own next-token layers: {', '.join(MTP_FAMILIES)}), or 'eagle3' (an EAGLE-3 head " \
            f"for a {' / '.join(EAGLE3_TARGETS)} target)"
        return (f"speculative decoding with method {method!r} is not served by vllm-metal yet (its proposer "
                f"runs a model in vLLM's CUDA runner); use {alt}, or drop --speculative-config")
    k = spec.num_speculative_tokens
    if k is None or not 1 <= k <= MAX_DRAFTS:
        return f"--speculative-config num_speculative_tokens must be between 1 and {MAX_DRAFTS} (got {k})"
    if getattr(spec, "rejection_sample_method", "standard") != "standard":
        return (f"--speculative-config rejection_sample_method {spec.rejection_sample_method!r} is not served by "
                "vllm-metal: drop it (the standard rejection sampler keeps the target distribution)")
    if spec.method == "draft_model":
        draft, target = spec.draft_model_config, vllm_config.model_config
        if getattr(spec, "use_heterogeneous_vocab", False) or (
                target is not None and draft.get_vocab_size() != target.get_vocab_size()):
            return (f"draft model {draft.model} has a vocabulary of {draft.get_vocab_size()} tokens, the target "
                    f"{target.get_vocab_size() if target is not None else '?'}: vllm-metal drafts only with a model "
                    "of the target's tokenizer (same vocabulary); use method 'ngram', or a draft model of the "
                    "target's family")
        if draft.is_hybrid or draft.is_multimodal_model or draft.get_sliding_window():
            return (f"draft model {draft.model} is a hybrid (recurrent-state), image or sliding-window model: "
                    "vllm-metal drafts with text-only full-attention models (the ones its tests prove); use a "
                    "plain decoder of the target's vocabulary, or 'ngram'")
        if vllm_config.cache_config.cache_dtype not in (None, "auto"):
            return (f"--kv-cache-dtype {vllm_config.cache_config.cache_dtype} with a draft model is not verified by "
                    "vllm-metal yet: drop --kv-cache-dtype, or use method 'ngram'")
    if spec.method == "eagle3":  # EAGLE-3 heads: speculative/eagle3_config.py
        reason = eagle3_refusal(vllm_config)
        if reason is not None:
            return reason
    if is_assistant(spec):  # Gemma 4's assistant: speculative/gemma4_assistant.py
        reason = assistant_refusal(vllm_config)
        if reason is not None:
            return reason
    elif spec.method == "mtp":
        hf = getattr(vllm_config.model_config, "hf_config", None)
        family = getattr(hf, "model_type", None)
        layers = getattr(hf, "num_nextn_predict_layers", None) or getattr(  # qwen3_5: in its text config
            getattr(vllm_config.model_config, "hf_text_config", None), "mtp_num_hidden_layers", None) or 0
        if family not in MTP_FAMILIES + HYBRID_FAMILIES or layers < 1:
            return (f"--speculative-config method 'mtp' needs a checkpoint with multi-token-prediction layers "
                    f"that vllm-metal runs ({', '.join(MTP_FAMILIES)} with num_nextn_predict_layers >= 1, "
                    f"{', '.join(HYBRID_FAMILIES)} with mtp.* layers); this is a {family} model with {layers}: use "
                    "method 'ngram' or 'draft_model'")
        if layers > 1:  # vLLM cycles through them (spec_step_idx % n); vllm-metal chains the first only
            return (f"--speculative-config method 'mtp' with {layers} multi-token-prediction layers is not served by "
                    "vllm-metal (it runs a checkpoint's one MTP layer, as GLM-4.x and DeepSeek-V3 ship); use "
                    "'ngram' or 'draft_model'")
        if vllm_config.cache_config.cache_dtype not in (None, "auto"):
            return (f"--kv-cache-dtype {vllm_config.cache_config.cache_dtype} with MTP is not verified by "
                    "vllm-metal yet: drop --kv-cache-dtype, or use method 'ngram'")
    if getattr(vllm_config, "lora_config", None) is not None:
        return ("speculative decoding with --enable-lora is not verified by vllm-metal yet (a verify row would "
                "carry its request's adapter, untested): drop --speculative-config or --enable-lora")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        return (f"vllm-metal serves speculative decoding on one rank: --speculative-config with tensor parallel "
                f"{parallel.tensor_parallel_size} / pipeline parallel {parallel.pipeline_parallel_size} is "
                "refused; serve on one Mac, or across ranks without speculation")
    model = vllm_config.model_config
    family = getattr(getattr(model, "hf_config", None), "model_type", None)
    if model is not None and model.is_hybrid and family not in HYBRID_FAMILIES:
        return (f"speculative decoding over linear-attention (recurrent) state is served by vllm-metal for "
                f"{', '.join(HYBRID_FAMILIES)} only (their Gated DeltaNet states kept per draft position); this "
                f"{family} model: serve it without --speculative-config")
    if model is not None and model.is_multimodal_model and not getattr(model.multimodal_config,
                                                                        "language_model_only", False):
        return ("vllm-metal does not verify drafts for image requests yet: drop --speculative-config, or serve "
                "text only (--language-model-only)")
    if vllm_config.kv_transfer_config is not None:
        return ("vllm-metal's disk KV cache does not save speculative steps yet: drop --kv-transfer-config or "
                "--speculative-config")
    return None


def check_speculative_config(vllm_config) -> None:
    reason = refusal(vllm_config)
    if reason is not None:
        raise ValueError(reason)


def speculative_capability() -> dict:
    """The doctor's line (`vllm-metal doctor`)."""
    return {"served": list(SERVED_METHODS),
            "how": "drafts verified in the step's one graph (a row of query length k + 1), accepted with "
                   "vLLM's rejection sampling (greedy: the plain tokens; random: the target distribution); a "
                   "draft model's cache written as a request drafts, its k passes one graph; MTP ("
                   f"{', '.join(MTP_FAMILIES + HYBRID_FAMILIES)} checkpoints' next-token layer): its cache written "
                   "in the step's "
                   "graph, its passes one graph; Gemma 4's assistant (a gemma4_assistant checkpoint as the "
                   "speculative model): its query-only layers over the target's cache, its passes one graph; an "
                   "EAGLE-3 head: fed the target's aux hidden states in the step's graph, as MTP; on "
                   f"{', '.join(HYBRID_FAMILIES)} every method, their states kept per draft position",
            "refused": ["model proposers other than a draft model, MTP layer or EAGLE-3 head (EAGLE-1, Medusa, ...)",
                        f"EAGLE-3 for targets other than {', '.join(EAGLE3_TARGETS)}, quantized heads, heads of "
                        "another size or vocabulary, or with an 8-bit KV cache",
                        f"MTP of families other than {', '.join(MTP_FAMILIES + HYBRID_FAMILIES)}, or with an 8-bit "
                        "KV cache",
                        "a draft model of another vocabulary, a hybrid / image / sliding-window draft model, or one "
                        "with an 8-bit KV cache", "--enable-lora", "ngram_gpu (use ngram)",
                        "rejection methods other than standard", "tensor / pipeline parallel ranks",
                        f"hybrid (recurrent-state) models other than {', '.join(HYBRID_FAMILIES)}",
                        "image models", "a KV connector",
                        "a Gemma 4 assistant for another target (or with other shapes), quantized, or with an 8-bit "
                        "KV cache"]}
