"""Tensor parallelism: each rank of a stage holds 1/T of every layer's heads
and MLP columns, with mlx-lm's own `shard()`.

mlx-lm's model classes that support tensor parallelism (llama, qwen2/3,
ministral3, deepseek, ... -- those with a `shard(group)` method) split
their projections with mlx.nn's shard_linear: q/k/v and gate/up
"all-to-sharded" (each rank's rows), o_proj and down_proj "sharded-to-all"
(each rank's columns, then a sum over the group). That is their code and
their split. We then turn the resulting layers into inference modules: an
all-to-sharded layer is, in a forward pass, a plain Linear over its rows
(so the fused q/k/v and gate/up projections of models/fused_projections.py
still apply), and a sharded-to-all layer becomes RowParallel: the local
product, then `reduce` -- MLX's all_sum over the ranks, a node of the step's
graph -- then the bias once. The per-rank KV cache holds this rank's KV
heads only (the attention adapter reads the sharded head counts).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (AllToShardedLinear, QuantizedAllToShardedLinear,
                                       QuantizedShardedToAllLinear, ShardedToAllLinear)


class _Shape:
    """What mlx-lm's shard() and shard_linear read of a group: its size and
    this rank's index (the slicing); the sum itself is RowParallel's."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class RowParallel(nn.Module):
    """A sharded-to-all projection: this rank's columns of the product,
    summed over the TP group, plus the bias once."""

    def __init__(self, inner: nn.Module, bias: mx.array | None, reduce):
        super().__init__()
        self.inner = inner
        if bias is not None:
            self.bias = bias
        object.__setattr__(self, "_reduce", reduce)

    def __call__(self, x: mx.array) -> mx.array:
        y = object.__getattribute__(self, "_reduce")(self.inner(x))
        return y + self["bias"] if "bias" in self else y


def _plain(layer: nn.Module, with_bias: bool) -> nn.Module:
    """The Linear / QuantizedLinear computing what `layer` does locally."""
    if isinstance(layer, (QuantizedAllToShardedLinear, QuantizedShardedToAllLinear)):
        out_dims, packed = layer.weight.shape
        plain = nn.QuantizedLinear(packed * 32 // layer.bits, out_dims, bias=with_bias, group_size=layer.group_size,
                                   bits=layer.bits, mode=getattr(layer, "mode", "affine"))
        params = {k: v for k, v in layer.parameters().items() if k in ("weight", "scales", "biases")}
    else:
        out_dims, in_dims = layer.weight.shape
        plain = nn.Linear(in_dims, out_dims, bias=with_bias)
        params = {"weight": layer.weight}
    if with_bias:
        params["bias"] = layer["bias"]
    plain.update(params)
    return plain


def _convert(layer, reduce):
    if isinstance(layer, (AllToShardedLinear, QuantizedAllToShardedLinear)):
        return _plain(layer, "bias" in layer)
    if isinstance(layer, (ShardedToAllLinear, QuantizedShardedToAllLinear)):
        return RowParallel(_plain(layer, False), layer["bias"] if "bias" in layer else None, reduce)
    return None


def _replace_sharded(module: nn.Module, reduce) -> int:
    done = 0
    for key, child in list(module.children().items()):
        items = child if isinstance(child, list) else [child]
        for i, item in enumerate(items):
            if not isinstance(item, nn.Module):
                continue
            new = _convert(item, reduce)
            if new is None:
                done += _replace_sharded(item, reduce)
                continue
            done += 1
            if isinstance(child, list):
                child[i] = new
            else:
                module[key] = new
    return done


def shard_model(model: nn.Module, config: dict, tp_rank: int, tp: int, reduce) -> int:
    """Shards `model` in place for rank `tp_rank` of `tp` with mlx-lm's own
    shard(); `reduce` sums a [.., hidden] array over the TP group. Returns
    how many projections were split. A family without shard(), or head /
    MLP sizes tp does not divide, is refused with the reason."""
    model_type = config.get("model_type")
    shard = getattr(model, "shard", None)
    if shard is None:
        raise NotImplementedError(f"tensor parallel: mlx-lm's model for {model_type!r} has no shard() "
                                  "(its layers have no tensor-parallel split); use pipeline parallel "
                                  "(--pipeline-parallel-size) for this model")
    text = config.get("text_config") or config
    sizes = {"attention heads": text.get("num_attention_heads"),
             "KV heads": text.get("num_key_value_heads") or text.get("num_attention_heads"),
             "MLP width": text.get("intermediate_size")}
    bad = {k: v for k, v in sizes.items() if isinstance(v, int) and v % tp}
    if bad:
        raise ValueError(f"tensor parallel size {tp} does not divide {model_type!r}'s "
                         + ", ".join(f"{k} ({v})" for k, v in bad.items())
                         + f"; use a tensor parallel size dividing them, or pipeline parallel")
    try:
        shard(_Shape(tp_rank, tp))
    except ValueError as e:  # shard_linear: a size that does not split
        raise ValueError(f"tensor parallel size {tp} cannot split {model_type!r}: {e}") from e
    done = _replace_sharded(model, reduce)
    left = [name for name, module in model.named_modules()
            if any(isinstance(v, _Shape) for v in vars(module).values())]
    if left:
        # mlx-lm's shard() also split layers that sum over the group in their
        # own code (MoE experts' sharding_group, ...): not served.
        raise NotImplementedError(f"tensor parallel: {model_type!r} has layers mlx-lm shards with their own "
                                  f"collectives ({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}), which "
                                  "vllm-metal does not run; use pipeline parallel for this model")
    if not done:
        raise NotImplementedError(f"tensor parallel: mlx-lm's shard() split nothing in {model_type!r}")
    return done


def all_sum_reduce(group):
    """The TP sum over the whole MLX group (pure tensor parallel: the group
    is the TP group). MLX's ring sums each segment once and copies it to
    every rank, so all ranks get the same bits (and sample alike)."""
    def reduce(x: mx.array) -> mx.array:
        return mx.distributed.all_sum(x, group=group)
    return reduce
