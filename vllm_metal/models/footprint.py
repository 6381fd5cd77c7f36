"""What a checkpoint takes in memory, computed from its config alone.

The model is built with mlx-lm's own classes from the config and prepared for
the paged path (models/loader.prepare_model) without evaluating anything: its
arrays are lazy, so the shapes are known and no weight is allocated or read.
The weights' bytes follow from the shapes, quantized as the checkpoint says
(mlx-lm's `quantization`, AWQ / GPTQ's `quantization_config`, or a requested
`4bit` / `8bit` / GGUF `q4_k_m` / `q8_0`); each layer's cache (`LayerKV`)
becomes a `native.fit.LayerCache`. `vllm-metal doctor --model CONFIG`, the
checkpoint table in docs/models.md and the worker's fit check before loading
(engine/worker.py) all use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from vllm_metal.native import fit

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Requested quantizations: MLX affine (bits, group size) as `mlx_lm.convert -q`
# makes them, or a llama.cpp file type (loaded as formats/gguf_quants.py serves it).
MLX_QUANTS = {"3bit": (3, 64), "4bit": (4, 64), "5bit": (5, 64), "6bit": (6, 64), "8bit": (8, 64)}
GGUF_QUANTS = ("q4_k_m", "q8_0")
QUANTS = (*MLX_QUANTS, *GGUF_QUANTS)
QK_K = 256  # a K-quant's super-block: rows not a multiple of it take llama.cpp's fallback type
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def serving_dtype(config: dict, device: str, requested: str | None = None) -> str:
    """The dtype `vllm serve` runs the model in: --dtype, else vLLM's "auto"
    (the config's dtype; a float32 or unstated one becomes the platform's
    first, float32 on MLX's CPU device and bfloat16 on Metal)."""
    if requested and requested != "auto":
        return requested
    text = config.get("text_config") or {}
    name = (config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or text.get("dtype")
            or "float32")
    if name in ("bfloat16", "float16"):
        return name
    return "float32" if device == "cpu" else "bfloat16"


@dataclass(frozen=True)
class Quant:
    """How the weights are quantized: uniform MLX affine `bits` / `group_size`
    with mlx-lm's per-module overrides, only the decoder's layers (AWQ / GPTQ
    keep the embedding and head in float), or a llama.cpp file type."""

    bits: int = 0
    group_size: int = 64
    overrides: dict = field(default_factory=dict)  # module path -> {"bits", "group_size"} or False
    decoder_only: bool = False
    skip: tuple = ()  # module names left in float (AWQ's modules_to_not_convert)
    gguf: str | None = None
    requested: bool = False  # asked for (--quant): made as mlx_lm.convert would now, its family's predicate included
    label: str = "float"


def quant_of(config: dict, requested: str | None = None) -> Quant | None:
    """The checkpoint's quantization (None: float weights), or the one asked for."""
    if requested:
        requested = requested.lower()
        if requested in MLX_QUANTS:
            bits, group = MLX_QUANTS[requested]
            return Quant(bits, group, requested=True, label=f"MLX affine {bits}-bit, group {group} (requested)")
        if requested in GGUF_QUANTS:
            return Quant(gguf=requested.upper(), group_size=32,
                         label=f"GGUF {requested.upper()} (llama.cpp's per-tensor types)")
        raise ValueError(f"--quant {requested!r}: use one of {', '.join(QUANTS)}")
    q = config.get("quantization") or (config.get("text_config") or {}).get("quantization")
    if q:
        overrides = {k: v for k, v in q.items() if isinstance(v, (dict, bool))}
        return Quant(q["bits"], q["group_size"], overrides, label=f"MLX affine {q['bits']}-bit, group "
                     f"{q['group_size']}" + (" (per-layer overrides)" if overrides else ""))
    qc = config.get("quantization_config") or {}
    method = qc.get("quant_method")
    if method in ("awq", "gptq"):
        bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
        return Quant(bits, group, decoder_only=True, skip=tuple(qc.get("modules_to_not_convert") or ()),
                     label=f"{method.upper()} {bits}-bit, group {group} (repacked to MLX affine)")
    if method:
        raise ValueError(f"quantization_config quant_method {method!r}: its weights' memory is not computed here")
    return None


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits (Q4_K_M)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def ggml_type(ftype: str, path: str, shape: tuple, n_layers: int, tied: bool) -> str | None:
    """The GGML type llama.cpp's quantizer gives the tensor of mlx-lm module
    `path` (weight `shape`) in a `ftype` file; None: kept in float (a MoE
    router). Q4_K_M: the head (the embedding where it is tied) Q6_K, attn_v
    and ffn_down Q6_K on use_more_bits layers, a fused qkv Q5_K, the rest Q4_K."""
    if path.endswith("mlp.gate") or path.endswith(".router"):
        return None
    if ftype == "Q8_0":
        return "Q8_0"
    head = path.endswith("lm_head") or (tied and path.endswith("embed_tokens"))
    m = re.search(r"layers\.(\d+)\.", path)
    if head:
        kind = "Q6_K"
    elif m and re.search(r"(v_proj|down_proj)$", path):
        kind = "Q6_K" if use_more_bits(int(m.group(1)), n_layers) else "Q4_K"
    elif path.endswith("qkv_proj"):
        kind = "Q5_K"
    else:
        kind = "Q4_K"
    return K_FALLBACK[kind] if shape[-1] % QK_K and kind in K_FALLBACK else kind


def _predicate(model, quant: Quant, config: dict):
    from vllm_metal.formats.gguf_quants import bits_of

    n_layers = len(_decoder_layers(model))
    tied = bool(config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings")))
    own = getattr(model, "quant_predicate", None)

    def predicate(path, module):
        if path in quant.overrides:
            return quant.overrides[path]
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % quant.group_size:
            return False
        if quant.decoder_only and (".layers." not in path or path.rsplit(".", 1)[-1] in quant.skip):
            return False
        if quant.gguf:
            kind = ggml_type(quant.gguf, path, module.weight.shape, n_layers, tied)
            return {"group_size": 32, "bits": bits_of(kind)} if kind else False
        if own is None or quant.decoder_only:
            return True
        chosen = own(path, module)
        # mlx_lm.convert records the settings its predicate picks in the config
        # (the overrides above); a checkpoint's config without them was made without.
        return chosen if quant.requested or not isinstance(chosen, dict) else True

    return predicate


def _drop_tied_head(model, config: dict) -> None:
    """Families that build an LM head and drop it in `sanitize` when the
    checkpoint has none (gemma3_text): a config that ties the embeddings
    (transformers' default) ships none."""
    text = config.get("text_config") or {}
    owner = getattr(model, "language_model", None) or model
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    if tied and "lm_head" in owner and getattr(owner, "tie_word_embeddings", None) is False:
        owner.pop("lm_head")
        owner.tie_word_embeddings = True


def _decoder_layers(model) -> list:
    inner = getattr(model, "model", None) or getattr(getattr(model, "language_model", None), "model", None)
    return list(getattr(model, "layers", None) or getattr(inner, "layers", None) or [])


@dataclass
class Footprint:
    model_type: str | None
    served: bool
    reason: str  # why not served, or the family's cache in words
    dtype: str
    quant: str
    params: int = 0  # parameters, quantized ones counted unpacked
    packed: int = 0  # bytes on Metal: quantized weights kept packed, the rest in `dtype`
    expanded: int = 0  # bytes on MLX's CPU device: quantized weights expanded to `dtype`
    four_bit: int = 0  # the same model as an MLX 4-bit (group 64) build
    layers: list = field(default_factory=list)  # native.fit.LayerCache per layer with its own cache
    hybrid: bool = False  # linear-attention layers: vLLM's hybrid KV-cache manager on
    windows: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    device: str = "gpu"  # MLX's device it is served on

    @property
    def hybrid_manager(self) -> bool:
        """vLLM's hybrid KV-cache manager on (the platform's default): linear-attention
        models, and sliding-window models (windows sized to the window), on Metal and on
        MLX's CPU device alike."""
        return self.hybrid or bool(self.windows)

    def weights(self, expand: bool) -> int:
        return self.expanded if expand else self.packed

    def plan(self, max_model_len: int, cache_dtype: str = "auto", **kw) -> fit.Plan:
        kw.setdefault("hybrid_manager", self.hybrid_manager)  # the platform's default
        return fit.Plan(max_model_len=max_model_len, cache_dtype=cache_dtype, dtype_bytes=DTYPE_BYTES[self.dtype],
                        **kw)

    def kv_bytes(self, max_model_len: int, cache_dtype: str = "auto", **kw) -> int:
        return fit.kv_bytes(self.layers, self.plan(max_model_len, cache_dtype, **kw))


def _count(model, dtype_bytes: int) -> tuple[int, int, int]:
    """(parameters, packed bytes, expanded bytes) of a built (lazy) model.
    Expanded: what mlx-lm's dequantize_model expands (quantized linear,
    embedding and switch layers; others, e.g. QuantizedMultiLinear, stay packed)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    expandable = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
    quantized = {name: mod for name, mod in model.named_modules() if getattr(mod, "bits", None)}
    # The loader expands only a model with a quantized linear or embedding
    # layer (models/loader._has_quantized): quantized expert stacks alone stay packed.
    if not any(isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for mod in quantized.values()):
        expandable = ()
    params = packed = expanded = 0
    for name, value in tree_flatten(model.parameters()):
        module, _, leaf = name.rpartition(".")
        owner = quantized.get(module)
        expands = isinstance(owner, expandable)
        if owner is not None and leaf == "weight":
            n = value.size * 32 // owner.bits
            params, packed = params + n, packed + value.nbytes
            expanded += n * dtype_bytes if expands else value.nbytes
        elif owner is not None and leaf in ("scales", "biases"):
            packed += value.size * dtype_bytes
            expanded += 0 if expands else value.size * dtype_bytes
        else:
            params += value.size
            packed += value.size * dtype_bytes
            expanded += value.size * dtype_bytes
    return params, packed, expanded


def _four_bit(model, dtype_bytes: int) -> int:
    """The bytes of `model` (float, lazy) as an MLX 4-bit group-64 build."""
    from mlx.utils import tree_flatten

    total = 0
    quantizable = {name for name, mod in model.named_modules()
                   if hasattr(mod, "to_quantized") and mod.weight.shape[-1] % 64 == 0}
    for name, value in tree_flatten(model.parameters()):
        module, _, leaf = name.rpartition(".")
        if module in quantizable and leaf == "weight":
            total += value.size // 2 + 2 * (value.size // 64) * dtype_bytes
        else:
            total += value.size * dtype_bytes
    return total


def layer_caches(m) -> list[fit.LayerCache]:
    """native.fit's view of a LoadedModel's layers that have a cache of their own."""
    import math

    itemsize = m.dtype.size
    out = []
    for kv, window in zip(m.layer_kv, m.sliding_windows):
        if kv.source is not None:
            continue
        if kv.layout == "state":
            conv, *recurrent = kv.state_shapes
            state = math.prod(conv) * itemsize + sum(4 * math.prod(s) for s in recurrent)
            out.append(fit.LayerCache(state_bytes=state))
        else:
            out.append(fit.LayerCache(kv_heads=kv.num_kv_heads, head_dim=kv.head_dim,
                                      rows=1 if kv.layout == "latent" else 2, window=window))
    return out


def footprint(config: dict, *, device: str = "gpu", dtype: str | None = None, quant: str | None = None) -> Footprint:
    """The memory of the checkpoint `config` describes, as vllm-metal would load
    it on `device` (see the module). Never raises for an unserved family: the
    registry's refusal is the reason, with the weights where mlx-lm builds it."""
    from vllm_metal.native import ops  # noqa: F401  (fast BLAS before mlx)

    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    from vllm_metal.models.loader import prepare_model, text_config_fixes
    from vllm_metal.models.registry import check_served

    config = {**config, **text_config_fixes(config)}
    dtype = serving_dtype(config, device, dtype)
    q = quant_of(config, quant)
    result = Footprint(model_type=config.get("model_type"), served=False, reason="", dtype=dtype, device=device,
                       quant=q.label if q else f"float ({config.get('torch_dtype') or config.get('dtype') or dtype})")
    try:
        family = check_served(result.model_type)
    except NotImplementedError as e:
        family, result.reason = None, str(e)
    try:
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        _drop_tied_head(model, config)
    except Exception as e:  # noqa: BLE001 -- mlx-lm cannot build it: the message is the answer
        result.reason = result.reason or (f"mlx-lm cannot build model type {result.model_type!r}: "
                                          f"{type(e).__name__}: {e}")
        return result
    size = DTYPE_BYTES[dtype]
    result.four_bit = _four_bit(model, size)
    if q is not None:
        nn.quantize(model, group_size=q.group_size, bits=q.bits or 4, class_predicate=_predicate(model, q, config))
    if any(k in config for k in ("vision_config", "audio_config")):
        result.notes.append("its vision / audio tower is not counted (mlx-lm builds the text model)")
    m = None
    if family is not None:
        try:  # the paged layers as loading makes them (MLA's absorbed projections included)
            m = prepare_model(model, config, dtype, materialize=False)
        except NotImplementedError as e:  # the adapter's refusal (a RoPE it cannot reproduce, ...)
            result.reason = str(e)
    result.params, result.packed, result.expanded = _count(model, size)
    if m is None:
        return result
    result.served, result.hybrid = True, bool(family.linear)
    result.layers, result.windows = layer_caches(m), sorted({w for w in m.sliding_windows if w})
    result.reason = f"{m.num_layers} layers, {m.kv_summary()}" + (
        f", sliding windows {result.windows}" if result.windows else "")
    return result


def gguf_weights(path, dtype_bytes: int) -> tuple[int, int, int]:
    """(parameters, packed bytes, expanded bytes) of a GGUF file's tensors as
    formats/gguf_checkpoint.py loads them: each quantized type as MLX affine
    (group 32, formats/gguf_quants.py's bits) with scales and biases in the
    model dtype, float tensors in the model dtype. Reads the tensor index only."""
    import math

    from vllm_metal.formats import gguf_quants
    from vllm_metal.formats.gguf_checkpoint import _reader

    params = packed = 0
    for t in _reader(path).tensors:
        n = math.prod(t.shape)
        bits = gguf_quants.bits_of(t.type_name)
        params += n
        packed += n * bits // 8 + 2 * (n // gguf_quants.GROUP) * dtype_bytes if bits else n * dtype_bytes
    return params, packed, params * dtype_bytes


def checkpoint_footprint(model: str, config_path: str | None = None, device: str = "gpu",
                         dtype: str | None = None) -> Footprint:
    """The footprint of a checkpoint `vllm serve MODEL` would load (a model
    directory, a GGUF file, an AWQ / GPTQ directory), before any weight is
    read: its config, and for a GGUF its tensor index."""
    from vllm_metal.formats.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(model, config_path)
    result = footprint(checkpoint.config, device=device, dtype=dtype)
    if checkpoint.format == "gguf":
        result.params, result.packed, result.expanded = gguf_weights(checkpoint.source, DTYPE_BYTES[result.dtype])
        types = checkpoint.details["tensor_types"]
        result.quant = "GGUF " + ", ".join(f"{t} x{n}" for t, n in sorted(types.items()))
    return result
