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
            specs[layer_name(i)] = (SlidingWindowSpec(sliding_window=window, **common) if window
                                    else FullAttentionSpec(**common))
    return specs


def kv_bytes_ratio(vllm_config, specs: dict[str, KVCacheSpec]) -> float:
    """MetalModelRunner.kv_bytes_ratio: bytes allocated here per byte vLLM
    plans for the KV cache `specs` (>= 1). vLLM's hybrid manager lets one
    layer of each cache group share a tensor (block ids never overlap between
    groups); MLX's functional cache writes cannot alias, so every layer here
    has its own arrays. The worker divides its budget by this so the memory
    really used stays within it. 1.0 with a single group."""
    from copy import deepcopy

    from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
    from vllm.v1.core.kv_cache_planning import _pool_bytes_per_block_from_builder, get_global_kv_cache_groups
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    # The grouping vLLM's engine makes from these specs, and the bytes per
    # block it divides the budget by (a private helper of vLLM 0.33's
    # planner: tests/engine/test_hybrid.py fails if its meaning changes).
    groups = get_global_kv_cache_groups(vllm_config, [deepcopy(specs)])
    if len(groups) <= 1:
        return 1.0
    planned_per_block = _pool_bytes_per_block_from_builder(
        get_kv_cache_config_builder(vllm_config), vllm_config, groups)
    ours_per_block = 0
    for group in groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            ours_per_block += sum(spec.kv_cache_specs[name].real_page_size_bytes for name in group.layer_names)
        else:
            ours_per_block += len(group.layer_names) * spec.real_page_size_bytes
    return max(1.0, ours_per_block / planned_per_block)


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
