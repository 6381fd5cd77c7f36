"""Qwen2.5-VL's vision tower in MLX: patches (the processor's flattened
2x14x14x3 blocks) through a linear patch embedding, RMSNorm blocks with 2-D
rotary attention -- windowed (window_size pixels, in 2x2 merge units) except
the `fullatt_block_indexes` blocks, which see the whole image -- a SwiGLU
MLP, then the 2x2 patch merger into the text model's hidden size.

Its images' text positions are M-RoPE's (multimodal/mrope.py): sections of
the rotary frequencies take the temporal, height and width index.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from vllm_metal.multimodal import vit
from vllm_metal.native import ops


def patch_positions(t: int, h: int, w: int, merge: int) -> np.ndarray:
    """int [t*h*w, 2]: each patch's (row, column) in the processor's order
    (merge x merge blocks, block-major), repeated per frame."""
    hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    hpos = hpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    wpos = wpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    return np.tile(np.stack([hpos, wpos], axis=-1), (t, 1))


def window_index(grids: list[tuple[int, int, int]], merge: int, window: int, patch: int) -> tuple[np.ndarray, np.ndarray]:
    """(merge units reordered window by window, cumulative window lengths in
    patches) for the packed images, as Qwen2.5-VL windows them."""
    units, cu, base = [], [0], 0
    side = window // merge // patch  # merge units per window side
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = np.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = side - gh % side, side - gw % side
        padded = np.pad(index, ((0, 0), (0, ph), (0, pw)), constant_values=-1)
        nh, nw = (gh + ph) // side, (gw + pw) // side
        padded = padded.reshape(t, nh, side, nw, side).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, side * side)
        for win in padded.reshape(-1, side * side):
            kept = win[win >= 0]
            if len(kept):
                units.append(kept + base)
                cu.append(cu[-1] + len(kept) * merge * merge)
        base += t * gh * gw
    return np.concatenate(units), np.array(cu, np.int64)


class QwenViT:
    """What Qwen2.5-VL's and Qwen3.5's towers share: the vision config, the
    patch embedding (Conv3d with kernel = stride: a linear on the processor's
    flattened patches), 2-D rotary angles per patch (rows then columns over
    head_dim / 2), attention over packed segments, the merger's token count."""

    name = "Qwen-VL"

    def __init__(self, config: dict, weights: dict[str, mx.array], dtype: mx.Dtype, defaults: dict):
        v = config["vision_config"]
        self.vision_config = v
        self.dtype, self.w = dtype, weights
        self.hidden = int(v.get("hidden_size", defaults["hidden_size"]))
        self.heads = int(v.get("num_heads", 16))
        self.head_dim = self.hidden // self.heads
        self.depth = int(v.get("depth", defaults["depth"]))
        self.patch = int(v.get("patch_size", defaults["patch_size"]))
        self.temporal = int(v.get("temporal_patch_size", 2))
        self.channels = int(v.get("in_channels", v.get("in_chans", 3)))
        self.merge = int(v.get("spatial_merge_size", 2))
        self.out_hidden = int(v.get("out_hidden_size", 3584))
        theta = (v.get("rope_parameters") or {}).get("rope_theta", v.get("rope_theta", 10000.0))
        spatial = self.head_dim // 2
        self.inv_freq = 1.0 / (float(theta) ** (np.arange(0, spatial, 2, dtype=np.float64) / spatial))
        in_dim = self.channels * self.temporal * self.patch * self.patch
        self.patch_w = vit.take(weights, "patch_embed.proj.weight").reshape(self.hidden, -1)
        if self.patch_w.shape[1] != in_dim:
            raise ValueError(f"{self.name} patch embedding takes {self.patch_w.shape[1]} values per patch, "
                             f"the config says {in_dim}")
        for i in range(self.depth):
            vit.take(weights, f"blocks.{i}.attn.qkv.weight", (3 * self.hidden, self.hidden))

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Text-model tokens one image of patch grid (t, h, w) becomes."""
        t, h, w = grid
        return t * h * w // (self.merge ** 2)

    def _embed(self, pixel_values: np.ndarray, grids) -> tuple[list[tuple[int, int, int]], mx.array, np.ndarray]:
        """(grids as ints, patch embeddings [n, hidden], each patch's (row, column) [n, 2])."""
        grids = [tuple(int(x) for x in g) for g in grids]
        n = sum(t * h * wd for t, h, wd in grids)
        if pixel_values.shape[0] != n:
            raise ValueError(f"{pixel_values.shape[0]} patches for image grids {grids} ({n} patches)")
        bias = self.w.get("patch_embed.proj.bias")
        x = vit.linear(mx.array(pixel_values).astype(self.dtype), self.patch_w.astype(self.dtype),
                       None if bias is None else bias.astype(self.dtype))
        return grids, x, np.concatenate([patch_positions(*g, self.merge) for g in grids])

    def _angles(self, pos: np.ndarray) -> np.ndarray:
        """[n, head_dim / 2]: each patch's rotary angles, its row's then its column's."""
        return (pos[:, :, None] * self.inv_freq[None, None, :]).reshape(len(pos), -1)

    def _split(self, merged: mx.array, grids) -> list[mx.array]:
        sizes = np.cumsum([self.tokens(g) for g in grids])[:-1].tolist()
        return mx.split(merged, sizes) if sizes else [merged]

    def _attention(self, x: mx.array, p: str, table: mx.array, cu: vit.EncoderBatch) -> mx.array:
        w = self.w
        n = x.shape[0]
        qkv = vit.linear(x, w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"]).reshape(n, 3, self.heads, self.head_dim)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q, k = vit.rotate(q, table).astype(x.dtype), vit.rotate(k, table).astype(x.dtype)
        out = vit.segment_attention(q, k, v, cu, self.head_dim ** -0.5)
        return vit.linear(out.reshape(n, self.hidden), w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])


def frames(grids) -> np.ndarray:
    """Cumulative patch counts of every frame of every image (full-attention segments)."""
    return np.concatenate([[0], np.cumsum([h * w for t, h, w in grids for _ in range(t)])])


class Qwen25VisionTower(QwenViT):
    """The tower and merger of a Qwen2.5-VL checkpoint (tensors under `visual.`)."""

    name = "Qwen2.5-VL"

    def __init__(self, config: dict, weights: dict[str, mx.array], dtype: mx.Dtype):
        super().__init__(config, weights, dtype, {"hidden_size": 1280, "depth": 32, "patch_size": 14})
        v = self.vision_config
        self.window = int(v.get("window_size", 112))
        self.full_blocks = set(int(i) for i in v.get("fullatt_block_indexes", [7, 15, 23, 31]))
        act = v.get("hidden_act", "silu")
        if act not in ("silu", "quick_gelu", "gelu"):
            raise NotImplementedError(f"Qwen2.5-VL vision tower: hidden_act {act!r} is not served")
        self.act = act
        vit.take(weights, "merger.mlp.2.weight", (self.out_hidden, self.hidden * self.merge ** 2))

    def __call__(self, pixel_values: np.ndarray, grids: list[tuple[int, int, int]]) -> list[mx.array]:
        """Packed patches of several images [sum t*h*w, 3*2*14*14] -> one
        [tokens, out_hidden] array per image (lazy)."""
        w = self.w
        grids, x, pos = self._embed(pixel_values, grids)
        unit = self.merge ** 2
        order_units, cu_windows = window_index(grids, self.merge, self.window, self.patch)
        order = (order_units[:, None] * unit + np.arange(unit)[None, :]).reshape(-1)
        table = vit.rotary_table(self._angles(pos)[order])
        cu_images, cu_windows = vit.segments(frames(grids)), vit.segments(cu_windows)
        x = x[mx.array(order.astype(np.int32))]
        for i in range(self.depth):
            p = f"blocks.{i}."
            x = x + self._attention(vit.rms_norm(x, w[p + "norm1.weight"], 1e-6), p, table,
                                    cu_images if i in self.full_blocks else cu_windows)
            h = vit.rms_norm(x, w[p + "norm2.weight"], 1e-6)
            gate = vit.linear(h, w[p + "mlp.gate_proj.weight"], w.get(p + "mlp.gate_proj.bias"))
            up = vit.linear(h, w[p + "mlp.up_proj.weight"], w.get(p + "mlp.up_proj.bias"))
            x = x + vit.linear(self._gated(gate, up), w[p + "mlp.down_proj.weight"], w.get(p + "mlp.down_proj.bias"))
        m = vit.rms_norm(x, w["merger.ln_q.weight"], 1e-6).reshape(-1, self.hidden * unit)
        m = vit.linear(vit.gelu(vit.linear(m, w["merger.mlp.0.weight"], w["merger.mlp.0.bias"]), False),
                       w["merger.mlp.2.weight"], w["merger.mlp.2.bias"])
        return self._split(m[mx.array(np.argsort(order_units).astype(np.int32))], grids)

    def _gated(self, gate: mx.array, up: mx.array) -> mx.array:
        """act(gate) * up; SiLU (the released checkpoints') through the SwiGLU primitive."""
        if self.act == "silu":
            return ops.swiglu(gate, up)
        if self.act == "quick_gelu":
            return gate * mx.sigmoid(1.702 * gate) * up
        return vit.gelu(gate, False) * up
