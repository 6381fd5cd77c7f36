"""Loads an mlx-lm model directory and prepares it for the paged path.

Families proven against mlx-lm (models/registry.py) are served; any other
model type, and any model whose attention or RoPE the adapter cannot
reproduce, gets a clear NotImplementedError naming what is missing.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from vllm_metal.native import ops  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from vllm_metal.distributed.plan import ParallelPlan  # noqa: E402
from vllm_metal.formats.checkpoint import build_model, open_checkpoint  # noqa: E402
from vllm_metal.models.attention_adapter import PagedAttentionLayer, check_rope  # noqa: E402
from vllm_metal.models.cpu_norm_rope import use_cpu_norm_rope  # noqa: E402
from vllm_metal.models.fused_layer import fuse_decoder_layers, fused_layers_enabled  # noqa: E402
from vllm_metal.models.fused_projections import fuse_projections  # noqa: E402
from vllm_metal.models.gated_delta import GatedDeltaLayer  # noqa: E402
from vllm_metal.models.loaded_model import LayerKV, LoadedModel, decoder_owner  # noqa: E402,F401  (re-exported)
from vllm_metal.models.mamba2 import Mamba2Layer  # noqa: E402
from vllm_metal.models.registry import check_served  # noqa: E402
from vllm_metal.models.short_conv import ShortConvLayer  # noqa: E402
from vllm_metal.models.state_slots import state_writeback_mode  # noqa: E402

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# A hybrid family's linear-attention layers: the decoder block's attribute
# holding one (where the block has no self_attn), and what runs it on state
# slots: Gated DeltaNet (qwen3_next), short convolutions (lfm2, lfm2_moe), Mamba-2
# mixers (granitemoehybrid).
LINEAR_LAYERS = {"linear_attn": GatedDeltaLayer, "conv": ShortConvLayer, "mamba": Mamba2Layer}


def _has_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def load_model(model_dir: str | Path, dtype: str = "float32", dequantize: bool = False,
               materialize: bool = True, fuse: bool = False, norm_rope: bool = False,
               parallel: ParallelPlan | None = None, pooling: bool = False,
               config_path: str | None = None) -> LoadedModel:
    """Load `model_dir` (an mlx-lm / Hugging Face directory, a GGUF file or
    a directory holding one, an AWQ / GPTQ directory: formats/checkpoint.py)
    for the paged path. config_path: vLLM's --hf-config-path.

    dtype: activations / KV cache / unquantized weights. dequantize: expand
    MLX-quantized weights to `dtype` (MLX's CPU quantized matmul is far slower
    than BLAS, so the CPU device wants this; Metal does not). materialize=False
    leaves the weights on disk (every check still runs: `vllm-metal doctor --model`).
    fuse: one matmul per group of projections reading the same input
    (models/fused_projections.py; the CPU device wants this). norm_rope:
    RMSNorm and RoPE through vllm-metal's primitives (models/cpu_norm_rope.py;
    the CPU device wants this). parallel: this rank's share of a
    tensor/pipeline-parallel model; the weights load lazily and only this
    rank's are read (its layers, its shard; the embedding and head on the
    first and last stages). pooling: a pooling model (`--runner pooling`):
    the LM head is not built; a classifier's `score.*` tensors and the LM
    head's are kept, unread until used, as `head_weights` (pooling/heads.py).
    """
    from mlx_lm.utils import load_model as mlx_lm_load_model

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    checkpoint = open_checkpoint(model_dir, config_path)
    head_weights: dict = {}
    check_served(checkpoint.model_type)  # before building anything: one message naming the family
    classes = _without_mtp_layers(checkpoint.config, _pooling_classes(head_weights) if pooling else {})
    # A converted format's weights are read first: a bad file is refused by its own message.
    converted = None if checkpoint.native else checkpoint.load_weights()
    try:
        if checkpoint.native:
            fixes = text_config_fixes(checkpoint.config)
            model, config = mlx_lm_load_model(checkpoint.source, lazy=not materialize or parallel is not None,
                                              model_config={**(checkpoint.config if config_path else {}), **fixes}
                                              or None, **classes)
        else:
            model, config = build_model(checkpoint, weights=converted, **classes)
    except (ValueError, TypeError, KeyError) as e:  # unknown type, missing or bad config fields
        raise NotImplementedError(f"mlx-lm cannot build model type {checkpoint.model_type!r} from "
                                  f"{checkpoint.source}: {type(e).__name__}: {e}") from e
    return prepare_model(model, config, dtype, dequantize, materialize, fuse, norm_rope, parallel, head_weights)


def prepare_model(model: nn.Module, config: dict, dtype: str = "float32", dequantize: bool = False,
                  materialize: bool = True, fuse: bool = False, norm_rope: bool = False,
                  parallel: ParallelPlan | None = None, head_weights: dict | None = None) -> LoadedModel:
    """An mlx-lm model built (load_model; or in memory: a checkpoint's MTP
    layer, speculative/mtp.py) made ready for the paged path: its attention
    layers paged, its weights cast, fused and evaluated as load_model says."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model

    head_weights = {} if head_weights is None else head_weights
    family = check_served(config.get("model_type"))
    if family.linear:
        state_writeback_mode()  # a bad VLLM_METAL_STATE_WRITEBACK is refused here, not at the first step
    attention_class = (importlib.import_module(f"vllm_metal.models.{family.module}").Attention
                       if family.module else PagedAttentionLayer)
    if dequantize and _has_quantized(model):
        model = dequantize_model(model)
    model.set_dtype(DTYPES[dtype])  # floating parameters only; quantized ints stay
    tp_done = 0
    if parallel is not None and parallel.tp > 1:
        from vllm_metal.distributed.tensor_parallel import shard_model

        tp_done = shard_model(model, config, parallel.tp_rank, parallel.tp, parallel.reduce)

    try:  # the decoder: the model's `model`, or its text model's (multimodal wrappers: language_model)
        inner = decoder_owner(model)["model"]
    except NotImplementedError:
        inner = None
    layers = getattr(model, "layers", None) or getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(inner, "embed_tokens"):
        raise NotImplementedError(f"model type {config.get('model_type')!r}: expected an mlx-lm "
                                  "decoder with .model.embed_tokens and .layers")
    windows, layer_kv = [], []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        mixer = next((name for name in LINEAR_LAYERS if getattr(layer, name, None) is not None), None)
        if attn is None and mixer is not None and family.linear:
            setattr(layer, mixer, LINEAR_LAYERS[mixer](getattr(layer, mixer)))
            windows.append(None)
            layer_kv.append(LayerKV(num_kv_heads=0, head_dim=0, layout="state",
                                    state_shapes=getattr(layer, mixer).state_shapes))
            continue
        if attn is None:
            raise NotImplementedError(f"model type {config.get('model_type')!r}: layer {i} has no "
                                      "self_attn (not a plain attention decoder)")
        window = sliding_window_of(model, i, layer, attn, config)
        layer.self_attn = attention_class(attn, window)
        windows.append(window)
        layer_kv.append(_layer_kv(layer.self_attn, i, inner, windows, layer_kv, config))
    checked = set()
    for layer in layers:
        if getattr(layer, "self_attn", None) is None:  # linear attention: no RoPE
            continue
        rope = layer.self_attn.rope()
        if rope is not None and id(rope) not in checked:
            checked.add(id(rope))
            try:
                check_rope(rope, layer.self_attn.rope_dims)
            except NotImplementedError as e:
                rope_config = config.get("rope_scaling") or config.get("rope_parameters")
                raise NotImplementedError(
                    f"model type {config.get('model_type')!r} with rope scaling {rope_config!r} cannot be "
                    f"served by vllm-metal: {e}") from e
    layers = list(layers)  # the real layers (the decoder's own list may get stage wrappers next)
    owned, first, last = range(len(layers)), True, True
    if parallel is not None and parallel.pp > 1:
        owned, first, last = _split_stages(model, config, layers, layer_kv, parallel)
    mine = [layers[i] for i in owned]
    fused = fuse_projections(model, mine, PagedAttentionLayer) if fuse and materialize else {}
    norm_rope_done = use_cpu_norm_rope(model, mine, PagedAttentionLayer) if norm_rope and materialize else {}
    layers_done = fuse_decoder_layers(mine) if fused_layers_enabled() and fused and norm_rope_done else {}
    # A middle stage reads only its layers; the embedding and head load on
    # the first and last (lazily elsewhere: loaded if ever used).
    resident = model.parameters() if first or last else [layer.parameters() for layer in mine]
    if materialize:
        mx.eval(resident)
    staged = parallel is not None and parallel.pp > 1
    return LoadedModel(model=model, config=config, dtype=DTYPES[dtype], num_layers=len(layers),
                       layer_kv=layer_kv, sliding_windows=windows, quantized=_has_quantized(model),
                       fused=fused, norm_rope=norm_rope_done, fused_layers=layers_done,
                       owned=owned if staged else None, last_stage=last,
                       transport=parallel.transport if staged else None, tp_projections=tp_done,
                       weights_bytes=sum(v.nbytes for _, v in tree_flatten(resident)), head_weights=head_weights)


def text_config_fixes(config: dict) -> dict:
    """Config fields a multimodal checkpoint saved by transformers 5 keeps
    where mlx-lm does not read them (its text model's args come from
    `text_config` alone, with their own defaults): the top-level
    `tie_word_embeddings` and `vocab_size`, RoPE bases inside
    `rope_parameters` (per layer kind for Gemma 3), Qwen3.5's
    `full_attention_interval` (transformers 5 writes only `layer_types`).
    {} when nothing moves."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return {}
    fixed = dict(text)
    for key in ("tie_word_embeddings",):
        if key not in fixed and key in config:
            fixed[key] = config[key]
    kinds = fixed.get("layer_types") or []
    if "full_attention_interval" not in fixed and "linear_attention" in kinds:  # qwen3_5: mlx-lm reads the interval
        fixed["full_attention_interval"] = next(
            (k for k in range(1, len(kinds) + 1)
             if all((kind == "full_attention") == ((i + 1) % k == 0) for i, kind in enumerate(kinds))), 0) or None
        if fixed["full_attention_interval"] is None:
            del fixed["full_attention_interval"]
    rope = fixed.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:  # gemma3: one set per layer kind
        full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
        fixed.setdefault("rope_theta", full.get("rope_theta", 1e6))
        if "rope_theta" in local:
            fixed.setdefault("rope_local_base_freq", local["rope_theta"])
        if full.get("rope_type", "default") != "default" and not fixed.get("rope_scaling"):
            fixed["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
    elif "rope_theta" in rope:
        fixed.setdefault("rope_theta", rope["rope_theta"])
    out = {"text_config": fixed} if fixed != text else {}
    if "vocab_size" not in config and "vocab_size" in text:  # mlx-lm's gemma3 reads it at the top
        out["vocab_size"] = text["vocab_size"]
    return out


def _pooling_classes(head_weights: dict) -> dict:
    """mlx-lm's model class for a pooling checkpoint: its sanitize moves the
    LM head's and a classifier's (`score.*`) tensors into `head_weights`
    and the model gets no LM head, so everything else still loads strictly.
    A checkpoint of the bare decoder (no `model.` prefix) gets the prefix."""
    from mlx_lm.utils import _get_classes

    def classes(config):
        model_class, args_class = _get_classes(config)

        class PoolingModel(model_class):
            def sanitize(self, weights):
                if any(k.startswith(("layers.", "embed_tokens.")) for k in weights):
                    # saved from the bare decoder (transformers' *Model, as Qwen3-Embedding is)
                    weights = {k if k.startswith(("lm_head.", "score.")) else "model." + k: v
                               for k, v in weights.items()}
                if hasattr(super(), "sanitize"):
                    weights = super().sanitize(weights)
                for name in [k for k in weights if k.startswith(("lm_head.", "score."))]:
                    head_weights[name] = weights.pop(name)
                if "lm_head" in self:
                    self.pop("lm_head")
                return weights

        PoolingModel.__name__ = PoolingModel.__qualname__ = model_class.__name__
        PoolingModel.__module__ = model_class.__module__
        return PoolingModel, args_class

    return {"get_model_classes": classes}


def mtp_layer_count(config: dict) -> int:
    """The checkpoint's multi-token-prediction layers (`num_nextn_predict_layers`:
    DeepSeek-V3, Kimi K2, GLM-4.5 / 4.7-Flash), stored as the decoder layers
    after its last (`model.layers.{num_hidden_layers + i}`)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return int(text.get("num_nextn_predict_layers") or config.get("num_nextn_predict_layers") or 0)


def _without_mtp_layers(config: dict, classes: dict) -> dict:
    """mlx-lm's model classes (`classes`' get_model_classes, else its own)
    with a sanitize that first drops the tensors of the MTP layers
    (mtp_layer_count) -- the plain model has no place for them, and mlx-lm's
    deepseek_v3 drops only DeepSeek-V3's own index 61 (glm4_moe and
    glm4_moe_lite drop theirs). speculative/mtp.py reads them itself.
    `classes` unchanged for a checkpoint without MTP layers: extra layers
    there are still refused by the strict load."""
    import re

    from mlx_lm.utils import _get_classes

    if not mtp_layer_count(config):
        return classes
    base = classes.get("get_model_classes", _get_classes)
    layer = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.")  # (a vision tower's layers are not the decoder's)

    def get_model_classes(config):
        model_class, args_class = base(config)
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        n = text.get("num_hidden_layers", config.get("num_hidden_layers"))

        class WithoutMtpLayers(model_class):
            def sanitize(self, weights):
                weights = {k: v for k, v in weights.items()
                           if n is None or not ((m := layer.search(k)) and int(m.group(1)) >= n)}
                return super().sanitize(weights) if hasattr(super(), "sanitize") else weights

        WithoutMtpLayers.__name__ = WithoutMtpLayers.__qualname__ = model_class.__name__
        WithoutMtpLayers.__module__ = model_class.__module__
        return WithoutMtpLayers, args_class

    return {**classes, "get_model_classes": get_model_classes}


def _split_stages(model: nn.Module, config: dict, layers: list, layer_kv: list[LayerKV],
                  parallel: ParallelPlan) -> tuple[range, bool, bool]:
    """This stage's layers, with the decoder's layer list rewired (distributed/pipeline.py)."""
    from vllm_metal.distributed.pipeline import split_stages
    from vllm_metal.distributed.topology import stage_layers

    split = parallel.layer_split(len(layers))
    owned = stage_layers(split, parallel.pp_rank)
    for i in owned:
        source = layer_kv[i].source
        if source is not None and source not in owned:
            raise NotImplementedError(f"model type {config.get('model_type')!r}: layer {i} reads layer {source}'s "
                                      f"KV cache, which the layer split {split} puts on another pipeline stage")
    decoder = decoder_owner(model)["model"]
    split_stages(decoder.layers, owned, parallel.transport, first=parallel.pp_rank == 0,
                 last=parallel.pp_rank == parallel.pp - 1)
    return owned, parallel.pp_rank == 0, parallel.pp_rank == parallel.pp - 1


def _layer_kv(attention, index: int, inner: nn.Module, windows: list, earlier: list[LayerKV],
              config: dict) -> LayerKV:
    """What layer `index` caches. A layer without K/V projections of its own
    (gemma4's KV-shared layers) reads the cache of the earlier layer mlx-lm's
    decoder routes to it (`previous_kvs`), which must attend alike."""
    source = None
    if not attention.owns_kv:
        routes = getattr(inner, "previous_kvs", None)
        source = routes[index] if routes is not None else None
        if source is None or source >= index or earlier[source].source is not None:
            raise NotImplementedError(f"model type {config.get('model_type')!r}: layer {index} has no K/V of "
                                      "its own and no earlier layer it reads them from")
        if windows[source] != windows[index]:
            raise NotImplementedError(f"model type {config.get('model_type')!r}: layer {index} shares layer "
                                      f"{source}'s cache but not its window")
    return LayerKV(num_kv_heads=attention.num_kv_heads, head_dim=attention.kv_head_dim, layout=attention.kv_layout,
                   v_head_dim=attention.v_head_dim if attention.kv_layout == "latent" else None, source=source)


def sliding_window_of(model: nn.Module, index: int, layer: nn.Module, attn: nn.Module, config: dict) -> int | None:
    """The layer's attention window as mlx-lm builds it, or None (full
    attention). mlx-lm declares it on the block (`use_sliding`: llama,
    ministral) or on the attention module (`is_sliding`: gemma3,
    `use_sliding_window`: cohere2, `is_local`: exaone4), or only in the
    model's parsed `layer_types` (olmo3); the size is
    the model's parsed `sliding_window`, whose defaults the raw config may not
    carry (gemma3's 512)."""
    sliding = getattr(layer, "use_sliding", None)
    for name in ("is_sliding", "use_sliding_window", "is_local"):  # gemma3, cohere2, exaone4
        if sliding is None:
            sliding = getattr(attn, name, None)
    # the text model's parsed args (a multimodal wrapper's own args hold only its text_config)
    args = getattr(decoder_owner(model), "args", None) or getattr(model, "args", None)
    # olmo3: only the model's parsed layer_types say it; gpt_oss: only its
    # decoder's (a default pattern when the config has none).
    layer_types = getattr(args, "layer_types", None) or getattr(getattr(model, "model", None), "layer_types", None)
    if sliding is None and layer_types:
        sliding = layer_types[index] == "sliding_attention"
    if not sliding:
        return None
    window = getattr(args, "sliding_window", None) or config.get("sliding_window") \
        or (config.get("text_config") or {}).get("sliding_window")
    if not window:
        raise NotImplementedError(f"model type {config.get('model_type')!r}: a sliding layer without a window size")
    return int(window)
