"""How much memory the device has and how much of it the KV cache may take.

On a Mac the GPU shares unified memory; Metal recommends a working-set size
per device (MLX reports it as `max_recommended_working_set_size`) and MLX's
wired limit keeps the cache resident. On MLX's CPU device the budget is RAM.
"""

from __future__ import annotations

# On MLX's CPU device the default KV budget is capped like vLLM's CPU backend
# (VLLM_CPU_KVCACHE_SPACE): taking 90% of RAM by default is hostile on a
# shared machine. --kv-cache-memory-bytes sets any size.
CPU_DEFAULT_KV_CAP_BYTES = 4 << 30


def device_total_memory(device: str) -> int:
    """Bytes the MLX device can use: Metal's recommended working set, or RAM."""
    if device == "gpu":
        info = metal_device_info()
        if info.get("max_recommended_working_set_size"):
            return int(info["max_recommended_working_set_size"])
    import psutil

    return int(psutil.virtual_memory().total)


def metal_device_info() -> dict:
    """MLX's Metal device info, or {} where there is no Metal."""
    import mlx.core as mx

    try:
        if not mx.metal.is_available():
            return {}
        return dict(mx.metal.device_info())
    except (AttributeError, RuntimeError):
        return {}


def kv_cache_budget(*, device: str, total: int, utilization: float, weights: int,
                    other_used: int, explicit: int | None) -> int:
    """Bytes for the KV cache.

    explicit: --kv-cache-memory-bytes, taken as is. Otherwise utilization x
    total, less the weights and what the process already holds besides them
    (activations are bounded by max_num_batched_tokens and live in that
    headroom), capped on the CPU device.
    """
    if explicit:
        return int(explicit)
    budget = int(utilization * total) - weights - other_used
    if device == "cpu":
        budget = min(budget, CPU_DEFAULT_KV_CAP_BYTES)
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {utilization:.2f} x {total / 2**30:.1f} GiB "
            f"minus {weights / 2**30:.2f} GiB of weights and {other_used / 2**30:.2f} GiB in use; "
            "raise --gpu-memory-utilization or set --kv-cache-memory-bytes")
    return budget


def set_wired_limit(device: str, bytes_needed: int) -> None:
    """Keep the model and KV cache resident on Metal (no-op elsewhere)."""
    if device != "gpu":
        return
    import mlx.core as mx

    info = metal_device_info()
    limit = min(int(bytes_needed), int(info.get("max_recommended_working_set_size", bytes_needed)))
    if limit > 0:
        mx.set_wired_limit(limit)
