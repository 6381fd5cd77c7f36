"""`vllm-metal doctor --model CONFIG`: a model's memory from its config alone.

Given a config.json (or a directory holding only that), says whether its
family is served (the registry's rule), the weights' bytes computed from the
config's shapes (doctor/footprint.py), the KV cache one request of a 32k
context needs, and whether that fits this machine at vLLM's defaults
(native/fit.py). Computed, not run: nothing is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_metal.native import fit

WEIGHT_FILES = ("*.safetensors", "*.gguf", "*.bin", "*.npz")
DEFAULT_LENGTH = 32768
DEFAULT_UTILIZATION = 0.92  # vLLM's --gpu-memory-utilization default


def config_only(path: str | Path) -> Path | None:
    """The config.json of `path` when it is a config alone (the file, or a
    directory with a config.json and no weight files); None otherwise."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".json":
        return p
    if p.is_dir() and (p / "config.json").exists() and not any(next(p.glob(g), None) for g in WEIGHT_FILES):
        return p / "config.json"
    return None


def this_device() -> str:
    from vllm_metal import activation, envs

    chosen = (envs.get("VLLM_METAL_DEVICE") or "").strip().lower()
    return chosen if chosen in ("gpu", "cpu") else ("gpu" if activation.is_apple_silicon() else "cpu")


def expands(device: str) -> bool:
    """Whether loading expands quantized weights (VLLM_METAL_DEQUANTIZE, as the runner reads it)."""
    from vllm_metal import envs

    return envs.cpu_auto_switch("VLLM_METAL_DEQUANTIZE", device)


def memory_report(config: dict, *, quant: str | None = None, max_model_len: int = DEFAULT_LENGTH,
                  cache_dtype: str = "auto", device: str | None = None, total: int | None = None,
                  utilization: float = DEFAULT_UTILIZATION) -> dict:
    """The config's memory on Metal and on MLX's CPU device, and the fit on
    `device` (default: this machine's) with `total` bytes (default: its
    recommended working set or RAM)."""
    from vllm_metal.models.footprint import footprint
    from vllm_metal.native import memory

    device = device or this_device()
    gpu, cpu = footprint(config, device="gpu", quant=quant), footprint(config, device="cpu", quant=quant)
    text = config.get("text_config") or config
    limit = text.get("max_position_embeddings")
    report = {"model_type": gpu.model_type, "served": gpu.served, "reason": gpu.reason, "quantization": gpu.quant,
              "parameters": gpu.params, "notes": gpu.notes, "computed": "from the config alone, not run",
              "weights": {"metal_bytes": gpu.packed, "metal_dtype": gpu.dtype, "cpu_bytes": cpu.weights(True),
                          "cpu_dtype": cpu.dtype, "four_bit_bytes": gpu.four_bit},
              "max_position_embeddings": limit}
    if not gpu.served:
        return report
    kv = {"tokens": max_model_len, "cache_dtype": cache_dtype, "metal_bytes": gpu.kv_bytes(max_model_len, cache_dtype),
          "cpu_bytes": cpu.kv_bytes(max_model_len, cache_dtype), "layers": len(gpu.layers),
          "windows": gpu.windows,
          "windows_sized_to_window": fit.windows_kept(gpu.layers, gpu.hybrid_manager, cache_dtype) if gpu.windows else None}
    report["kv_cache"] = kv
    fp = gpu if device == "gpu" else cpu
    expand = expands(device)
    total = memory.device_total_memory(device) if total is None else total
    how = (f"{fp.quant}, " + ("expanded to " if expand else "kept packed, the rest in ") + fp.dtype
           if fp.packed != fp.expanded else fp.dtype)
    result = fit.check(fp.weights(expand), fp.layers, fp.plan(max_model_len, cache_dtype),
                       fit.Device(device, total, utilization), label=f"this {gpu.model_type} model",
                       weights_note=how, smaller_weights=fp.four_bit, packed_weights=fp.packed)
    report["here"] = {"device": device, "device_memory_bytes": total, "gpu_memory_utilization": utilization,
                      "fits": result.fits, "available_bytes": result.available, "message": result.message}
    return report


def read_config(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def format_memory(r: dict) -> list[str]:
    """The report's lines for `vllm-metal doctor --model CONFIG`."""
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    w = r["weights"]
    lines = [f"model       {r['model_type']}: " + ("served" if r["served"] else "refused") + f": {r['reason']}",
             f"format      {r['quantization']}; {r['parameters'] / 1e9:.2f} B parameters",
             f"memory      weights {gib(w['metal_bytes'])} on Metal (quantized weights kept packed, the rest "
             f"{w['metal_dtype']}), {gib(w['cpu_bytes'])} on the CPU device (expanded to {w['cpu_dtype']})"]
    lines += [f"            note: {n}" for n in r["notes"]]
    kv = r.get("kv_cache")
    if kv:
        windows = ""
        if kv["windows"]:
            windows = (f"; windowed layers ({kv['windows']}) sized to their window" if kv["windows_sized_to_window"]
                       else f"; windowed layers ({kv['windows']}) sized to the whole context, as vLLM plans them "
                       "beside full-attention layers")
        limit = r.get("max_position_embeddings")
        over = f" (beyond the model's {limit} positions)" if limit and kv["tokens"] > limit else ""
        lines.append(f"kv cache    one request of {kv['tokens']} tokens{over}: {gib(kv['metal_bytes'])} on Metal, "
                     f"{gib(kv['cpu_bytes'])} on the CPU device (--kv-cache-dtype {kv['cache_dtype']}, "
                     f"{kv['layers']} layers{windows})")
    here = r.get("here")
    if here:
        lines.append(f"this host   {here['device']}, {gib(here['device_memory_bytes'])}: " + (
            f"fits at --gpu-memory-utilization {here['gpu_memory_utilization']} ({gib(here['available_bytes'])} "
            "left for the KV cache)" if here["fits"] else here["message"]))
    lines.append(f"            ({r['computed']})")
    return lines
