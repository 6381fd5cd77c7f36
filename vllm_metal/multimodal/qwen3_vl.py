"""Qwen3.5's vision tower (Qwen3-VL style) in MLX: patches (the processor's
flattened 3x2x16x16 blocks) through the Conv3d patch embedding (a linear with
bias), plus learned position embeddings -- a num_grid_per_side^2 table
resampled bilinearly (align_corners) to each image's patch grid -- then
LayerNorm blocks with 2-D rotary attention over each whole frame (no
windows) and a GELU MLP, then the 2x2 patch merger (LayerNorm, MLP) into
the text model's hidden size.

Qwen3.5 has no deepstack: its vision model drops Qwen3-VL's
`deepstack_visual_indexes` / `deepstack_merger_list`, the merger's output is
all the text model takes (at its image placeholder tokens). A checkpoint
that asks for deepstack (Qwen3-VL's) is refused.

Its images' text positions are M-RoPE's (multimodal/mrope.py), with the
temporal, height and width indices interleaved over the rotary frequencies
(`mrope_interleaved`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from vllm_metal.multimodal import vit
from vllm_metal.multimodal.qwen2_5_vl import QwenViT, frames

ACTS = {"gelu_pytorch_tanh": True, "gelu_new": True, "gelu": False}  # hidden_act -> tanh approximation


def position_taps(row: np.ndarray, col: np.ndarray, h: int, w: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices [n, 4] into the flattened side x side position table,
    weights [n, 4] float32): the patches at (row, col) of an h x w grid
    sampled bilinearly from the table with align_corners=True, as
    transformers' `get_vision_interpolation_indices_and_weights` does."""

    def axis(index, size):  # taps (floor, floor + 1) clamped to the table, hat weights
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(src)
        taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
        weights = np.maximum(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2)), 0).astype(np.float32)
        return taps, weights

    ht, hw = axis(row, h)
    wt, ww = axis(col, w)
    return (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4), (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)


class Qwen3VisionTower(QwenViT):
    """The tower and merger of a Qwen3.5 checkpoint (tensors under
    `model.visual.` or `visual.`, the prefix removed)."""

    name = "Qwen3.5"

    def __init__(self, config: dict, weights: dict[str, mx.array], dtype: mx.Dtype):
        super().__init__(config, weights, dtype, {"hidden_size": 1152, "depth": 27, "patch_size": 16})
        v = self.vision_config
        self.side = int(int(v.get("num_position_embeddings", 2304)) ** 0.5)
        if v.get("deepstack_visual_indexes") or any(k.startswith("deepstack_merger_list.") for k in weights):
            raise NotImplementedError("Qwen3-VL's deepstack visual features are not served (Qwen3.5 has none)")
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ACTS:
            raise NotImplementedError(f"Qwen3.5 vision tower: hidden_act {act!r} is not served")
        self.approximate = ACTS[act]
        vit.take(weights, "patch_embed.proj.bias", (self.hidden,))
        vit.take(weights, "pos_embed.weight", (self.side * self.side, self.hidden))
        vit.take(weights, "merger.norm.weight", (self.hidden,))
        vit.take(weights, "merger.linear_fc2.weight", (self.out_hidden, self.hidden * self.merge ** 2))

    def __call__(self, pixel_values: np.ndarray, grids: list[tuple[int, int, int]]) -> list[mx.array]:
        """Packed patches of several images [sum t*h*w, 3*2*16*16] (in the
        processor's merge-block order) -> one [tokens, out_hidden] array per
        image (lazy)."""
        w = self.w
        grids, x, pos = self._embed(pixel_values, grids)
        starts = np.cumsum([0] + [t * h * wd for t, h, wd in grids])
        taps = [position_taps(pos[a:b, 0], pos[a:b, 1], g[1], g[2], self.side)
                for a, b, g in zip(starts[:-1], starts[1:], grids)]
        index = mx.array(np.concatenate([t[0] for t in taps]).astype(np.int32))
        weight = mx.array(np.concatenate([t[1] for t in taps]))
        table = w["pos_embed.weight"].astype(mx.float32)
        x = x + (table[index] * weight[:, :, None]).sum(axis=1).astype(x.dtype)
        rotary = vit.rotary_table(self._angles(pos))
        cu = vit.segments(frames(grids))  # one segment per frame
        for i in range(self.depth):
            p = f"blocks.{i}."
            x = x + self._attention(vit.layer_norm(x, w[p + "norm1.weight"], w[p + "norm1.bias"], 1e-6), p, rotary, cu)
            h = vit.layer_norm(x, w[p + "norm2.weight"], w[p + "norm2.bias"], 1e-6)
            h = vit.gelu(vit.linear(h, w[p + "mlp.linear_fc1.weight"], w[p + "mlp.linear_fc1.bias"]), self.approximate)
            x = x + vit.linear(h, w[p + "mlp.linear_fc2.weight"], w[p + "mlp.linear_fc2.bias"])
        m = vit.layer_norm(x, w["merger.norm.weight"], w["merger.norm.bias"], 1e-6)
        m = m.reshape(-1, self.hidden * self.merge ** 2)
        m = vit.linear(vit.gelu(vit.linear(m, w["merger.linear_fc1.weight"], w["merger.linear_fc1.bias"]), False),
                       w["merger.linear_fc2.weight"], w["merger.linear_fc2.bias"])
        return self._split(m, grids)
