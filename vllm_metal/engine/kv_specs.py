"""The runner's KV cache as vLLM plans it: the per-layer specs vLLM groups
and sizes, the bytes this runner really allocates against vLLM's plan, and
the groups' block sizes and windows once vLLM has decided."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import torch
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec, MLAAttentionSpec,
                                        SlidingWindowSpec)

from vllm_metal.models.loaded_model import LoadedModel
from vllm_metal.native.kv_quant import row_bytes

MX_TO_TORCH = {mx.float32: torch.float32, mx.float16: torch.float16, mx.bfloat16: torch.bfloat16}
KV_CACHE_TORCH = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
                  "fp8_per_token_head": torch.uint8}  # rows of head_size codes + a float32 scale


def kv_cache_dtype(vllm_config) -> str:
    """The runner's cache format: "auto" (the model dtype, also an explicit
    float16 / bfloat16 that is the model's) or an 8-bit float name."""
    dtype = vllm_config.cache_config.cache_dtype
    return dtype if dtype in KV_CACHE_TORCH else "auto"


def kv_cache_spec(vllm_config, m: LoadedModel, layer_name: Callable[[int], str]) -> dict[str, KVCacheSpec]:
    """MetalModelRunner.get_kv_cache_spec: one spec per layer of `m` with a
    cache of its own, named by `layer_name(i)`."""
    block_size = vllm_config.cache_config.block_size
    dtype = MX_TO_TORCH[m.dtype]
    # An 8-bit float cache (--kv-cache-dtype fp8*): one byte per element, for attention layers only.
    cache_dtype = KV_CACHE_TORCH.get(vllm_config.cache_config.cache_dtype, dtype)
    specs: dict[str, KVCacheSpec] = {}
    keep = keeps_windows(m, kv_cache_dtype(vllm_config))
    for i, (kv, window) in enumerate(zip(m.layer_kv, m.sliding_windows)):
        if kv.source is not None or not m.owns(i):  # a shared cache, or another stage's layer
            continue
        if kv.layout == "state":
            cache = vllm_config.cache_config
            # The convolution state in the model dtype, a recurrent state (if any) in float32.
            dtypes = (dtype,) + (torch.float32,) * (len(kv.state_shapes) - 1)
            specs[layer_name(i)] = MambaSpec(block_size=cache.mamba_block_size, shapes=kv.state_shapes,
                                             dtypes=dtypes, mamba_cache_mode=cache.mamba_cache_mode)
            continue
        common = dict(block_size=block_size, num_kv_heads=kv.num_kv_heads, head_size=kv.head_dim, dtype=cache_dtype)
        if vllm_config.cache_config.cache_dtype == "fp8_per_token_head":  # K and V rows, each with its scale
            common["state_content_bytes"] = 2 * row_bytes("fp8_per_token_head", kv.head_dim)
        if kv.layout == "latent":  # one latent row per token, no separate V (MLA has no windows)
            specs[layer_name(i)] = MLAAttentionSpec(**common)
        else:
            specs[layer_name(i)] = (SlidingWindowSpec(sliding_window=window, **common) if window and keep
                                    else FullAttentionSpec(**common))
    return specs


def keeps_windows(m: LoadedModel, cache_dtype: str = "auto") -> bool:
    """Whether windowed layers are declared as windows (vLLM's hybrid manager
    may then hold only their windows' blocks). Not beside full-attention
    layers whose arrays differ in shape (Gemma 4's wider global heads) in a
    model without linear-attention states: their cache groups could not
    share arrays here, so every block id would cost every layer's page, more
    than planning the windows as full attention (as vLLM does with the
    manager off; the layers still attend within their windows).
    Nor with an 8-bit cache (`cache_dtype`, kv_cache_dtype()): 8-bit rows
    have no in-place write, so every later writer of a shared array would
    copy it whole, every step. native/fit.windows_kept follows the same rule."""
    attention = [(kv.layout, kv.num_kv_heads, kv.head_dim, window) for kv, window in
                 zip(m.layer_kv, m.sliding_windows) if kv.source is None and kv.layout != "state"]
    if all(a[3] for a in attention):
        return True
    if cache_dtype != "auto":
        return False
    if len(attention) < sum(kv.source is None for kv in m.layer_kv):
        return True
    return len({a[:3] for a in attention}) <= 1


def model_of(layer_name: str) -> str:
    """Which model a layer's cache belongs to ("model", or a draft's
    "draft_model.model" / "mtp"): arrays are shared within one model only."""
    return layer_name.rsplit(".layers.", 1)[0]


def kv_bytes_ratio(vllm_config, specs: dict[str, KVCacheSpec],
                   owner: Callable[[str], object] = model_of) -> float:
    """MetalModelRunner.kv_bytes_ratio: bytes allocated here per byte vLLM
    plans for the KV cache `specs` (>= 1). vLLM's hybrid manager lays every
    cache group over one allocation from byte 0, so a layer of each group
    shares memory with a layer of each other group (block ids never overlap
    between groups). The runner shares arrays likewise where the layers'
    arrays have one shape and dtype (attention layers of one model,
    `owner`: the target's or a draft's, layer_shares); linear-attention
    states, and layers whose arrays differ, have arrays of their own. The
    worker divides its budget by this so the memory really used stays within
    it. 1.0 with a single group, or when every shared tensor is shared here."""
    from copy import deepcopy

    from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
    from vllm.v1.core.kv_cache_planning import (_pool_bytes_per_block_from_builder, get_global_kv_cache_groups,
                                                get_kv_cache_config_from_groups)

    # The grouping vLLM's engine makes from these specs, and the bytes per
    # block it divides the budget by (a private helper of vLLM 0.33's
    # planner: tests/engine/test_hybrid.py fails if its meaning changes).
    groups = get_global_kv_cache_groups(vllm_config, [deepcopy(specs)])
    if len(groups) <= 1:
        return 1.0
    planned_per_block = _pool_bytes_per_block_from_builder(
        get_kv_cache_config_builder(vllm_config), vllm_config, groups)
    # vLLM's tensor plan for these groups (any number of blocks: the offsets do not depend on it).
    config = get_kv_cache_config_from_groups(vllm_config, groups, 2 * planned_per_block)
    layer_specs = {name: spec for name, spec in _layer_specs(groups)}
    starts = tensor_starts(config)
    ours_per_block, seen = 0, set()
    for name, spec in layer_specs.items():
        key = _share_key(name, spec, starts, owner)
        if key is not None and key in seen:
            continue
        seen.add(key)
        ours_per_block += spec.real_page_size_bytes
    return max(1.0, ours_per_block / planned_per_block)


def _layer_specs(groups):
    """(layer name, its own spec) over vLLM's groups."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    for group in groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            yield name, (spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec)


def _share_key(name: str, spec: KVCacheSpec, starts: dict[str, int], owner) -> tuple | None:
    """Layers with one key share arrays here: attention layers of one owner at
    one byte offset of vLLM's plan with arrays of one shape and dtype; None
    (never shared) for linear-attention states and layers outside the plan."""
    if isinstance(spec, MambaSpec) or name not in starts:
        return None
    latent = isinstance(spec, MLAAttentionSpec)
    return (owner(name), starts[name], latent, spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype,
            spec.real_page_size_bytes)


def tensor_starts(config: KVCacheConfig) -> dict[str, int]:
    """Each layer's first byte (its page of block 0) in vLLM's KV-cache plan:
    `kv_cache_tensors` of every group lie over one allocation, so layers of
    different groups at one offset share memory (vLLM's hybrid manager)."""
    return {name: tensor.offset + i * tensor.layer_stride
            for tensor in config.kv_cache_tensors for i, name in enumerate(tensor.layers)}


def allocate(vllm_config, config: KVCacheConfig, m: LoadedModel, layer_name: Callable[[int], str],
             block_sizes: list[int]):
    """m's PagedKVCache for vLLM's plan `config`: its layers' groups, the
    cache dtype, and arrays shared where vLLM lays layers over the same bytes."""
    _, _, layer_group = cache_groups(config, m, layer_name)
    return m.allocate_kv(config.num_blocks, block_sizes, layer_group, kv_cache_dtype=kv_cache_dtype(vllm_config),
                         layer_share=layer_shares(config, m, layer_name))


def layer_shares(config: KVCacheConfig, m: LoadedModel, layer_name: Callable[[int], str]) -> list[int | None]:
    """For LoadedModel.allocate_kv: each layer's byte offset in vLLM's plan
    where another of this model's attention layers (of another group) has
    the same one, else None (arrays of its own). allocate_kv shares the
    arrays of layers with one offset whose shapes and dtypes agree."""
    starts = tensor_starts(config)
    offsets = [starts.get(layer_name(i)) if kv.source is None and kv.layout != "state" and m.owns(i) else None
               for i, kv in enumerate(m.layer_kv)]
    counts: dict[int, int] = {}
    for offset in offsets:
        if offset is not None:
            counts[offset] = counts.get(offset, 0) + 1
    return [offset if offset is not None and counts[offset] > 1 else None for offset in offsets]


def cache_groups(config: KVCacheConfig, m: LoadedModel, layer_name: Callable[[int], str]
                 ) -> tuple[list[int], list[int | None], list[int]]:
    """From vLLM's KV-cache config: each group's block size and sliding
    window (None: full attention), and each layer's group."""
    layer_group = [0] * m.num_layers
    index = {layer_name(i): i for i in range(m.num_layers)}
    block_sizes, group_windows = [], []
    for g, group in enumerate(config.kv_cache_groups):
        block_sizes.append(group.kv_cache_spec.block_size)
        group_windows.append(group.kv_cache_spec.sliding_window
                             if isinstance(group.kv_cache_spec, SlidingWindowSpec) else None)
        for name in group.layer_names:
            if name in index:  # (pipeline parallel: groups list every stage's layers)
                layer_group[index[name]] = g
    for i, kv in enumerate(m.layer_kv):  # a shared layer reads its source's blocks
        if kv.source is not None:
            layer_group[i] = layer_group[kv.source]
    return block_sizes, group_windows, layer_group


def align_state_groups(config: KVCacheConfig) -> list[int]:
    """The groups of linear-attention states under prefix caching (vLLM's
    "align" mode: a state block per `block_size` tokens, engine/state_align.py)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    groups = []
    for g, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        specs = spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        if any(isinstance(s, MambaSpec) and s.mamba_cache_mode == "align" for s in specs):
            groups.append(g)
    return groups
