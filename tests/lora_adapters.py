"""Random LoRA adapters for the tiny test models, written by the tools users
train them with (mlx-lm's tuner, PEFT itself), and independent references:
mlx-lm's own `load_adapters` for mlx-lm adapters, and for PEFT adapters the
base weights merged W + scale * B A (numpy float64) run through mlx-lm's
forward. Adapters are strong (B as large as A) so they change greedy output.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np


def make_mlx_adapter(model_dir: str, out: Path, rank: int = 8, scale: float = 2.0, keys=None,
                     num_layers: int = 2, seed: int = 0, strength: float = 1.0) -> str:
    """An `mlx_lm.lora` adapter directory (adapter_config.json +
    adapters.safetensors) built by mlx-lm's own linear_to_lora_layers."""
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    model.freeze()
    params = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        params["keys"] = list(keys)
    linear_to_lora_layers(model, num_layers, params)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, value in tree_flatten(model.trainable_parameters()):
        if name.endswith("lora_a"):
            w = rng.standard_normal(value.shape) / math.sqrt(value.shape[-2])
        elif name.endswith("lora_b"):
            w = strength * rng.standard_normal(value.shape) / math.sqrt(value.shape[-2])
        else:
            continue
        weights[name] = mx.array(w.astype(np.float32))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}))
    return str(out)


def make_peft_adapter(model_dir: str, out: Path, rank: int = 8, alpha: float = 16, target_modules=("q_proj", "v_proj"),
                      use_rslora: bool = False, rank_pattern=None, seed: int = 0, strength: float = 1.0) -> str:
    """A PEFT LoRA adapter directory saved by PEFT from the transformers model
    of the same weights (lora_B randomised: PEFT initialises it to zero)."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0,
                             use_rslora=use_rslora, rank_pattern=rank_pattern or {})
    wrapped = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            elif "lora_B" in name:
                p.copy_(strength * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
    wrapped.save_pretrained(str(out))
    return str(out)


def merged_peft_model(model_dir: str, adapter_dir: str, out: Path) -> str:
    """The base model with the PEFT adapter merged, W + scale * B A (float64),
    as an mlx-lm directory."""
    from safetensors.numpy import load_file

    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    weights = {k: np.array(v) for k, v in mx.load(str(Path(model_dir) / "model.safetensors")).items()}
    patterns = config.get("rank_pattern") or {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        rank = next((r for pat, r in patterns.items() if module.endswith(pat)), config["r"])
        scale = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
        w = weights[module + ".weight"].astype(np.float64)
        weights[module + ".weight"] = (w + scale * b.astype(np.float64) @ a.astype(np.float64)).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    return str(out)


def reference_logprobs(model_dir: str, mlx_adapter: str | None = None):
    """tokens -> float64 log-softmax rows of mlx-lm's forward (row i predicts
    token i + 1), with an mlx-lm adapter loaded by mlx-lm's load_adapters."""
    from families import logprobs_of
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    return logprobs_of(load_adapters(model, mlx_adapter) if mlx_adapter is not None else model)


def peft_from_mlx_adapter(mlx_dir: str, out: Path) -> str:
    """The same adapter in PEFT's layout (names `base_model.model.<module>.
    lora_A.weight` [r, in] / `lora_B.weight` [out, r], lora_alpha = scale * r):
    served through the PEFT reader, its reference is mlx-lm's load_adapters
    of the original."""
    from safetensors.numpy import save_file

    config = json.loads((Path(mlx_dir) / "adapter_config.json").read_text())
    params = config["lora_parameters"]
    tensors, targets = {}, set()
    for name, value in mx.load(str(Path(mlx_dir) / "adapters.safetensors")).items():
        module, kind = name.rsplit(".", 1)
        key = "lora_A" if kind == "lora_a" else "lora_B"
        tensors[f"base_model.model.{module}.{key}.weight"] = np.ascontiguousarray(np.array(value).T)
        targets.add(module.rsplit(".", 1)[-1])
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": params["rank"], "lora_alpha": params["scale"] * params["rank"],
         "target_modules": sorted(targets), "bias": "none"}))
    return str(out)
