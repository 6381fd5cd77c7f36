"""What the vision towers share: packed bidirectional attention over
segments (images, or windows of one), 2-D rotary tables, the tower's
tensors read out of a checkpoint's safetensors.

Every tower runs on a step's images packed as one sequence of patches
([patches, hidden]); attention never crosses a segment boundary: one call per
layer of the paged-attention primitive's non-causal mode (the encoders'
path, models/bert.py) over 16-token blocks of each segment, however many
windows an image has.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_metal.native import ops

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from vllm_metal.models.bert import EncoderBatch, attention  # noqa: E402


def segments(cu: np.ndarray) -> EncoderBatch:
    """Packed segments cu[i] .. cu[i + 1] - 1 (images, or windows of one) as
    the paged-attention primitive's non-causal batch (models/bert.py's
    EncoderBatch: keys and values laid out in 16-token blocks per segment)."""
    cu = np.asarray(cu, np.int64)
    if cu[0] != 0 or (np.diff(cu) <= 0).any():
        raise ValueError(f"segments {cu.tolist()} are not a partition of the tokens")
    return EncoderBatch(cu)


def segment_attention(q: mx.array, k: mx.array, v: mx.array, batch: EncoderBatch, scale: float) -> mx.array:
    """q, k, v [tokens, heads, dim]; every token attends to every token of
    its segment (`segments(cu)`) and nothing else, through the
    paged-attention primitive (both backends; on MLX's CPU device its
    vectorized float32 softmax). Lazy [tokens, heads, dim]."""
    if q.shape[0] != batch.num_tokens:
        raise ValueError(f"{q.shape[0]} tokens for segments of {batch.num_tokens}")
    out = attention(q, batch.cache(k), batch.cache(v), batch, scale)
    return out.reshape(q.shape)


def rotary_table(angles: np.ndarray) -> mx.array:
    """float32 [tokens, half] angles -> the (cos, sin) table ops.rope takes
    ([tokens, half, 2]), rotating pairs (i, i + half) ("rotate half")."""
    a = np.asarray(angles, np.float64)
    return mx.array(np.stack([np.cos(a), np.sin(a)], axis=-1).astype(np.float32))


def rotate(x: mx.array, table: mx.array) -> mx.array:
    """x [tokens, heads, dim] rotated by `table` (rotary_table), in float32."""
    return ops.rope(x.astype(mx.float32), table, traditional=False)


def linear(x: mx.array, w: mx.array, b: mx.array | None = None) -> mx.array:
    """x @ w.T (+ b): a checkpoint's nn.Linear ([out, in] weight)."""
    y = x @ w.T
    return y + b if b is not None else y


def rms_norm(x: mx.array, w: mx.array, eps: float, offset: float = 0.0) -> mx.array:
    """RMSNorm, times (offset + w) (Gemma's norms store w - 1): the RMSNorm
    primitive (float32 inside), or in float32 from MLX ops with an offset."""
    if offset == 0.0:
        return ops.rms_norm(x, w.astype(x.dtype), eps)
    x32 = x.astype(mx.float32)
    y = x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (offset + w.astype(mx.float32))).astype(x.dtype)


def layer_norm(x: mx.array, w: mx.array, b: mx.array, eps: float) -> mx.array:
    return ops.layer_norm(x, w.astype(x.dtype), b.astype(x.dtype), eps)


def gelu(x: mx.array, approximate: bool) -> mx.array:
    return ops.gelu(x, approximate=approximate)


def tensor_names(model_dir: str | Path) -> set[str]:
    """Every tensor name in the checkpoint's safetensors files (headers
    only: nothing is loaded); empty for a directory without them (a GGUF)."""
    names: set[str] = set()
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return names
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            if size <= 0 or size > 1 << 28:
                raise ValueError(f"{f}: not a safetensors file (header size {size})")
            names.update(k for k in json.loads(fh.read(size)) if k != "__metadata__")
    return names


def read_tensors(model_dir: str | Path, prefixes: tuple[str, ...], dtype: mx.Dtype) -> dict[str, mx.array]:
    """Every tensor of the checkpoint whose name starts with one of
    `prefixes` (tried in order, first that matches any tensor wins), with
    that prefix removed, cast to `dtype`. Both layouts transformers writes
    are read: `visual.` / `vision_tower.` at the top (checkpoints saved before
    transformers 5) and under `model.` (transformers 5)."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    if not files:
        raise FileNotFoundError(f"{model_dir}: no safetensors files hold the vision tower's weights")
    found: dict[str, mx.array] = {}
    for prefix in prefixes:
        for f in files:
            for name, value in mx.load(str(f)).items():
                if name.startswith(prefix):
                    found[name[len(prefix):]] = value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) \
                        else value
        if found:
            return found
    raise KeyError(f"{model_dir}: no tensor named {' or '.join(p + '*' for p in prefixes)} (the vision tower)")


def take(weights: dict[str, mx.array], name: str, shape: tuple[int, ...] | None = None) -> mx.array:
    """weights[name], refused by name when missing or of another shape."""
    w = weights.get(name)
    if w is None:
        raise KeyError(f"the vision tower's tensor {name!r} is missing from the checkpoint")
    if shape is not None and tuple(w.shape) != tuple(shape):
        raise ValueError(f"the vision tower's tensor {name!r} has shape {tuple(w.shape)}, expected {tuple(shape)}")
    return w
