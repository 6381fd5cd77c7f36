"""A GGUF file as an mlx-lm checkpoint: its config (from the file's metadata,
or a given config.json) and its tensors under mlx-lm's names, kept
quantized where MLX's affine quantization is exact (formats/gguf_quants.py)
and laid out as each family expects (formats/gguf_layout.py).

The config comes from transformers' GGUF metadata conversion
(`load_gguf_checkpoint`), the same one `AutoConfig.from_pretrained(...,
gguf_file=...)` uses, so vLLM's config and the model's agree.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from vllm_metal.formats import gguf_layout as layout
from vllm_metal.formats import gguf_quants as quants


class GGUFError(ValueError):
    pass


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `*.gguf` in a
    directory without safetensors weights. None when `path` is neither; a
    directory with several GGUF files is refused (which one is meant?)."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or any(path.glob("*.safetensors")):
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise GGUFError(f"{path} holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
                        "name the one to serve")
    return found[0] if found else None


def _clean(value):
    """GGUF stores floats as float32: 9.99999975e-06 -> 1e-05."""
    if isinstance(value, float):
        return float(str(np.float32(value)))
    return value


# llama.cpp's `{arch}.` metadata keys -> Hugging Face config fields.
_KEYS = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size", "attention.key_length": "head_dim", "attention.sliding_window": "sliding_window",
    "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "attn_logit_softcapping": "attn_logit_softcapping", "final_logit_softcapping": "final_logit_softcapping",
}
_TOKEN_IDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
              "padding_token_id": "pad_token_id", "unknown_token_id": "unk_token_id"}
# What llama.cpp's model code assumes for a family rather than reading it.
_FAMILY_DEFAULTS = {
    "qwen3moe": {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen2moe": {"norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "gemma3": {"sliding_window_pattern": 6, "rope_local_base_freq": 10000.0},
}
# Gemma's 27B models scale queries by hidden / heads, the others by head_dim
# (llama.cpp: f_attention_scale, keyed on the layer count of the 27B).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def config_from_metadata(path: Path) -> dict:
    """mlx-lm / Hugging Face config dict from the GGUF metadata, as
    llama.cpp's model code reads it (its key names, its per-family
    constants). A field the metadata cannot give is refused, naming it;
    --hf-config-path DIR (a config.json) replaces this."""
    reader = _reader(path)
    meta = reader.metadata
    arch = read_architecture(path)
    model_type = layout.check_architecture(arch)
    config = {"model_type": model_type, **_FAMILY_DEFAULTS.get(arch, {})}
    for key, field in _KEYS.items():
        if f"{arch}.{key}" in meta:
            value = meta[f"{arch}.{key}"]
            config[field] = [_clean(v) for v in value] if isinstance(value, list) else _clean(value)
    for key, field in _TOKEN_IDS.items():
        if f"tokenizer.ggml.{key}" in meta:
            config[field] = meta[f"tokenizer.ggml.{key}"]
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in meta:
        config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if k not in config]
    if missing:
        raise GGUFError(f"{path}: the GGUF metadata lacks {', '.join(missing)} for architecture {arch!r}; "
                        "pass --hf-config-path DIR with the model's config.json")
    heads = config["num_attention_heads"]
    config.setdefault("num_key_value_heads", heads)
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    config.setdefault("head_dim", rope_dims if arch == "llama" and rope_dims else config["hidden_size"] // heads)
    if rope_dims and rope_dims != config["head_dim"]:
        if arch != "phi3":
            raise GGUFError(f"{path}: {arch}.rope.dimension_count {rope_dims} != head_dim {config['head_dim']}: "
                            "partial rotary is read for phi3 only; pass --hf-config-path DIR")
        config["partial_rotary_factor"] = rope_dims / config["head_dim"]
    if arch in _GEMMA_27B_LAYERS:
        big = config["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
        config["query_pre_attn_scalar"] = config["hidden_size"] // heads if big else config["head_dim"]
    names = {t.name for t in reader.tensors}
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = "blk.0.ffn_up.bias" in names
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        factor = meta.get(f"{arch}.rope.scaling.factor")
        if scaling == "linear" and factor:
            config["rope_scaling"] = {"type": "linear", "rope_type": "linear", "factor": _clean(factor)}
        elif scaling == "yarn" and factor:
            config["rope_scaling"] = {"type": "yarn", "rope_type": "yarn", "factor": _clean(factor),
                                      "original_max_position_embeddings":
                                          meta.get(f"{arch}.rope.scaling.original_context_length")}
        else:
            raise GGUFError(f"{path}: rope scaling {scaling!r} (factor {factor}) is not read from GGUF metadata; "
                            "pass --hf-config-path DIR with the model's config.json")
    config["tie_word_embeddings"] = "output.weight" not in names
    return config


_READERS: dict = {}


def _reader(path: Path):
    """The file's memory-mapped reader (kept while the file is unchanged)."""
    from vllm_metal.formats.gguf_file import GGUFFile, GGUFFormatError

    stat = Path(path).stat()
    key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _READERS:
        try:
            reader = GGUFFile(path)
        except GGUFFormatError as e:  # truncated, not GGUF, wrong version
            raise GGUFError(f"{path} is not a readable GGUF file: {e}") from e
        _READERS.clear()  # one file at a time: a reader maps the whole file
        _READERS[key] = reader
    return _READERS[key]


def read_architecture(path: Path) -> str:
    arch = _reader(path).field("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{path} has no general.architecture in its metadata")
    return arch


def has_tensor(path: Path, name: str) -> bool:
    return any(t.name == name for t in _reader(path).tensors)


def tensor_types(path: Path) -> Counter:
    """{GGML type name: tensor count}."""
    return Counter(t.type_name for t in _reader(path).tensors)


def describe_types(types: Counter) -> dict:
    """How each GGML type in a file is served: {'kept': [...], 'requantized':
    {type: bits}, 'float': [...], 'refused': [...]}."""
    out = {"kept": [], "requantized": {}, "float": [], "refused": []}
    for name in sorted(types):
        try:
            kind = quants.kind_of(name)
        except quants.UnsupportedTensorType:
            out["refused"].append(name)
            continue
        if kind == "requantized":
            out["requantized"][name] = quants.REQUANT_BITS[name]
        else:
            out[kind].append(name)
    return out


def load_weights(path: Path, config: dict) -> tuple[dict, dict]:
    """(mlx-lm weights as mx arrays, {module: (group_size, bits)} of the
    quantized ones). Refuses a tensor type or name it cannot serve."""
    import mlx.core as mx

    reader = _reader(path)
    arch = read_architecture(path)
    layout.check_architecture(arch)
    refused = describe_types(Counter(t.type_name for t in reader.tensors))["refused"]
    if refused:
        bad = next(t for t in reader.tensors if t.type_name in refused)
        raise GGUFError(f"{path}: tensor {bad.name} is of GGML type {bad.type_name}, which vllm-metal "
                        f"cannot serve (types served: {', '.join(quants.FLOAT_TYPES)}, kept quantized "
                        f"{', '.join(quants.EXACT_BITS)}, re-quantized {', '.join(quants.REQUANT_BITS)})")
    weights, quant = {}, {}
    for t in reader.tensors:
        name, type_name, shape = t.name, t.type_name, t.shape  # shape: numpy order (..., out, in)
        target = layout.hf_name(arch, name)
        heads = layout.permuted_heads(arch, name, config)
        kind = quants.kind_of(type_name)
        if kind == "float":
            value = quants.dequantize(t.data, type_name, shape) if type_name == "BF16" else np.asarray(t.data)
            value = value.reshape(shape)
            offset = layout.norm_offset(arch, name)
            if offset:
                value = value.astype(np.float32) - np.float32(offset)
            if heads:
                value = layout.unpermute_rows(value, heads)
            weights[target] = mx.array(layout.reshape_for(arch, name, value))
            continue
        if shape[-1] % quants.GROUP:
            raise GGUFError(f"{path}: tensor {name} ({type_name}) has rows of {shape[-1]} values, not a multiple "
                            f"of {quants.GROUP}")
        repack = quants.repack_exact if kind == "kept" else quants.requantize
        parts = repack(t.data, type_name, shape)
        if heads:
            parts = [layout.unpermute_rows(p, heads) for p in parts]
        base = target.rsplit(".", 1)[0]
        for suffix, part in zip(("weight", "scales", "biases"), parts):
            weights[f"{base}.{suffix}"] = part if isinstance(part, mx.array) else mx.array(part)
        quant[base] = (quants.GROUP, quants.bits_of(type_name))
    _READERS.clear()  # unmap the file: every tensor is an MLX array of its own now
    return weights, quant


def quantization_entry(quant: dict) -> dict | None:
    """mlx-lm's config "quantization": the most common (group, bits) and
    per-module overrides; None when nothing is quantized."""
    if not quant:
        return None
    settings = sorted(quant.values())
    group_size, bits = max(sorted(set(settings)), key=settings.count)
    entry = {"group_size": group_size, "bits": bits}
    for module, (g, b) in sorted(quant.items()):
        if (g, b) != (group_size, bits):
            entry[module] = {"group_size": g, "bits": b}
    return entry
