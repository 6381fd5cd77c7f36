"""Gemma 4's assistant at start: whether `--speculative-config` names one,
the target layer each of its layers reads, and why one cannot be served
(no MLX import: the platform's start-up check runs it).

vLLM's contract (config/speculative.py): a `gemma4_assistant` checkpoint
passed as the speculative "model" (method "mtp", or no method: vLLM
detects it) has its config rewritten to model_type "gemma4_mtp"
(Gemma4MTPModel, n_predict 1, its text config's num_kv_shared_layers 0);
v1/spec_decode/gemma4.py maps each of its layers to the target's last layer
of the same kind (sliding / full attention) among those with a cache of
their own, whose K/V it reads.
"""

from __future__ import annotations

TARGET_FAMILIES = ("gemma4_text",)  # the Gemma 4 targets vllm-metal serves (models/registry.py)
EIGHT_BIT = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head")
ALTERNATIVE = "use method 'ngram', or serve without --speculative-config"


def is_assistant(spec) -> bool:
    """`spec` (vLLM's SpeculativeConfig) drafts with a Gemma 4 assistant."""
    draft = getattr(spec, "draft_model_config", None)
    return spec is not None and spec.method == "mtp" and \
        getattr(getattr(draft, "hf_config", None), "model_type", None) == "gemma4_mtp"


def text_of(hf_config):
    get = getattr(hf_config, "get_text_config", None)
    return get() if get is not None else getattr(hf_config, "text_config", hf_config)


def layer_kinds(text) -> list[str]:
    kinds = list(getattr(text, "layer_types", None) or [])
    return [kinds[i] if i < len(kinds) else "full_attention" for i in range(text.num_hidden_layers)]


def source_layers(target_text, draft_text) -> list[int | None]:
    """Per assistant layer, the target layer whose cache it reads
    (Gemma4Proposer._setup_gemma4_kv_sharing), None where the target has no
    layer of its kind with a cache."""
    types = list(getattr(target_text, "layer_types", None) or [])
    owners = types[:len(types) - (getattr(target_text, "num_kv_shared_layers", 0) or 0)]
    last = {kind: i for i, kind in enumerate(owners)}
    return [last.get(kind) for kind in layer_kinds(draft_text)]


def layer_shape(text, i: int) -> tuple[int, int]:
    """(head_dim, num_key_value_heads) of layer i (transformers' per_layer_config)."""
    per = getattr(text, "per_layer_config", None)
    try:
        layer = per[i]
        return int(layer.head_dim), int(layer.num_key_value_heads)
    except (TypeError, KeyError, IndexError, AttributeError):
        return int(text.head_dim), int(text.num_key_value_heads)


def refusal(vllm_config) -> str | None:
    """Why the Gemma 4 assistant of `vllm_config` cannot draft for its target here (None: it can)."""
    spec = vllm_config.speculative_config
    draft = spec.draft_model_config
    hf, name = draft.hf_config, draft.model
    text = text_of(hf)
    target = vllm_config.model_config
    family = getattr(target.hf_config, "model_type", None)
    if family not in TARGET_FAMILIES:
        return (f"{name} is a Gemma 4 assistant (gemma4_assistant): it drafts for Gemma 4 models only, this is a "
                f"{family} model; use method 'draft_model' with a model of its family, or 'ngram'")
    ttext = getattr(target, "hf_text_config", None) or text_of(target.hf_config)
    quantized = getattr(draft, "quantization", None) or getattr(hf, "quantization_config", None) \
        or getattr(hf, "quantization", None)
    if quantized:
        return (f"{name}: a quantized Gemma 4 assistant is not served by vllm-metal (it runs the assistant's "
                f"weights as published, unquantized); use the unquantized checkpoint, or {ALTERNATIVE}")
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype in EIGHT_BIT:
        return (f"--kv-cache-dtype {cache_dtype} with a Gemma 4 assistant is not verified by vllm-metal yet (its "
                f"layers read the target's cache): drop --kv-cache-dtype, or {ALTERNATIVE}")
    mismatch = f"{name} was not trained for this target ({target.model}): "
    backbone = getattr(hf, "backbone_hidden_size", None)
    if backbone != ttext.hidden_size:
        return (mismatch + f"its backbone_hidden_size is {backbone}, the target's hidden size {ttext.hidden_size}; "
                f"use the assistant published with this Gemma 4 model, or {ALTERNATIVE}")
    if text.vocab_size != ttext.vocab_size:
        return (mismatch + f"a vocabulary of {text.vocab_size} tokens, the target's {ttext.vocab_size}; use the "
                f"assistant published with this Gemma 4 model, or {ALTERNATIVE}")
    for field, plain in (("hidden_size_per_layer_input", 0), ("enable_moe_block", False),
                         ("use_double_wide_mlp", False)):
        if (getattr(text, field, plain) or plain) != plain:
            return (f"{name}: {field}={getattr(text, field)} is not a Gemma 4 assistant's layout (transformers' "
                    f"Gemma4AssistantConfig refuses it too); {ALTERNATIVE}")
    heads = text.num_attention_heads
    for i, (kind, source) in enumerate(zip(layer_kinds(text), source_layers(ttext, text))):
        if source is None:
            return (mismatch + f"its layer {i} is a {kind} layer and the target has no {kind} layer with a cache "
                    f"of its own to read; {ALTERNATIVE}")
        (dim, kv), (want_dim, want_kv) = layer_shape(text, i), layer_shape(ttext, source)
        if (dim, kv) != (want_dim, want_kv) or heads % want_kv:
            return (mismatch + f"its layer {i} ({kind}) has {heads} query heads of {dim} over {kv} KV heads, the "
                    f"target's layer {source} caches {want_kv} KV heads of {want_dim}; use the assistant published "
                    f"with this Gemma 4 model, or {ALTERNATIVE}")
        window = getattr(text, "sliding_window", None)
        if kind == "sliding_attention" and window != getattr(ttext, "sliding_window", None):
            return (mismatch + f"its sliding window is {window} tokens, the target's "
                    f"{getattr(ttext, 'sliding_window', None)}; {ALTERNATIVE}")
    if getattr(hf, "use_ordered_embeddings", False):
        centroids, top_k = getattr(hf, "num_centroids", 2048), getattr(hf, "centroid_intermediate_top_k", 32)
        if text.vocab_size % centroids or not 0 < top_k <= centroids:
            return (f"{name}: centroid-masked logits with {centroids} centroids (top {top_k}) over a vocabulary of "
                    f"{text.vocab_size} tokens (vLLM's Gemma4MTPMaskedEmbedder needs whole clusters); {ALTERNATIVE}")
    return None
