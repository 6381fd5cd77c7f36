"""Images in an engine step, as vLLM's GPU runner handles them
(`_execute_mm_encoder`, `_gather_mm_embeddings`), inside the step's one graph.

- vLLM's scheduler says which images to encode this step
  (`scheduled_encoder_inputs`: it budgets encoder tokens and skips images
  whose embeddings are cached) and which cached ones to drop
  (`free_encoder_mm_hashes`). The tower's output for an image is kept by
  its hash (`identifier`), lazy: it is computed by the step's evaluation
  together with the text model that reads it, and read from the cache by
  later chunks and by other requests with the same image.
- Each row's scheduled tokens that are an image's placeholder take that
  image's embedding rows instead of their token embeddings (a scatter into
  the text model's input embeddings).
- M-RoPE models: every token's three positions (multimodal/mrope.py), the
  prompt's computed once per request, later tokens at index + delta.
- Prefix-LM models (Gemma 3): the image tokens' query rows, grouped by
  image, re-attend to their whole image (models/attention_adapter.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from vllm_metal.models.attention_adapter import ImageSpans
from vllm_metal.multimodal.registry import VisionModel


class MultimodalStep:
    def __init__(self, vision: VisionModel):
        self.vision = vision
        self.cache: dict[str, mx.array] = {}  # image hash -> [tokens, hidden] (lazy until the step evaluates)
        self.encoded = 0  # images run through the tower (tests count encoder-cache hits by it)

    def encode(self, so, requests: dict) -> None:
        """Drops what vLLM freed, runs the tower on the images scheduled now."""
        for h in so.free_encoder_mm_hashes or ():
            self.cache.pop(h, None)
        todo: dict[str, dict] = {}
        for req_id, indices in (so.scheduled_encoder_inputs or {}).items():
            features = requests[req_id].mm_features
            for i in indices:
                f = features[i]
                if f.identifier in self.cache or f.identifier in todo:
                    continue
                if f.data is None:
                    raise RuntimeError(f"request {req_id}: image {i} ({f.identifier}) is neither in the encoder "
                                       "cache nor sent with its data")
                if f.modality != "image":
                    raise NotImplementedError(f"vllm-metal serves image inputs only, not {f.modality!r}")
                todo[f.identifier] = f.data.get_data()
        outputs = self.vision.encode(list(todo.values()))
        for h, out in zip(todo, outputs):
            self.cache[h] = out
        self.encoded += len(todo)

    def prepare(self, states, rows, inputs, embed_tokens) -> None:
        """Sets the step's image inputs on `inputs` (step_inputs.StepInputs):
        `input_embeddings` (lazy [tokens, hidden]) where a scheduled token is
        an image's, `mrope_positions`, `image_spans`. Rows without images
        change nothing (a step without images keeps the text path)."""
        index, parts, spans = [], [], []
        offset = 0
        for row, (state, r) in enumerate(zip(states, rows)):
            start, n = r.num_computed, len(r.token_ids)
            for f in state.mm_features:
                pos = f.mm_position
                lo, hi = max(start - pos.offset, 0), min(start + n - pos.offset, pos.length)
                if f.modality != "image" or lo >= hi:
                    continue
                out = self.cache.get(f.identifier)
                if out is None:
                    raise RuntimeError(f"request {state.req_id}: image {f.identifier} is not in the encoder cache")
                mask = np.ones(pos.length, bool) if pos.is_embed is None else pos.is_embed.numpy().astype(bool)
                before = int(mask[:lo].sum())
                taken = np.nonzero(mask[lo:hi])[0] + lo  # placeholder indices that take embeddings
                if len(taken):
                    index.append(offset + pos.offset - start + taken)
                    parts.append(out[before:before + len(taken)])
                    if self.vision.family.prefix_lm:  # each run of image tokens: one span
                        for run in np.split(taken, np.nonzero(np.diff(taken) > 1)[0] + 1):
                            spans.append((offset + pos.offset - start + run, pos.offset + int(run[-1]) + 1, row))
            offset += n
        if index:
            ids = mx.array(inputs.token_ids)
            embeddings = embed_tokens(ids)
            rows_at = np.concatenate(index).astype(np.int32)
            embeddings[mx.array(rows_at)] = mx.concatenate(parts).astype(embeddings.dtype)
            inputs.input_embeddings = embeddings
        if spans:
            inputs.image_spans = _spans(spans)
        # every token of a request with images sits at its M-RoPE position (past
        # an image: index + delta), whether or not this step holds image tokens
        if self.vision.mrope is not None and any(s.mm_features for s in states):
            inputs.mrope_positions = self._mrope_positions(states, rows)

    def _mrope_positions(self, states, rows) -> np.ndarray:
        """int32 [3, tokens]: every scheduled token's three positions."""
        out = []
        for state, r in zip(states, rows):
            if state.mrope is None:
                images = [(f.mm_position.offset, _grid(f)) for f in state.mm_features if f.modality == "image"]
                state.mrope = self.vision.mrope.positions(len(state.prompt_token_ids), images) if images else \
                    (None, 0)
            prompt, delta = state.mrope
            pos = np.arange(r.num_computed, r.num_computed + len(r.token_ids))
            p = np.broadcast_to(pos + delta, (3, len(pos))).copy()
            if prompt is not None:
                inside = pos < prompt.shape[1]
                p[:, inside] = prompt[:, pos[inside]]
            out.append(p)
        return np.concatenate(out, axis=1).astype(np.int32)


def _grid(feature) -> tuple[int, int, int]:
    if feature.data is None or "image_grid_thw" not in feature.data:
        raise RuntimeError(f"image {feature.identifier} arrived without its image_grid_thw (M-RoPE needs it)")
    g = feature.data["image_grid_thw"].data
    return tuple(int(x) for x in np.asarray(g).reshape(-1))


def _spans(spans) -> ImageSpans:
    """(packed rows, the image's end position + 1, table row) per image -> ImageSpans."""
    rows = np.concatenate([s[0] for s in spans]).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum([len(s[0]) for s in spans])]).astype(np.int32)
    return ImageSpans(rows=mx.array(rows), cu_seqlens=mx.array(cu),
                      seq_lens=mx.array(np.array([s[1] for s in spans], np.int32)),
                      table_rows=mx.array(np.array([s[2] for s in spans], np.int32)))
