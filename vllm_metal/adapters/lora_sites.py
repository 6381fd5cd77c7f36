"""The projections of a loaded model that an adapter can target, each with a
LoRA-aware wrapper in place.

A *site* is one Linear the model really calls: a plain projection, or a fused
one (models/fused_projections.py: q/k/v in one matmul, gate/up in one). A
*target* is what an adapter names (`self_attn.k_proj` of layer 3) and where
its output lands: a site and the columns of it (k's columns of the fused
q/k/v product). The wrapper (LoRALinear) computes the base projection, then
asks the pool (pool.py) for the step's delta of its site, so the adapters of
every row are added inside the model's own code, in the step's one graph,
whatever module calls the projection.

Only projections the model's code calls are targets: the runner's warm-up
step runs with tracing on and `seal` drops every site no call reached, so an
adapter naming one is refused instead of being silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from vllm_metal.models.fused_projections import ATTENTION_GROUP, MLP_GROUP
from vllm_metal.models.loaded_model import decoder_owner

FUSED = {"fused_qkv_proj": ATTENTION_GROUP, "fused_gate_up_proj": MLP_GROUP}
WRAPPER_CHILD = "inner"  # the attribute vllm-metal's wrappers keep the mlx-lm module under


@dataclass(frozen=True)
class Site:
    index: int
    layer: int
    name: str  # the called module inside its layer ("self_attn.fused_qkv_proj")
    in_dims: int
    out_dims: int


@dataclass(frozen=True)
class Target:
    site: int
    lo: int  # its columns of the site's output
    hi: int


class LoRALinear(nn.Module):
    """Stands where a projection was: its output plus the step's delta for
    this site (none when no row's adapter targets it)."""

    def __init__(self, base: nn.Module, site: int, pool):
        super().__init__()
        self.base = base
        object.__setattr__(self, "_site", site)  # not children: outside the parameter tree
        object.__setattr__(self, "_pool", pool)

    @property
    def weight(self) -> mx.array:
        return self.base.weight

    def __call__(self, x: mx.array) -> mx.array:
        return self._pool.apply(self._site, x, self.base(x))


def _dims(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.QuantizedLinear):
        return module.scales.shape[-1] * module.group_size, module.weight.shape[0]
    return module.weight.shape[1], module.weight.shape[0]


def _child(obj, part: str):
    return obj[int(part)] if isinstance(obj, list) else obj[part]


def canonical(path: str) -> str:
    """The path in mlx-lm's own tree: vllm-metal's wrappers keep the module
    they wrap as `inner` (self_attn.inner.q_proj -> self_attn.q_proj)."""
    return ".".join(p for p in path.split(".") if p != WRAPPER_CHILD)


def install(model, pool) -> tuple[list[Site], dict[tuple[int, str], Target]]:
    """Wraps every Linear / QuantizedLinear inside the decoder layers of
    `model` (a LoadedModel); returns the sites and the targets by (layer,
    mlx-lm module path)."""
    layers = decoder_owner(model.model)["model"].layers
    sites: list[Site] = []
    targets: dict[tuple[int, str], Target] = {}
    for i, layer in enumerate(layers):
        found = [(p, m) for p, m in layer.named_modules() if type(m) in (nn.Linear, nn.QuantizedLinear)]
        for path, module in found:
            owner_path, _, attr = path.rpartition(".")
            owner = layer
            for part in owner_path.split(".") if owner_path else []:
                owner = _child(owner, part)
            in_dims, out_dims = _dims(module)
            site = Site(len(sites), i, canonical(path), in_dims, out_dims)
            sites.append(site)
            wrapper = LoRALinear(module, site.index, pool)
            if isinstance(owner, list):
                owner[int(attr)] = wrapper
            else:
                owner[attr] = wrapper
            base = canonical(owner_path)
            prefix = f"{base}." if base else ""
            if attr in FUSED:
                for member in FUSED[attr]:
                    view = owner.__dict__.get(member)
                    product = view._product
                    product.fused = wrapper  # the views' shared product goes through the wrapper
                    targets[(i, prefix + member)] = Target(site.index, product.offsets[view._index],
                                                           product.offsets[view._index + 1])
            else:
                targets[(i, prefix + attr)] = Target(site.index, 0, out_dims)
    return sites, targets


def seal(targets: dict[tuple[int, str], Target], called: set[int]) -> dict[tuple[int, str], Target]:
    """The targets whose site a traced step called."""
    return {k: t for k, t in targets.items() if t.site in called}
