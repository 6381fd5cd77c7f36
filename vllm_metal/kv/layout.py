"""The cache layout both sides of the disk KV connector agree on: which
layers' arrays a block file holds, in which order, and a fingerprint of the
model, dtype, block size and shapes (a file from another layout is refused),
plus byte views of the MLX cache arrays the files are read into and written
from (no copies)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from vllm_metal.kv import block_file
from vllm_metal.kv.connector_config import CONNECTOR_NAME

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class CacheLayout:
    fingerprint: str  # hex sha256 of the model identity and the cache layout
    block_size: int
    layers: tuple[tuple[str, int], ...]  # (layer name, arrays per block: 2 = K and V, 1 = MLA's latent)
    payload_bytes: int  # one block, every layer


def _layer_specs(kv_cache_config) -> list[tuple[str, Any]]:
    out = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        for name in group.layer_names:
            out.append((name, per_layer[name] if per_layer is not None else spec))
    return out


def _model_identity(model_config) -> dict:
    """The served weights, cheaply: config.json's bytes and each weight file's
    name and size (hashing GiBs of weights at start-up would cost seconds)."""
    path = Path(str(model_config.model)).expanduser()
    identity: dict[str, Any] = {"model": str(model_config.model), "revision": model_config.revision}
    if (path / "config.json").exists():
        identity = {"config_sha256": hashlib.sha256((path / "config.json").read_bytes()).hexdigest(),
                    "weights": sorted([p.name, p.stat().st_size] for p in path.glob("*.safetensors"))}
    return identity


def cache_layout(vllm_config, kv_cache_config) -> CacheLayout:
    """Checks that the connector can serve this cache and describes it. Refuses
    (ValueError, at start-up) what it cannot restore correctly: sliding-window
    or chunked-local layers (vLLM frees their out-of-window blocks, so a prefix
    chain is not a complete cache) and several KV-cache groups."""
    if len(kv_cache_config.kv_cache_groups) != 1:
        raise ValueError(f"{CONNECTOR_NAME} supports one KV-cache group (full attention only); this model "
                         f"has {len(kv_cache_config.kv_cache_groups)}")
    specs = _layer_specs(kv_cache_config)
    layers, payload, described = [], 0, []
    block_size = None
    for name, spec in specs:
        if not isinstance(spec, FullAttentionSpec):  # MLA is one; state (Mamba) and window specs are not
            raise ValueError(f"{CONNECTOR_NAME} saves attention KV blocks only; layer {name} has a "
                             f"{type(spec).__name__}: serve this model without the disk KV cache")
        window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)
        if window:
            raise ValueError(f"{CONNECTOR_NAME} cannot serve sliding-window / chunked-local attention "
                             f"(layer {name}: window {window}); serve this model without the disk KV cache "
                             "(drop --kv-transfer-config / VLLM_METAL_KV_DISK)")
        arrays = 1 if isinstance(spec, MLAAttentionSpec) else 2
        dtype = str(spec.dtype).removeprefix("torch.")
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"{CONNECTOR_NAME}: unsupported cache dtype {dtype}")
        block_size = spec.block_size if block_size is None else block_size
        if spec.block_size != block_size:
            raise ValueError(f"{CONNECTOR_NAME}: layers with different block sizes")
        layers.append((name, arrays))
        payload += arrays * spec.block_size * spec.num_kv_heads * spec.head_size * _DTYPE_BYTES[dtype]
        described.append([name, type(spec).__name__, arrays, spec.num_kv_heads, spec.head_size, dtype])
    identity = dict(format=block_file.FORMAT_VERSION, layout="LBNHC", block_size=block_size, layers=described,
                    model=_model_identity(vllm_config.model_config),
                    model_dtype=str(vllm_config.model_config.dtype))
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return CacheLayout(digest, block_size, tuple(layers), payload)


def array_for(kv, layer: int, kind: str):
    return (kv.keys if kind == "k" else kv.values)[layer]


def byte_view(array):
    """A writable numpy view (no copy) of an evaluated MLX array's memory,
    as [num_blocks, ...] bytes; bfloat16 (which numpy lacks) through an MLX
    view of the same buffer."""
    import mlx.core as mx
    import numpy as np

    if array.dtype == mx.bfloat16:
        array = mx.view(array, mx.uint16)
        mx.eval(array)
    view = np.asarray(array)
    return view.reshape(view.shape[0], -1).view(np.uint8)
