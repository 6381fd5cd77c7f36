"""One matmul instead of several for projections that read the same input.

Attention's q/k/v projections and a gated MLP's gate/up projections all
multiply the same activations. On MLX's CPU device every product is a BLAS
call (plus its thread wake-ups and an MLX op), so a decode step of a 30-layer
model makes ~210 small ones. `fuse_projections` concatenates each group's
weights at load into one `nn.Linear` (the weights are moved, not copied) and
puts thin views in place of the original attributes. The model's own code is
untouched: mlx-lm's MLP still calls `self.gate_proj(x)` and `self.up_proj(x)`;
the first call computes the fused product for `x`, the sibling's call with
the same `x` takes its columns of it. A module that calls its projections on
different inputs still gets right answers: a view then multiplies by its own
rows of the fused weight (and the group stops fusing).

Each output column is the same dot product as before (the same weights row,
the same input), so results match the unfused model up to the BLAS's
blocking; the golden and parity tests are run with fusion on.

A fused MLP that is proven, by a numerical probe at load, to compute
down(silu(gate) * up) is also wrapped by `SwiGLUMLP`, which runs the
activation through `ops.swiglu` (vllm-metal's vectorised primitive on MLX's
CPU device, where MLX's own sigmoid goes through libm one element at a time).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from vllm_metal import envs
from vllm_metal.native import ops

# (attribute names read from one module, the module's role): the groups fused.
ATTENTION_GROUP = ("q_proj", "k_proj", "v_proj")
MLP_GROUP = ("gate_proj", "up_proj")


class _SharedProduct:
    """The fused product of one group for the latest input, handed out once
    per member, then forgotten (no step's activations outlive it)."""

    def __init__(self, fused: nn.Linear, sizes: list[int]):
        self.fused = fused
        self.offsets = [0]
        for n in sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.separate = False  # a member was called on another input: no fusing
        self._x = None
        self._parts: list[mx.array] | None = None
        self._pending: set[int] = set()

    def part(self, i: int, x: mx.array) -> mx.array:
        if self.separate:
            return self.own_product(i, x)
        if self._x is x and i in self._pending:
            out = self._parts[i]
        else:
            if self._pending:  # a sibling is still waiting for the old input
                self.separate = True
                self._x, self._parts, self._pending = None, None, set()
                return self.own_product(i, x)
            y = self.fused(x)
            self._parts = mx.split(y, self.offsets[1:-1], axis=-1)
            self._x, self._pending = x, set(range(len(self.offsets) - 1))
            out = self._parts[i]
        self._pending.discard(i)
        if not self._pending:
            self._x, self._parts = None, None
        return out

    def own_product(self, i: int, x: mx.array) -> mx.array:
        lo, hi = self.offsets[i], self.offsets[i + 1]
        if type(self.fused) is not nn.Linear:  # wrapped (adapters/lora_sites.py): its call adds the delta
            return self.fused(x)[..., lo:hi]
        weight = self.fused.weight[lo:hi]
        if "bias" in self.fused:
            return mx.addmm(self.fused.bias[lo:hi], x, weight.T)
        return x @ weight.T


class FusedView:
    """Stands where one projection was: callable like it, with its weight
    (and bias) as views of the fused arrays. Not an nn.Module, so the fused
    weights are counted once in the model's parameters."""

    def __init__(self, product: _SharedProduct, index: int):
        self._product = product
        self._index = index

    def __call__(self, x: mx.array) -> mx.array:
        return self._product.part(self._index, x)

    @property
    def weight(self) -> mx.array:
        lo, hi = self._product.offsets[self._index], self._product.offsets[self._index + 1]
        return self._product.fused.weight[lo:hi]

    @property
    def bias(self) -> mx.array | None:
        if "bias" not in self._product.fused:
            return None
        lo, hi = self._product.offsets[self._index], self._product.offsets[self._index + 1]
        return self._product.fused.bias[lo:hi]


def _fusable(members: list) -> bool:
    """Plain float Linears (not quantized, not LoRA) on one input size, with
    a bias on all or none, of one dtype."""
    if not all(type(m) is nn.Linear for m in members):
        return False
    first = members[0]
    return (len({m.weight.shape[1] for m in members}) == 1
            and len({("bias" in m) for m in members}) == 1
            and len({m.weight.dtype for m in members}) == 1
            and first.weight.dtype in (mx.float32, mx.float16, mx.bfloat16))


def fuse_group(owner: nn.Module, names: tuple[str, ...], fused_name: str) -> bool:
    """Replaces owner.<names> by views of one fused Linear stored as
    owner.<fused_name>. Returns whether it did."""
    members = [owner.get(n, None) if isinstance(owner, dict) else None for n in names]
    if any(m is None for m in members) or not _fusable(members):
        return False
    sizes = [m.weight.shape[0] for m in members]
    has_bias = "bias" in members[0]
    fused = nn.Linear(members[0].weight.shape[1], sum(sizes), bias=has_bias)
    fused.weight = mx.concatenate([m.weight for m in members], axis=0)
    if has_bias:
        fused.bias = mx.concatenate([m.bias for m in members], axis=0)
    product = _SharedProduct(fused, sizes)
    for i, n in enumerate(names):
        del owner[n]  # the Linear leaves the module tree (its arrays with it)
        object.__setattr__(owner, n, FusedView(product, i))
    owner[fused_name] = fused
    return True


class SwiGLUMLP(nn.Module):
    """A gated MLP whose gate/up are fused, computing down(silu(gate) * up)
    with the activation in one `ops.swiglu` call. Only built for MLPs the
    probe (`is_swiglu_mlp`) proved compute exactly that."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.split = inner.gate_proj.weight.shape[0]

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.inner.fused_gate_up_proj(x), [self.split], axis=-1)
        return self.inner.down_proj(ops.swiglu(gate, up))


def is_swiglu_mlp(mlp: nn.Module) -> bool:
    """Whether the fused MLP computes down(silu(gate) * up): its own call
    against that formula on random inputs at two scales (large inputs show
    clamps or other activations), within float rounding."""
    if not isinstance(getattr(mlp, "down_proj", None), nn.Linear) or "fused_gate_up_proj" not in mlp:
        return False
    wrapper = SwiGLUMLP(mlp)
    dim = mlp.fused_gate_up_proj.weight.shape[1]
    dtype = mlp.fused_gate_up_proj.weight.dtype
    for scale in (1.0, 30.0):
        x = (scale * mx.random.normal((1, 3, dim), key=mx.random.key(7))).astype(dtype)
        try:
            theirs, ours = mlp(x), wrapper(x)
            same = theirs.shape == ours.shape and mx.allclose(theirs.astype(mx.float32), ours.astype(mx.float32),
                                                             rtol=2e-2 if dtype != mx.float32 else 1e-4,
                                                             atol=1e-3).item()
        except Exception:  # noqa: BLE001 -- whatever it raises, the answer is "not this formula"
            return False
        if not same:
            return False
    return True


def fuse_projections(model: nn.Module, layers: list, attention_class: type) -> dict[str, int]:
    """Fuses q/k/v of every layer whose attention is `attention_class`'s own
    call (the generic paged adapter, which calls the three projections on one
    input) and gate/up of every layer's `mlp`, wrapping the MLPs the probe
    proves are SwiGLU. Returns how many of each."""
    counts = {"qkv": 0, "gate_up": 0, "swiglu": 0}
    for layer in layers:
        attn = layer.get("self_attn", None) if isinstance(layer, dict) else None
        if attn is not None and type(attn).__call__ is attention_class.__call__ \
                and not getattr(attn, "packed_qkv", True):
            counts["qkv"] += fuse_group(attn.inner, ATTENTION_GROUP, "fused_qkv_proj")
        mlp = layer.get("mlp", None) if isinstance(layer, dict) else None
        if isinstance(mlp, nn.Module) and fuse_group(mlp, MLP_GROUP, "fused_gate_up_proj"):
            counts["gate_up"] += 1
            if is_swiglu_mlp(mlp):
                layer.mlp = SwiGLUMLP(mlp)
                counts["swiglu"] += 1
    return counts


def fuse_projections_enabled(device: str) -> bool:
    """VLLM_METAL_FUSE_PROJECTIONS for a model loaded on `device` ("cpu" or
    "gpu"); a value it does not know is refused, not ignored."""
    return envs.cpu_auto_switch("VLLM_METAL_FUSE_PROJECTIONS", device)
