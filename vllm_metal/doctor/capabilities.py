"""What runs on this machine: the data behind `vllm-metal doctor`.

`capabilities()` reports the host, Python, MLX, the native extension, the
attention path `vllm serve` would take now (and why), the KV-cache budget it
would get, and every CUDA-only path of vLLM with its status here (inert) and
what runs instead. It never fails: problems are reported under "problems" and
make "can_serve" false.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

from vllm_metal import __version__, activation, envs
from vllm_metal.native.extension import built_against_mlx, installed_mlx, mlx_mismatch_reason


def _chip() -> str:
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=5).stdout.strip() or platform.machine()
        except OSError:
            return platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_total() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return None


def _host() -> dict:
    return {
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "chip": _chip(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": _memory_total(),
        "unified_memory": activation.is_apple_silicon(),
        "python": {"version": platform.python_version(), "executable": sys.executable,
                   "arch": platform.machine()},
    }


def _cuda_paths() -> list[dict]:
    from vllm_metal.engine.cuda_gate import CUDA_PATHS, env_requests

    rows = []
    for path in CUDA_PATHS:
        rows.append({"name": path.name, "key": path.key, "kind": path.kind,
                     "status": "inert" if path.on_request == "warn" else "refused", "reason": path.reason,
                     "instead": path.instead, "if_requested": path.on_request,
                     "requested_by_env": env_requests(path)})
    return rows


def capabilities() -> dict:
    problems: list[str] = []
    device = (envs.get("VLLM_METAL_DEVICE") or "").strip().lower() or (
        "gpu" if activation.is_apple_silicon() else "cpu")
    active, why_active = activation.activation_reason()
    report: dict = {"vllm_metal": __version__, "host": _host(),
                    "plugin": {"active": active, "reason": why_active}}
    if sys.platform == "darwin" and platform.machine() != "arm64":
        problems.append("Python is not native arm64 (Rosetta?): MLX's Metal backend needs a native "
                        "arm64 Python")

    built, runtime = built_against_mlx(), installed_mlx()
    mismatch = mlx_mismatch_reason(built, runtime)
    report["extension"] = {"built_against_mlx": built, "metal_kernels": None, "loaded": False}
    report["mlx"] = {"version": runtime, "device": device}
    if mismatch:
        problems.append(mismatch)
        report["attention_path"] = {"name": None, "reason": "the native extension cannot load: " + mismatch}
    else:
        from vllm_metal.native import fast_blas

        fast_blas.preload()
        from vllm_metal.native import ops  # loads the extension

        import mlx.core as mx

        metal = bool(mx.metal.is_available())
        report["mlx"].update(default_device=str(mx.default_device()), metal_available=metal,
                             blas=fast_blas.summary())
        report["allocator"] = _allocator(device, problems)
        report["extension"].update(metal_kernels=bool(ops._ext.HAS_METAL), loaded=True)
        if device == "gpu" and not metal:
            problems.append("VLLM_METAL_DEVICE=gpu but MLX has no Metal device here")
        name, reason = ops.attention_path(mx.gpu if device == "gpu" and metal else mx.cpu)
        report["attention_path"] = {"name": name, "reason": reason}
        report["cpu_kernels"] = ops.cpu_kernels()
        report["kv_cache"] = _kv_budget(device)
        report["hybrid_state_writeback"] = _state_writeback(problems)
        report["gated_delta_path"] = _gated_delta_path(mx.gpu if device == "gpu" and metal else mx.cpu, problems)
    if not active:
        problems.append(f"vLLM would not select this plugin: {why_active}")
    report["cuda_paths"] = _cuda_paths()
    from vllm_metal.adapters.serving_config import lora_capability

    report["lora"] = lora_capability()
    from vllm_metal.pooling.serving_config import pooling_capability

    report["pooling"] = pooling_capability()
    from vllm_metal.speculative.serving_config import speculative_capability

    report["speculative"] = speculative_capability()
    report["problems"] = problems
    report["can_serve"] = not problems
    return report


def _state_writeback(problems: list[str]) -> dict:
    """Which write-back path hybrid models' linear-attention states take."""
    from vllm_metal.models.state_slots import state_writeback_mode

    try:
        mode = state_writeback_mode()
    except ValueError as e:
        problems.append(str(e))
        return {"mode": None, "reason": str(e)}
    return {"mode": mode, "reason": {
        "inplace": "each step scatters its rows' new states into the state pools, donated by MLX (no copy)",
        "copy": "VLLM_METAL_STATE_WRITEBACK=copy: every step copies each state pool (ablation)"}[mode]}


def _gated_delta_path(stream, problems: list[str]) -> dict:
    """Which recurrence Gated DeltaNet layers (qwen3_next, qwen3_5) run."""
    from vllm_metal.native import ops

    try:
        name, reason = ops.gated_delta_path(stream)
    except ValueError as e:
        problems.append(str(e))
        return {"name": None, "reason": str(e)}
    return {"name": name, "reason": reason}


def _kv_budget(device: str) -> dict:
    from vllm_metal.native import memory

    total = memory.device_total_memory(device)
    utilization = 0.92  # vLLM's default --gpu-memory-utilization
    budget = memory.kv_cache_budget(device=device, total=total, utilization=utilization, weights=0,
                                    other_used=0, explicit=None)
    return {"device_memory_bytes": total, "gpu_memory_utilization": utilization,
            "budget_bytes_before_weights": budget,
            "note": "vllm serve subtracts the model's weights; --kv-cache-memory-bytes sets it exactly"}


def _allocator(device: str, problems: list[str]) -> dict:
    """The malloc a served engine process would run on (native/allocator.py),
    decided for this environment without changing it."""
    from vllm_metal.native import allocator

    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # `vllm serve`'s engine: its own process
    try:
        decided = allocator.plan(env, platform.system(), device)
    except ValueError as e:
        problems.append(str(e))
        return {"engine": None, "reason": str(e), "this_process": allocator.engine_allocator()}
    return {"engine": "tcmalloc" if decided.library else "unchanged", "reason": decided.reason,
            "this_process": allocator.engine_allocator()}


def resident_bytes(model) -> dict:
    """The weights' bytes as each device holds them: Metal keeps MLX-quantized
    weights packed (scales, biases and float weights at float16 / bfloat16);
    the CPU device expands them to float32 at load (BLAS beats MLX's CPU
    quantized matmul)."""
    from mlx.utils import tree_flatten

    metal = cpu = 0
    quantized = {name: mod for name, mod in model.named_modules() if getattr(mod, "bits", None)}
    for name, value in tree_flatten(model.parameters()):
        module, _, leaf = name.rpartition(".")
        owner = quantized.get(module)
        if owner is not None and leaf == "weight":
            metal += value.nbytes
            cpu += value.size * 32 // owner.bits * 4
        elif owner is not None and leaf in ("scales", "biases"):
            metal += value.size * 2
        else:
            metal += value.size * 2
            cpu += value.size * 4
    return {"metal_float16": metal, "cpu_float32": cpu}


def vision_path(model_dir, config: dict) -> str:
    """What a multimodal checkpoint's images get, in words (multimodal/registry.py)."""
    from vllm_metal.multimodal.registry import VISION, has_tower, vision_family

    family = vision_family(config)
    if family is None:
        return (f"a multimodal checkpoint: its text model is served, prompts with media are refused (images are "
                f"served for {', '.join(sorted(VISION))})")
    if not has_tower(model_dir, family):
        return ("a multimodal checkpoint without its vision tower's weights: its text model is served, prompts "
                "with media are refused")
    from vllm_metal.multimodal import vit

    names = [n for n in vit.tensor_names(model_dir) if n.startswith(family.tower + ("multi_modal_projector.",
                                                                                       "model.multi_modal_projector."))]
    return (f"images served ({family.notes}; {len(names)} vision tensors); video and audio refused "
            "(--limit-mm-per-prompt image only)")


def model_check(model_dir: str) -> dict:
    """Whether `vllm serve MODEL` would be served (a model directory, a GGUF
    file, an AWQ / GPTQ directory), decided by the same load-time checks
    (format, family registry, mlx-lm build, attention adapter, RoPE probe);
    the format, its quantization and the weights' bytes in memory. A GGUF's
    or AWQ / GPTQ's weights are read (converted) to say it; an MLX
    directory's are not."""
    import json
    from pathlib import Path

    from vllm_metal.native import ops  # noqa: F401  (fast BLAS before mlx)
    from vllm_metal.formats.checkpoint import open_checkpoint
    from vllm_metal.models.loader import load_model

    from vllm_metal.pooling.checkpoint import describe

    result = {"path": str(model_dir), "model_type": None, "served": False, "reason": ""}
    try:
        checkpoint = open_checkpoint(model_dir)
    except Exception as e:  # noqa: BLE001 -- no config, a bad GGUF, a refused AWQ / GPTQ variant: the message
        result["reason"] = f"{type(e).__name__}: {e}"
        return result
    result["model_type"] = checkpoint.model_type
    result["format"] = checkpoint.format
    result["quantization"] = checkpoint.describe()
    no_pooling = {"kind": None, "served": False, "encoder": False, "how": "", "made_for_pooling": False}
    has_config = (Path(model_dir) / "config.json").exists()
    result["pooling"] = pooling = describe(model_dir) if has_config else no_pooling
    if pooling["encoder"]:  # an encoder-only checkpoint: pooling is the only way it is served
        result.update(served=pooling["served"], flags=["--runner pooling"] if pooling["served"] else [],
                      reason=pooling["how"])
        return result
    flags = []
    try:
        m = load_model(model_dir, materialize=False, pooling=pooling["made_for_pooling"])
    except Exception as e:  # noqa: BLE001 -- the answer is the message
        try:  # the bare decoder without an LM head (as Qwen3-Embedding ships): a pooling model only
            m = load_model(model_dir, materialize=False, pooling=True)
        except Exception:  # noqa: BLE001
            result["reason"] = f"{type(e).__name__}: {e}"
            return result
        flags = ["--runner pooling"]
        pooling["how"] = "no LM head in the checkpoint: served only as an embedding model, with --runner pooling"
    windows = sorted({w for w in m.sliding_windows if w})
    result["memory"] = resident_bytes(m.model)
    config = checkpoint.config
    notes = []
    if "vision_config" in config or any(a.endswith("ForConditionalGeneration")
                                        for a in config.get("architectures") or []):
        notes.append(vision_path(model_dir, config))
    # `flags`: what a user must pass for this model to be served; vLLM's
    # defaults serve every family now (hybrids with prefix caching, the text
    # model of multimodal checkpoints), so none today.
    result.update(served=True, flags=flags,
                  reason=f"{m.num_layers} layers, {m.kv_summary()}"
                  + (f", sliding windows {windows}" if windows else "")
                  + (", MLX-quantized" if m.quantized else "")
                  + "".join(f"; {n}" for n in notes))
    return result
