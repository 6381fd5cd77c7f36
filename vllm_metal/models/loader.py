"""Loads an mlx-lm model directory and prepares it for the paged path.

Families proven against mlx-lm (models/registry.py) are served; any other
model type, and any model whose attention or RoPE the adapter cannot
reproduce, gets a clear NotImplementedError naming what is missing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

from vllm_metal import ops  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

import numpy as np  # noqa: E402

from vllm_metal.models.attention_adapter import (PagedAttentionLayer, PagedKVCache,  # noqa: E402
                                                 StepAttentionInputs, check_rope)
from vllm_metal.models.cpu_norm_rope import use_cpu_norm_rope  # noqa: E402
from vllm_metal.models.fused_projections import fuse_projections  # noqa: E402
from vllm_metal.models.gated_delta import GatedDeltaLayer  # noqa: E402
from vllm_metal.models.mamba2 import Mamba2Layer  # noqa: E402
from vllm_metal.models.registry import check_served  # noqa: E402
from vllm_metal.models.short_conv import ShortConvLayer  # noqa: E402
from vllm_metal.models.state_slots import build_linear_inputs, state_writeback_mode  # noqa: E402

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# A hybrid family's linear-attention layers: the decoder block's attribute
# holding one (where the block has no self_attn), and what runs it on state
# slots: Gated DeltaNet (qwen3_next), short convolutions (lfm2, lfm2_moe), Mamba-2
# mixers (granitemoehybrid).
LINEAR_LAYERS = {"linear_attn": GatedDeltaLayer, "conv": ShortConvLayer, "mamba": Mamba2Layer}


@dataclass(frozen=True)
class LayerKV:
    """One layer's cache: what it stores per token, or whose it reads, or
    (linear attention) the state it keeps per request."""

    num_kv_heads: int
    head_dim: int  # K's head size (MLA: kv_lora_rank + rope dims, one latent row per token)
    # "kv": separate K and V caches; "latent": one cache (MLA), V = its first
    # v_head_dim; "state": a linear-attention layer's per-request state slots
    # (state_shapes: the convolution state in the model dtype, then the
    # recurrent state in float32 where the layer has one)
    layout: str = "kv"
    v_head_dim: int | None = None  # V's head size where it differs from head_dim (MLA)
    source: int | None = None  # reads this earlier layer's cache instead of its own (gemma4's KV sharing)
    state_shapes: tuple[tuple[int, ...], ...] | None = None  # "state": per request, (conv[, recurrent])


@dataclass
class LoadedModel:
    """An mlx-lm model with paged attention layers, and the facts the KV cache needs."""

    model: nn.Module
    config: dict
    dtype: mx.Dtype
    num_layers: int
    layer_kv: list[LayerKV]  # per layer
    sliding_windows: list[int | None]  # per layer
    quantized: bool  # weights still MLX-quantized after loading
    # What models/fused_projections.py did: {"qkv": layers, "gate_up": layers, "swiglu": layers}; {} when off.
    fused: dict = field(default_factory=dict)
    # What models/cpu_norm_rope.py did: {"rms_norm": modules, "rope": layers, "rope_tables": n}; {} when off.
    norm_rope: dict = field(default_factory=dict)
    # Pipeline parallel (distributed/pipeline.py): the layers this rank runs
    # and caches (all of them otherwise), whether it computes the logits, and
    # the transport whose sends a step evaluates with its caches.
    owned: range | None = None
    last_stage: bool = True
    transport: object = None
    tp_projections: int = 0  # projections split by tensor parallel (0: none)
    weights_bytes: int = 0  # the weights this rank holds (a pipeline stage: its layers, embedding / head)

    def owns(self, layer: int) -> bool:
        return self.owned is None or layer in self.owned

    def kv_summary(self) -> str:
        """The cache shapes in words: '3 KV heads of 64' where every layer is
        alike, else per kind ('4 layers: 1 KV heads of 16, 2 layers: ...')."""
        own = [kv for kv in self.layer_kv if kv.source is None]
        kinds = {}
        for kv in own:
            text = (f"latent rows of {kv.head_dim} (V: first {kv.v_head_dim})" if kv.layout == "latent"
                    else "linear-attention states " + " + ".join(str(s) for s in kv.state_shapes)
                    if kv.layout == "state" else f"{kv.num_kv_heads} KV heads of {kv.head_dim}")
            kinds[text] = kinds.get(text, 0) + 1
        shared = len(self.layer_kv) - len(own)
        if len(kinds) == 1 and not shared:
            return next(iter(kinds))
        return ", ".join(f"{n} layers: {text}" for text, n in kinds.items()) + (
            f", {shared} layers reading earlier layers' caches" if shared else "")

    def allocate_kv(self, num_blocks: int, block_sizes: list[int], layer_group: list[int]) -> PagedKVCache:
        """Zeroed paged caches for every layer that has its own (group g's
        layers use block size block_sizes[g]); MLA layers get their one latent
        cache only (values[i] None), layers sharing another's cache none.
        Linear-attention layers get their state pools, one slot per block id:
        keys[i] the convolution states, values[i] the recurrent states (None
        where the layer has none: lfm2's short convolutions)."""
        keys, values = [], []
        for i, (kv, g) in enumerate(zip(self.layer_kv, layer_group)):
            if not self.owns(i):  # another pipeline stage's layer
                keys.append(None)
                values.append(None)
                continue
            if kv.layout == "state":
                conv, *recurrent = kv.state_shapes
                keys.append(mx.zeros((num_blocks, *conv), dtype=self.dtype))
                values.append(mx.zeros((num_blocks, *recurrent[0]), dtype=mx.float32) if recurrent else None)
                continue
            shape = (num_blocks, block_sizes[g], kv.num_kv_heads, kv.head_dim)
            keys.append(None if kv.source is not None else mx.zeros(shape, dtype=self.dtype))
            values.append(mx.zeros(shape, dtype=self.dtype) if kv.source is None and kv.layout == "kv" else None)
        cache = PagedKVCache(keys, values, layer_group)
        mx.eval(cache.arrays())
        return cache

    @property
    def has_linear(self) -> bool:
        """Some layers are linear attention (a hybrid model)."""
        return any(kv.layout == "state" for kv in self.layer_kv)

    def forward(self, kv: PagedKVCache, inputs, logit_rows: np.ndarray) -> mx.array | None:
        """One packed step (step_inputs.StepInputs) through every layer and the
        head: lazy float32 logits of the hidden rows `logit_rows`; the caches
        in `kv` are replaced by their written versions (evaluate them with the
        logits). A pipeline stage before the last returns None: its output
        leaves through the transport (evaluate `transport.take_pending()`)."""
        kv.retained = []
        kv.step = StepAttentionInputs(
            positions=mx.array(inputs.positions), seq_lens=mx.array(inputs.seq_lens),
            cu_seqlens_q=mx.array(inputs.cu_seqlens_q),
            block_tables=[mx.array(t) for t in inputs.block_tables],
            slot_mappings=[ops.SlotMapping(m) for m in inputs.slot_mappings],
            linear=build_linear_inputs(inputs.cu_seqlens_q, inputs.positions) if self.has_linear else None)
        try:
            hidden = self.hidden_states(mx.array(inputs.token_ids), kv.layer_views())
            if not self.last_stage:
                return None
            return self.logits(hidden[mx.array(np.asarray(logit_rows, dtype=np.int32))])
        finally:
            kv.step = None

    def hidden_states(self, token_ids: mx.array, cache_views) -> mx.array:
        """[num_tokens] -> [num_tokens, hidden] through every layer (lazy)."""
        return self.model.model(token_ids[None], cache=cache_views)[0]

    def logits(self, hidden: mx.array) -> mx.array:
        """Final hidden rows -> float32 logits [rows, vocab] (lazy), through
        the model's own output head: mlx-lm's `Model.__call__` runs with its
        inner model standing in as "these hidden rows", so whatever the family
        does after the decoder (tied or separate head, final logit softcap,
        logit_scale, logits_scaling) is mlx-lm's code, never re-implemented.
        A wrapper whose `model` is a property (qwen3_5: the text model under
        `language_model`) has the stand-in put where the decoder really is."""
        owner = decoder_owner(self.model)
        inner = owner["model"]
        owner["model"] = _HiddenRows(inner, hidden[None])
        try:
            out = self.model(mx.zeros((1, hidden.shape[0]), dtype=mx.int32))
        finally:
            owner["model"] = inner
        return out[0].astype(mx.float32)


def decoder_owner(model: nn.Module) -> nn.Module:
    """The module holding the decoder as its child `model`: the mlx-lm
    `Model` itself, or the text model it wraps (`language_model`: qwen3_5)."""
    for owner in (model, getattr(model, "language_model", None)):
        if isinstance(owner, nn.Module) and isinstance(owner.get("model"), nn.Module):
            return owner
    raise NotImplementedError(f"{type(model).__module__}.{type(model).__name__}: no decoder child `model` "
                              "(on the model or its language_model) for the output head to run after")


class _HiddenRows:
    """Stands in for an mlx-lm model's inner decoder for one call: returns
    the given hidden states, and passes every attribute (embed_tokens for a
    tied head, ...) through to the real decoder."""

    def __init__(self, inner: nn.Module, hidden: mx.array):
        self._inner, self._hidden = inner, hidden

    def __call__(self, *args, **kwargs) -> mx.array:
        return self._hidden

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _has_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


@dataclass
class ParallelPlan:
    """This rank's part of a multi-rank model (the worker builds it:
    distributed/). Tensor parallel: rank `tp_rank` of `tp`, `reduce` sums
    over the TP group. Pipeline parallel: stage `pp_rank` of `pp`, layers
    per stage from `layer_split(num_layers)`, hidden states moved by
    `transport`."""

    tp_rank: int = 0
    tp: int = 1
    reduce: object = None
    pp_rank: int = 0
    pp: int = 1
    layer_split: object = None
    transport: object = None


def load_model(model_dir: str | Path, dtype: str = "float32", dequantize: bool = False,
               materialize: bool = True, fuse: bool = False, norm_rope: bool = False,
               parallel: ParallelPlan | None = None) -> LoadedModel:
    """Load `model_dir` (an mlx-lm directory) for the paged path.

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
    first and last stages).
    """
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model
    from mlx_lm.utils import load_model as mlx_lm_load_model

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    path = resolve_model_dir(str(model_dir))
    check_served(_model_type(path))  # before building anything: one message naming the family
    try:
        model, config = mlx_lm_load_model(path, lazy=not materialize or parallel is not None)
    except (ValueError, TypeError, KeyError) as e:  # unknown type, missing or bad config fields
        raise NotImplementedError(f"mlx-lm cannot build model type "
                                  f"{_model_type(path)!r} from {path / 'config.json'}: "
                                  f"{type(e).__name__}: {e}") from e
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

    inner = getattr(model, "model", None)
    layers = getattr(model, "layers", None) or getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(inner, "embed_tokens"):
        raise NotImplementedError(f"model type {config.get('model_type')!r}: expected an mlx-lm "
                                  "decoder with .model.embed_tokens and .layers")
    decoder_owner(model)  # the output head's call can reach the decoder
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
    # A middle stage reads only its layers; the embedding and head load on
    # the first and last (lazily elsewhere: loaded if ever used).
    resident = model.parameters() if first or last else [layer.parameters() for layer in mine]
    if materialize:
        mx.eval(resident)
    staged = parallel is not None and parallel.pp > 1
    return LoadedModel(model=model, config=config, dtype=DTYPES[dtype], num_layers=len(layers),
                       layer_kv=layer_kv, sliding_windows=windows, quantized=_has_quantized(model),
                       fused=fused, norm_rope=norm_rope_done, owned=owned if staged else None, last_stage=last,
                       transport=parallel.transport if staged else None, tp_projections=tp_done,
                       weights_bytes=sum(v.nbytes for _, v in tree_flatten(resident)))


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
    args = getattr(model, "args", None)
    # olmo3: only the model's parsed layer_types say it; gpt_oss: only its
    # decoder's (a default pattern when the config has none).
    layer_types = getattr(args, "layer_types", None) or getattr(getattr(model, "model", None), "layer_types", None)
    if sliding is None and layer_types:
        sliding = layer_types[index] == "sliding_attention"
    if not sliding:
        return None
    window = getattr(args, "sliding_window", None) or config.get("sliding_window")
    if not window:
        raise NotImplementedError(f"model type {config.get('model_type')!r}: a sliding layer without a window size")
    return int(window)


def resolve_model_dir(model: str) -> Path:
    """A local model directory, or a Hugging Face hub id downloaded (or found
    in the local hub cache) where the network allows."""
    path = Path(model).expanduser()
    if (path / "config.json").exists():
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"{model} is not a model directory (no config.json); give a local "
                                "mlx-lm / Hugging Face model directory or a hub id")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.py",
                                                             "tokenizer.model", "*.tiktoken", "*.txt"]))
    except Exception as e:  # offline, unknown repo, no access: say which
        raise FileNotFoundError(f"cannot get model {model!r} from the Hugging Face hub ({type(e).__name__}: "
                                f"{e}); download it where the network allows and pass its directory") from e


def _model_type(path: Path) -> str | None:
    import json

    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
