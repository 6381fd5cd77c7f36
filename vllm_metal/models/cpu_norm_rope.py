"""RMSNorm and RoPE through vllm-metal's primitives on MLX's CPU device.

On MLX's CPU device `mx.fast.rms_norm` and `mx.fast.rope` are not kernels:
each call returns its fallback composition (about 15 and 30 operations; RoPE
computes its angles' cos and sin through libm on every call). A llama layer
calls them four times (two norms, RoPE of q and of k), so a 30-layer decode
step dispatched ~2,700 small operations for them alone. `use_cpu_norm_rope`
swaps them at load, on the CPU device only (on Metal both are fused kernels):

- every `nn.RMSNorm` (that class exactly: families with their own norm
  formula keep it) becomes `PrimitiveRMSNorm`, the same weight and eps
  through `ops.rms_norm`;
- each paged attention layer whose RoPE module a load-time probe proves to be
  a per-pair rotation gets a `RopePlan`: per step, the module itself is
  applied once to a probe vector at the step's positions, which yields every
  token's (cos, sin) pairs with the module's own frequencies and scaling
  (llama3, yarn, longrope...), and `ops.rope` rotates q and k of every layer
  that shares the plan's key with that one table. A module the probe cannot
  reproduce keeps being called as before. Such a layer also rotates its q
  and k and writes its K/V cache rows in one primitive, `ops.rope_write_kv`
  (VLLM_METAL_FUSED_KV_WRITE), where its cache allows (attention_adapter.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vllm_metal import envs
from vllm_metal.native import ops

# Positions the load-time proof checks (distinct, up to a long context).
PROOF_POSITIONS = [0, 1, 5, 17, 250, 1000, 4095]


class PrimitiveRMSNorm(nn.Module):
    """nn.RMSNorm's parameters and formula through ops.rms_norm."""

    def __init__(self, norm: nn.RMSNorm):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype != self.weight.dtype:  # mixed dtypes: MLX's own promotion rules
            return mx.fast.rms_norm(x, self.weight, self.eps)
        return ops.rms_norm(x, self.weight, self.eps)


@dataclass(frozen=True)
class RopePlan:
    """How a RoPE module's rotation is reproduced from a per-step table."""

    traditional: bool  # pairs (2i, 2i + 1), else (i, i + rotated / 2)
    rotated: int  # leading dims rotated
    head_dim: int
    key: str  # layers whose plans share a key share one table per step

    def probe(self, tokens: int) -> mx.array:
        """[tokens, 1, 1, head_dim]: 1 on each pair's first element, else 0.
        A rotation by (c, s) turns it into c on the first element and s on
        the second (times whatever scale the module applies)."""
        v = np.zeros(self.head_dim, np.float32)
        if self.traditional:
            v[0:self.rotated:2] = 1
        else:
            v[:self.rotated // 2] = 1
        return mx.array(v).reshape(1, 1, 1, -1) * mx.ones((tokens, 1, 1, 1), mx.float32)

    def table(self, rope, positions: mx.array) -> mx.array:
        """float32 [tokens, rotated / 2, 2]: the module's (cos, sin) pairs at `positions`."""
        tokens, half = positions.shape[0], self.rotated // 2
        out = rope(self.probe(tokens), offset=positions)[:, 0, 0, :].astype(mx.float32)
        if self.traditional:
            return out[:, :self.rotated].reshape(tokens, half, 2)
        return mx.stack([out[:, :half], out[:, half:self.rotated]], axis=-1)


def plan_rope(rope, head_dim: int) -> RopePlan | None:
    """The plan that reproduces `rope` (called as mlx-lm does, with one offset
    per token) within float32 rounding on random inputs, or None."""
    positions = mx.array(PROOF_POSITIONS, dtype=mx.int32)
    x = mx.random.normal((len(PROOF_POSITIONS), 3, 1, head_dim), key=mx.random.key(11))
    try:
        want = rope(x, offset=positions)[:, :, 0, :].astype(mx.float32)
        mx.eval(want)
    except Exception:  # noqa: BLE001 -- whatever it raises, the answer is "no plan"
        return None
    dims = getattr(rope, "dims", head_dim)
    rotated = dims if isinstance(dims, int) and 0 < dims <= head_dim and dims % 2 == 0 else head_dim
    first = bool(getattr(rope, "traditional", False))
    for traditional in (first, not first):
        plan = RopePlan(traditional, rotated, head_dim, key="")
        try:
            table = plan.table(rope, positions)
            got = ops.rope(x[:, :, 0, :], table, traditional=traditional)
            same = mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()
        except Exception:  # noqa: BLE001
            continue
        if same:
            digest = hashlib.sha256(np.array(table).tobytes()).hexdigest()[:16]
            key = f"{type(rope).__name__}:{'traditional' if traditional else 'half'}:{rotated}:{digest}"
            return RopePlan(traditional, rotated, head_dim, key=key)
    return None


def use_cpu_norm_rope(model: nn.Module, layers: list, attention_class: type) -> dict[str, int]:
    """Swaps the model's nn.RMSNorm modules and plans its attention layers'
    RoPE (see the module docstring). Returns {"rms_norm": modules swapped,
    "rope": layers planned, "rope_tables": distinct tables per step}."""
    counts = {"rms_norm": 0, "rope": 0}
    _swap_norms(model, counts)
    plans: dict[int, RopePlan | None] = {}
    keys = set()
    for layer in layers:
        attn = layer.get("self_attn", None) if isinstance(layer, dict) else None
        if not isinstance(attn, attention_class) or attn.rope() is None:
            continue
        rope = attn.rope()
        if id(rope) not in plans:
            plans[id(rope)] = plan_rope(rope, attn.rope_dims)
        attn.rope_plan = plans[id(rope)]
        attn.fused_write = envs.get_bool("VLLM_METAL_FUSED_KV_WRITE")
        if attn.rope_plan is not None:
            counts["rope"] += 1
            keys.add(attn.rope_plan.key)
    counts["rope_tables"] = len(keys)
    return counts


def _swap_norms(module: nn.Module, counts: dict) -> None:
    for name, child in module.children().items():
        for key, sub in _entries(child):
            if type(sub) is nn.RMSNorm:
                replacement = PrimitiveRMSNorm(sub)
                if key is None:
                    module[name] = replacement
                else:
                    child[key] = replacement
                counts["rms_norm"] += 1
            elif isinstance(sub, nn.Module):
                _swap_norms(sub, counts)


def _entries(child):
    """(key, module) pairs of a child that is a module, a list or a dict of them."""
    if isinstance(child, nn.Module):
        return [(None, child)]
    if isinstance(child, list):
        return list(enumerate(child))
    if isinstance(child, dict):
        return list(child.items())
    return []


def cpu_norm_rope_enabled(device: str) -> bool:
    """VLLM_METAL_CPU_NORM_ROPE for a model loaded on `device` ("cpu" or
    "gpu"); a value it does not know is refused, not ignored."""
    return envs.cpu_auto_switch("VLLM_METAL_CPU_NORM_ROPE", device)
