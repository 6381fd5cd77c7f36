"""A loaded model as the runner sees it: the per-layer cache facts
(`LayerKV`), the paged caches it allocates, and one packed step through the
layers and the model's own output head (`LoadedModel`). models/loader.py
builds it."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_metal.native import ops  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from vllm_metal.models.attention_adapter import PagedKVCache, StepAttentionInputs  # noqa: E402
from vllm_metal.models.state_slots import build_linear_inputs  # noqa: E402


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
    # What models/fused_layer.py did: {"layers": blocks run as one primitive}; {} when off.
    fused_layers: dict = field(default_factory=dict)
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
    # A pooling model (loader's pooling=True): the LM head's and a classifier's
    # tensors, lazy (read only if the pooling head uses them); no LM head is built.
    head_weights: dict = field(default_factory=dict)
    # The output head as one float32 [vocab, hidden] matrix when the logits are
    # exactly hidden @ W^T (no scale, softcap or bias; not split by tensor
    # parallel), found by greedy_head(); False: not such a head.
    _plain_head: object = None
    # Its bfloat16 screen on MLX's CPU device (ops.argmax_head_screen; None
    # where not built or not used), built with it.
    _head_screen: object = None
    # EAGLE-3 (speculative/eagle3.py): the layers whose incoming residual stream a step's
    # `hidden_out` gets instead of the final hidden states (id n: the last layer's output).
    aux_layers: tuple[int, ...] = ()

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

    def load_notes(self, parallel) -> list[str]:
        """What loading did beyond the plain model, in words (the runner logs
        them): this rank's tensor / pipeline share (`parallel`: its
        ParallelPlan), fused projections, CPU primitives."""
        notes = []
        if self.tp_projections:
            notes.append(f"tensor parallel rank {parallel.tp_rank} of {parallel.tp}: "
                         f"{self.tp_projections} projections split")
        if self.owned is not None:
            notes.append(f"pipeline stage {parallel.pp_rank} of {parallel.pp}: layers "
                         f"{self.owned.start}-{self.owned.stop - 1} of {self.num_layers}")
        if self.fused:
            notes.append("fused projections: {qkv} q/k/v, {gate_up} gate/up, {swiglu} SwiGLU".format(**self.fused))
        if self.fused_layers:
            notes.append("decoder layers as one primitive: {layers} of {n}".format(n=self.num_layers,
                                                                                  **self.fused_layers))
        if self.norm_rope:
            notes.append("CPU primitives: {rms_norm} RMSNorms, RoPE of {rope} layers from {rope_tables} "
                         "table(s) a step".format(**self.norm_rope))
        return notes

    def allocate_kv(self, num_blocks: int, block_sizes: list[int], layer_group: list[int],
                    kv_cache_dtype: str = "auto", layer_share: list | None = None) -> PagedKVCache:
        """Zeroed paged caches for every layer that has its own (group g's
        layers use block size block_sizes[g]); MLA layers get their one latent
        cache only (values[i] None), layers sharing another's cache none.
        Linear-attention layers get their state pools, one slot per block id:
        keys[i] the convolution states, values[i] the recurrent states (None
        where the layer has none: lfm2's short convolutions). kv_cache_dtype:
        vLLM's --kv-cache-dtype; an 8-bit one makes the attention caches uint8
        (linear-attention states keep their dtypes). layer_share: a key per
        layer (None: its own arrays, kv_specs.layer_shares): attention layers
        with one key whose arrays have the same shape and dtype get one pair
        of arrays (vLLM's KV-cache tensor they share, a layer of each cache
        group: block ids never overlap between groups)."""
        from vllm_metal.native import kv_quant

        cache_dtype = mx.uint8 if kv_quant.cache_format(kv_cache_dtype) else self.dtype
        if cache_dtype == mx.uint8 and any(kv.layout == "latent" for kv in self.layer_kv):
            raise NotImplementedError(f"--kv-cache-dtype {kv_cache_dtype}: latent attention (MLA) keeps its cache "
                                      "in the model dtype; serve this model with --kv-cache-dtype auto")
        keys, values, layer_slot, shared = [], [], [], {}
        for i, (kv, g) in enumerate(zip(self.layer_kv, layer_group)):
            layer_slot.append(len(keys))
            if not self.owns(i):  # another pipeline stage's layer
                keys.append(None)
                values.append(None)
                continue
            if kv.layout == "state":
                conv, *recurrent = kv.state_shapes
                keys.append(mx.zeros((num_blocks, *conv), dtype=self.dtype))
                values.append(mx.zeros((num_blocks, *recurrent[0]), dtype=mx.float32) if recurrent else None)
                continue
            shape = (num_blocks, block_sizes[g], kv.num_kv_heads, kv_quant.row_bytes(kv_cache_dtype, kv.head_dim))
            share = layer_share[i] if layer_share is not None and kv.source is None else None
            if share is not None:
                key = (share, kv.layout, shape, cache_dtype)
                if key in shared:  # an earlier layer's arrays
                    layer_slot[-1] = shared[key]
                    continue
                shared[key] = len(keys)
            keys.append(None if kv.source is not None else mx.zeros(shape, dtype=cache_dtype))
            values.append(mx.zeros(shape, dtype=cache_dtype) if kv.source is None and kv.layout == "kv" else None)
        cache = PagedKVCache(keys, values, layer_group, kv_cache_dtype=kv_cache_dtype, dtype=self.dtype,
                             layer_slot=layer_slot)
        mx.eval(cache.arrays())
        return cache

    @property
    def has_linear(self) -> bool:
        """Some layers are linear attention (a hybrid model)."""
        return any(kv.layout == "state" for kv in self.layer_kv)

    def forward(self, kv: PagedKVCache, inputs, logit_rows: np.ndarray, greedy: bool = False,
                fused_head: bool = True, hidden_out: list | None = None) -> mx.array | None:
        """One packed step (step_inputs.StepInputs) through every layer and the
        head: lazy float32 logits of the hidden rows `logit_rows` (with
        `greedy`: their argmax tokens, int32, see greedy_tokens); the caches
        in `kv` are replaced by their written versions (evaluate them with the
        logits). A pipeline stage before the last returns None: its output
        leaves through the transport (evaluate `transport.take_pending()`).
        hidden_out: gets the final hidden states of every token appended (an
        MTP layer reads them: speculative/mtp.py), or with `aux_layers` the
        residual streams before those layers, concatenated [tokens, n x hidden]
        (vLLM's EagleModelMixin order: an EAGLE-3 head reads them)."""
        kv.retained = []
        kv.step = self._step_inputs(inputs)
        try:
            ids = getattr(inputs, "token_ids_mx", None)
            aux = {} if hidden_out is not None and self.aux_layers else None
            hidden = self.hidden_states(mx.array(inputs.token_ids) if ids is None else ids, kv.layer_views(),
                                        getattr(inputs, "input_embeddings", None), aux)
            if not self.last_stage:
                return None
            if hidden_out is not None:
                hidden_out.append(hidden if aux is None else mx.concatenate([aux[i] for i in self.aux_layers], -1))
            rows = hidden[mx.array(np.asarray(logit_rows, dtype=np.int32))]
            return self.greedy_tokens(rows, fused_head) if greedy else self.logits(rows)
        finally:
            kv.step = None

    def greedy_tokens(self, hidden: mx.array, fused_head: bool = True) -> mx.array:
        """Final hidden rows -> each row's argmax token (int32, lazy): through
        the ArgmaxHead primitive when the head is a plain matrix (ops.argmax_head:
        the logits never leave the registers; on the CPU through the head's
        bfloat16 screen where one was built), else argmax of `logits`."""
        w = self.greedy_head() if fused_head else None
        if w is not None:
            return ops.argmax_head(hidden.astype(mx.float32), w, screen=self._head_screen)
        return mx.argmax(self.logits(hidden), axis=-1).astype(mx.int32)

    def greedy_head(self) -> mx.array | None:
        """The head's float32 [vocab, hidden] matrix when the model's own
        logits are exactly hidden @ W^T: the checkpoint's bias-free lm_head,
        else the tied input embedding (not MLX-quantized), checked once
        against `logits` on probe rows (a family that scales or softcaps its
        logits, or a head split by tensor parallel, fails the check)."""
        if self._plain_head is None:
            self._plain_head = self._find_plain_head()
            if self._plain_head is not False and mx.default_device().type == mx.DeviceType.cpu:
                self._head_screen = ops.argmax_head_screen(self._plain_head)  # None where not used
        return self._plain_head if self._plain_head is not False else None

    def share_greedy_head(self, owner: "LoadedModel") -> None:
        """This model's output head is `owner`'s (an MTP layer's is the target's, as vLLM shares
        it): owner's plain-head finding and bfloat16 screen, not a second screen of the same head."""
        w = owner.greedy_head()
        self._plain_head, self._head_screen = (w if w is not None else False), owner._head_screen

    def _find_plain_head(self):
        owner = decoder_owner(self.model)
        head = owner["lm_head"] if "lm_head" in owner else owner["model"].embed_tokens  # (checked below)
        if type(head) not in (nn.Linear, nn.Embedding) or "bias" in head or head.weight.dtype != mx.float32 \
                or not self.last_stage:
            return False
        w = head.weight
        probe = mx.random.normal((4, w.shape[1]), key=mx.random.key(0)).astype(mx.float32)
        try:
            want = self.logits(probe)
        except Exception:  # noqa: BLE001 -- whatever the head does, it is not a plain matrix
            return False
        if want.shape != (4, w.shape[0]):
            return False
        got = probe @ w.T
        scale = float(mx.max(mx.abs(want)).item()) or 1.0
        return w if float(mx.max(mx.abs(want - got)).item()) <= 1e-5 * scale else False

    def forward_hidden(self, kv: PagedKVCache, inputs) -> mx.array:
        """One packed step, as `forward`, to the final hidden states of every
        scheduled token (lazy float32 [tokens, hidden]): what a pooling
        model pools; a draft model's cache writes (evaluate `kv.arrays()` only)."""
        kv.retained = []
        kv.step = self._step_inputs(inputs)
        try:
            ids = getattr(inputs, "token_ids_mx", None)
            return self.hidden_states(mx.array(inputs.token_ids) if ids is None else ids,
                                      kv.layer_views()).astype(mx.float32)
        finally:
            kv.step = None

    def head_rows(self, token_ids: list[int]) -> np.ndarray:
        """Rows of the LM head (the checkpoint's lm_head, else the tied input
        embedding) for `token_ids`: float32 [len, hidden], dequantized."""
        w = self.head_weights.get("lm_head.weight")
        if w is not None:
            scales = self.head_weights.get("lm_head.scales")
            if scales is not None:
                raise NotImplementedError("classifier_from_token on an MLX-quantized LM head")
            return np.array(w[mx.array(token_ids)].astype(mx.float32))
        embed = decoder_owner(self.model)["model"].embed_tokens
        if isinstance(embed, nn.QuantizedEmbedding):
            ids = mx.array(token_ids)
            rows = mx.dequantize(embed.weight[ids], embed.scales[ids], embed.biases[ids], embed.group_size,
                                 embed.bits)
            return np.array(rows.astype(mx.float32))
        return np.array(embed.weight[mx.array(token_ids)].astype(mx.float32))

    def _step_inputs(self, inputs) -> StepAttentionInputs:
        return StepAttentionInputs(
            positions=mx.array(inputs.positions), seq_lens=mx.array(inputs.seq_lens),
            cu_seqlens_q=mx.array(inputs.cu_seqlens_q),
            block_tables=[mx.array(t) for t in inputs.block_tables],
            slot_mappings=[ops.SlotMapping(m) for m in inputs.slot_mappings],
            linear=build_linear_inputs(inputs.cu_seqlens_q, inputs.positions, getattr(inputs, "state_slots", None),
                                       getattr(inputs, "num_drafts", None), inputs.block_tables)
            if self.has_linear else None,
            mrope_positions=None if getattr(inputs, "mrope_positions", None) is None
            else mx.array(inputs.mrope_positions),
            image_spans=getattr(inputs, "image_spans", None))

    def embed_tokens(self, token_ids: mx.array) -> mx.array:
        """The decoder's own input embedding of `token_ids` (before any scale
        the decoder applies to its input embeddings)."""
        return decoder_owner(self.model)["model"].embed_tokens(token_ids)

    def hidden_states(self, token_ids: mx.array, cache_views, input_embeddings: mx.array | None = None,
                      aux: dict | None = None) -> mx.array:
        """[num_tokens] -> [num_tokens, hidden] through every layer (lazy);
        input_embeddings [num_tokens, hidden] (images scattered in) replace the
        token embeddings. aux: gets {i: the residual stream entering layer i}
        for i in aux_layers (the decoder's layers tapped for this call)."""
        decoder = decoder_owner(self.model)["model"]
        layers = list(decoder.layers) if aux is not None else None
        if aux is not None:
            decoder.layers[:] = [_Tap(layer, i, aux, self.aux_layers) for i, layer in enumerate(layers)]
        try:
            if input_embeddings is None:
                return decoder(token_ids[None], cache=cache_views)[0]
            return decoder(token_ids[None], cache=cache_views, input_embeddings=input_embeddings[None])[0]
        finally:
            if layers is not None:
                decoder.layers[:] = layers

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


class _Tap:
    """A decoder layer for one call that also records the residual stream
    entering it (and, for the last, leaving it) where `wanted` names it
    (every other attribute is the layer's: the decoder may read them)."""

    def __init__(self, layer, i: int, into: dict, wanted: tuple[int, ...]):
        self.layer, self.i, self.into, self.wanted = layer, i, into, wanted

    def __call__(self, x, *args, **kwargs):
        if self.i in self.wanted:
            self.into[self.i] = x[0]
        out = self.layer(x, *args, **kwargs)
        if self.i + 1 in self.wanted:
            self.into[self.i + 1] = out[0]
        return out

    def __getattr__(self, name):
        return getattr(self.layer, name)


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
