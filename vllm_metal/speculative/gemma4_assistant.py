"""Gemma 4's assistant as the drafter (vLLM's method "mtp" with a
`gemma4_assistant` checkpoint as the speculative "model": Gemma4MTP and
Gemma4Proposer, model_executor/models/gemma4_mtp.py and
v1/spec_decode/gemma4.py): a small decoder whose layers have queries only
and attend the TARGET's K/V, in the target's own paged cache (it has no
cache of its own: it declares no KV-cache layers to vLLM, and the runner's
"draft cache" is the target's, gemma4_assistant_config.py says which layer
each of its layers reads: the target's last layer of its kind with a cache).

One draft pass (vLLM's arithmetic, the same weights): for a request whose
newest token t sits at position P, x = pre_projection([embed(t) *
sqrt(backbone_hidden_size), h]) with the TARGET's embedding and h the
target's final hidden state at P - 1; the layers (mlx-lm's gemma4_text
decoder blocks, attention through models/gemma4.py's KV-shared path: the
query at P - 1 over the target's K/V of positions <= P - 1, sliding layers
within their window); d = norm(x); the draft is the argmax of d's logits
(the head tied to the assistant's own embedding, generation_config's
suppress_tokens masked; with use_ordered_embeddings, vLLM's centroid-masked
logits: the top-k centroids' tokens only). Passes 2..k feed the draft
before and post_projection(d) at the same position P - 1 over the same
context (vLLM's `constant_draft_positions`), so nothing is written.

Where it runs: the step's graph keeps each sampling row's hidden rows of
its last 1 + drafts positions (`write_step`, through the runner's MTP hook);
after the step the requests the budget lets draft run their k passes as one
lazy graph evaluated once (`propose`). Preemption, prefix-cache hits and
rejected drafts need nothing: the target's cache is the only state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vllm_metal.models.attention_adapter import LayerCacheView, PagedKVCache, StepAttentionInputs
from vllm_metal.models.loaded_model import LoadedModel
from vllm_metal.speculative.draft_model import InputsFor
from vllm_metal.speculative.gemma4_assistant_config import layer_kinds, layer_shape, source_layers, text_of
from vllm_metal.speculative.mtp import collect_drafts


class NoCacheOfItsOwn:
    """The runner's view of the assistant's "model": no layer with a cache
    of its own (kv_specs declares none to vLLM), its weights counted."""

    layer_kv: list = []
    sliding_windows: list = []
    num_layers = 0

    def __init__(self, dtype: mx.Dtype, weights_bytes: int):
        self.dtype, self.weights_bytes = dtype, weights_bytes

    def owns(self, layer: int) -> bool:
        return True


class AssistantDrafter:
    reads_target_cache = True  # the runner hands it the target's cache as its `kv`

    def __init__(self, layers: list, sources: list[int], target: LoadedModel, weights: dict, config, k: int,
                 max_model_len: int, suppress: list[int], weights_bytes: int):
        text = text_of(config)
        self.layers, self.sources, self.target, self.k, self.max_model_len = layers, sources, target, k, max_model_len
        self.dtype = target.dtype
        self.normalizer = float(config.backbone_hidden_size) ** 0.5  # vLLM: sqrt(backbone_hidden_size)
        self.pre, self.post, self.head = weights["pre_projection"], weights["post_projection"], weights["head"]
        self.norm = nn.RMSNorm(text.hidden_size, eps=text.rms_norm_eps)
        self.norm.weight = weights["norm"]
        self.centroids, self.clusters = weights.get("centroids"), weights.get("clusters")
        self.top_k = int(getattr(config, "centroid_intermediate_top_k", 32))
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.suppress = mx.array(np.asarray(suppress, np.int32)) if suppress and self.centroids is None else None
        self.model = NoCacheOfItsOwn(self.dtype, weights_bytes)
        self.kv: PagedKVCache | None = None  # the target's (the runner's initialize_kv_cache)
        self.frontier: mx.array | None = None
        self.frontier_at: dict[int, tuple[int, int]] = {}
        self.passes = 0  # passes run (instrumentation)

    @staticmethod
    def layer_name(i: int) -> str:
        return f"draft_model.layers.{i}.self_attn"  # (none declared: the assistant has no cache)

    def restart(self, req_ids) -> None:
        """Nothing per request: the target's cache is the only state."""

    def reach(self, position: int, room: int) -> int:
        """Drafts for a request whose newest token sits at `position`: the passes write nothing; the drafts
        land below max_model_len."""
        return max(0, min(self.k, self.max_model_len - 1 - position))

    def write_step(self, rows, states, spec: dict[str, list[int]], hidden: mx.array,
                   inputs_for: InputsFor) -> list[mx.array]:
        """In the target's step graph: the hidden rows of each sampling row's
        last 1 + drafts positions (one of them is the last accepted one,
        known after sampling), kept for `propose`. The arrays to evaluate."""
        frontier, offset = [], 0
        self.frontier_at = {}
        for i, (row, state) in enumerate(zip(rows, states)):
            ids = list(row.token_ids)
            drafts = spec.get(state.req_id) or []
            padded = bool(drafts) and all(d < 0 for d in drafts)  # placeholders: plain rows
            real = len(ids) - (len(drafts) if padded else 0)
            d = 0 if padded else len(drafts)
            end = row.num_computed + real
            if d or end >= state.num_tokens:  # it samples
                self.frontier_at[i] = (len(frontier), end - 1 - d)
                frontier.extend(range(offset + real - 1 - d, offset + real))
            offset += len(ids)
        self.frontier = hidden[mx.array(np.asarray(frontier, np.int32))] if frontier else None
        return [self.frontier] if frontier else []

    def forward(self, step: StepAttentionInputs, tokens: mx.array, hidden: mx.array) -> tuple[mx.array, mx.array]:
        """One pass over `step`'s query rows: (d, post_projection(d)), lazy."""
        e = (self.target.embed_tokens(tokens) * self.normalizer).astype(self.dtype)
        x = mx.concatenate([e, hidden.astype(self.dtype)], axis=-1) @ self.pre.T
        kv = self.kv
        kv.step = step
        try:
            for layer, source in zip(self.layers, self.sources):
                x, _, _ = layer(x[None], None, LayerCacheView(kv, source), shared_kv=source)
                x = x[0]
        finally:
            kv.step = None
        d = self.norm(x)
        return d, d @ self.post.T

    def greedy(self, d: mx.array) -> mx.array:
        """Each row's draft (int32): argmax of vLLM's compute_logits, or with centroid masking its
        Gemma4MTPMaskedEmbedder.get_top_tokens (the top-k centroids' tokens only)."""
        if self.centroids is None:
            logits = (d @ self.head.T).astype(mx.float32)
            if self.softcap:
                logits = mx.tanh(logits / self.softcap) * self.softcap
            if self.suppress is not None:
                logits[:, self.suppress] = -mx.inf
            return mx.argmax(logits, axis=-1).astype(mx.int32)
        scores = d @ self.centroids.T
        top = mx.argpartition(-scores, self.top_k - 1, axis=-1)[:, :self.top_k]
        selected = self.clusters[top].reshape(d.shape[0], -1)  # [rows, top_k * vocab / centroids]
        logits = (self.head[selected] @ d[:, :, None])[..., 0]
        best = mx.argmax(logits.astype(mx.float32), axis=-1)
        return mx.take_along_axis(selected, best[:, None], axis=-1)[:, 0].astype(mx.int32)

    def propose(self, rows: np.ndarray, req_ids: Sequence[str], positions: np.ndarray, newest: Sequence[int],
                want: Sequence[int], inputs_for: InputsFor) -> list[list[int]]:
        """For every batch row `rows[i]` whose newest token newest[i] sits at
        positions[i]: up to want[i] drafts, all passes one lazy graph."""
        drafts: list[list[int]] = [[] for _ in rows]
        want = np.asarray(want, np.int64)
        drafting = np.flatnonzero(want > 0)
        if not len(drafting):
            self.frontier, self.frontier_at = None, {}
            return drafts
        rows, positions, want = rows[drafting], positions[drafting], want[drafting]
        at = np.array([self.frontier_at[int(r)][0] + int(p) - 1 - self.frontier_at[int(r)][1]
                       for r, p in zip(rows, positions)], np.int32)
        hidden = self.frontier[mx.array(at)]
        tokens = mx.array(np.asarray([newest[i] for i in drafting], np.int32))
        # The query of every pass: position P - 1, context P (the target's cache through P - 1).
        step = self._step(inputs_for(rows, [[0]] * len(rows), positions - 1))
        passes: list[tuple[np.ndarray, mx.array]] = []
        active = np.arange(len(rows))
        for j in range(int(want.max(initial=0))):
            keep = want[active] > j
            if not keep.all():  # requests whose drafts are done leave the passes
                pick = np.flatnonzero(keep)
                tokens, hidden, active = tokens[mx.array(pick.astype(np.int32))], \
                    hidden[mx.array(pick.astype(np.int32))], active[keep]
                step = self._step(inputs_for(rows[active], [[0]] * len(active), positions[active] - 1))
            d, hidden = self.forward(step, tokens, hidden)
            tokens = self.greedy(d)
            passes.append((active, tokens))
        mx.eval([t for _, t in passes])  # the passes' one evaluation
        self.passes += len(passes)
        self.frontier, self.frontier_at = None, {}
        return collect_drafts(drafts, passes, drafting)

    @staticmethod
    def _step(inputs) -> StepAttentionInputs:
        """The attention inputs of query rows (no cache write: no slot mappings)."""
        return StepAttentionInputs(positions=mx.array(inputs.positions), seq_lens=mx.array(inputs.seq_lens),
                                   cu_seqlens_q=mx.array(inputs.cu_seqlens_q),
                                   block_tables=[mx.array(t) for t in inputs.block_tables], slot_mappings=[])


def _tensors(directory: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def load_assistant(target: LoadedModel, spec_config, dtype: str) -> AssistantDrafter:
    """The assistant of `spec_config` (vLLM's draft_model_config: its config already rewritten to
    gemma4_mtp), its layers over `target`'s cache."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma4_text

    from vllm_metal.formats.model_dir import resolve_model_dir
    from vllm_metal.models import gemma4
    from vllm_metal.models.loaded_model import decoder_owner
    from vllm_metal.models.loader import DTYPES

    draft = spec_config.draft_model_config
    config, name = draft.hf_config, draft.model
    text = text_of(config)
    directory = resolve_model_dir(str(name))
    decoder = decoder_owner(target.model)["model"]
    target_text = spec_config.target_model_config.hf_text_config
    sources = source_layers(target_text, text)
    kinds = layer_kinds(text)
    tensors = _tensors(directory)
    n = text.num_hidden_layers
    wanted = {"pre_projection.weight": (text.hidden_size, 2 * config.backbone_hidden_size),
              "post_projection.weight": (config.backbone_hidden_size, text.hidden_size),
              "model.norm.weight": (text.hidden_size,)}
    head = "model.embed_tokens.weight" if getattr(config, "tie_word_embeddings", True) else "lm_head.weight"
    wanted[head] = (text.vocab_size, text.hidden_size)
    if getattr(config, "use_ordered_embeddings", False):
        wanted["masked_embedding.centroids.weight"] = (config.num_centroids, text.hidden_size)
        wanted["masked_embedding.token_ordering"] = (text.vocab_size,)
    layers = []
    dt = DTYPES[dtype]
    for i in range(n):
        source, kind = sources[i], kinds[i]
        attention = decoder.layers[source].self_attn if source is not None else None
        if not isinstance(attention, gemma4.Attention) or not attention.owns_kv:
            raise ValueError(f"{name}: assistant layer {i} ({kind}) has no target layer of its kind with a cache "
                             f"to read (target layer {source}); the target must be a Gemma 4 model")
        dim, kv_heads = layer_shape(text, i)
        if (dim, kv_heads) != (attention.head_dim, attention.num_kv_heads):
            raise ValueError(f"{name}: assistant layer {i} has heads of {dim} over {kv_heads} KV heads, the "
                             f"target's layer {source} caches {attention.num_kv_heads} KV heads of "
                             f"{attention.head_dim}")
        fields = {**text.to_dict(), "model_type": "gemma4_text", "head_dim": dim, "global_head_dim": dim,
                  "num_key_value_heads": kv_heads, "num_global_key_value_heads": kv_heads, "num_kv_shared_layers": n,
                  "hidden_size_per_layer_input": 0, "enable_moe_block": False, "use_double_wide_mlp": False,
                  "layer_types": kinds}
        block = gemma4_text.DecoderLayer(gemma4_text.ModelArgs.from_dict(fields), i)
        prefix = f"model.layers.{i}."
        weights = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        shapes = dict(tree_flatten(block.parameters()))
        missing = sorted(set(shapes) - set(weights))
        if missing:
            more = " ..." if len(missing) > 4 else ""
            raise ValueError(f"{name}: the assistant's layer {i} lacks {missing[:4]}{more}")
        for k, v in shapes.items():
            if tuple(weights[k].shape) != tuple(v.shape):
                raise ValueError(f"{name}: {prefix}{k} has shape {tuple(weights[k].shape)}, its config says "
                                 f"{tuple(v.shape)}")
        block.load_weights([(k, weights[k].astype(dt)) for k in shapes])
        block.self_attn = gemma4.Attention(block.self_attn, attention.sliding_window)
        layers.append(block)
    for key, shape in wanted.items():
        if key not in tensors:
            raise ValueError(f"{name}: the assistant checkpoint lacks {key}")
        if tuple(tensors[key].shape) != shape:
            raise ValueError(f"{name}: {key} has shape {tuple(tensors[key].shape)}, its config says {shape}")
    weights = {"pre_projection": tensors["pre_projection.weight"].astype(dt),
               "post_projection": tensors["post_projection.weight"].astype(dt),
               "norm": tensors["model.norm.weight"].astype(dt), "head": tensors[head].astype(dt)}
    if getattr(config, "use_ordered_embeddings", False):
        weights["centroids"] = tensors["masked_embedding.centroids.weight"].astype(dt)
        weights["clusters"] = tensors["masked_embedding.token_ordering"].astype(mx.int32).reshape(
            config.num_centroids, -1)
    mx.eval(layers, weights)
    size = sum(v.nbytes for b in layers for _, v in tree_flatten(b.parameters())) + \
        sum(v.nbytes for v in weights.values())
    generation = directory / "generation_config.json"
    suppress = json.loads(generation.read_text()).get("suppress_tokens") or [] if generation.exists() else []
    drafter = AssistantDrafter(layers, sources, target, weights, config, spec_config.num_speculative_tokens,
                               spec_config.target_model_config.max_model_len, suppress, size)
    return drafter
