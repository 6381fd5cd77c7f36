"""What a checkpoint is and how its weights reach mlx-lm's model classes.

Formats (Checkpoint.format):
  "mlx"   an mlx-lm / Hugging Face directory of safetensors (float, or MLX
          quantized): mlx-lm reads it itself (`native`);
  "gguf"  a llama.cpp GGUF file, or a directory holding one (with or without
          config.json and tokenizer files): formats/gguf_checkpoint.py;
  "awq" / "gptq"  a Hugging Face directory quantized by AutoAWQ / GPTQ
          (4-bit): repacked to MLX affine at load, formats/awq_gptq.py.

`open_checkpoint` only reads the config and the file's tensor index; the
weights are read by `Checkpoint.load_weights` when the model is built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from vllm_metal.formats import gguf_checkpoint
from vllm_metal.formats.model_dir import resolve_model_dir


@dataclass
class Checkpoint:
    source: Path  # the GGUF file, or the model directory
    format: str
    config: dict  # mlx-lm's config (for a non-native format: without "quantization"; load_weights says it)
    details: dict = field(default_factory=dict)  # format facts for `vllm-metal doctor`

    @property
    def native(self) -> bool:
        """mlx-lm loads the directory itself."""
        return self.format == "mlx"

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    def describe(self) -> str:
        """The format and quantization in words (`vllm-metal doctor --model`)."""
        if self.format == "gguf":
            served = self.details["served_as"]
            types = ", ".join(f"{t} x{n}" for t, n in sorted(self.details["tensor_types"].items()))
            how = []
            if served["kept"]:
                how.append(f"kept quantized as MLX affine (exact): {', '.join(served['kept'])}")
            if served["requantized"]:
                how.append("re-quantized to MLX affine: " + ", ".join(
                    f"{t} -> {b}-bit" for t, b in served["requantized"].items()))
            if served["float"]:
                how.append(f"floating point: {', '.join(served['float'])}")
            if served["refused"]:
                how.append(f"NOT servable: {', '.join(served['refused'])}")
            return f"GGUF ({self.details['architecture']}; {types}): " + "; ".join(how)
        if self.format in ("awq", "gptq"):
            q = self.details["quantization_config"]
            return (f"{self.format.upper()} {q.get('bits', q.get('w_bit'))}-bit, group "
                    f"{q.get('group_size', q.get('q_group_size'))}: repacked to MLX affine at load")
        quant = self.config.get("quantization")
        if quant:
            mixed = any(isinstance(v, dict) for v in quant.values())
            return (f"MLX affine {quant.get('bits')}-bit, group {quant.get('group_size')}"
                    + (" (per-layer overrides)" if mixed else ""))
        method = (self.config.get("quantization_config") or {}).get("quant_method")
        dtype = self.config.get("torch_dtype") or self.config.get("dtype") or "unstated dtype"
        return f"safetensors, {method} quantization (mlx-lm's loader)" if method else f"safetensors, {dtype}"

    def load_weights(self) -> tuple[dict, dict | None]:
        """(mlx-lm named weights, mlx-lm "quantization" entry or None)."""
        if self.format == "gguf":
            weights, quant = gguf_checkpoint.load_weights(self.source, self.config)
            return weights, gguf_checkpoint.quantization_entry(quant)
        if self.format in ("awq", "gptq"):
            from vllm_metal.formats import awq_gptq

            return awq_gptq.load_weights(self.source, self.config)
        raise ValueError(f"{self.source}: mlx-lm loads a {self.format} checkpoint itself")


def _read_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def open_checkpoint(model: str | Path, config_path: str | Path | None = None) -> Checkpoint:
    """The checkpoint `model` names (a GGUF file, a directory, a hub id).
    config_path: a directory whose config.json replaces the checkpoint's
    (vLLM's --hf-config-path)."""
    gguf = gguf_checkpoint.find_gguf(model)
    if gguf is not None:
        named_dir = Path(model).expanduser() if Path(model).expanduser().is_dir() else None
        config_dir = Path(config_path) if config_path else named_dir
        if config_dir is not None and (config_dir / "config.json").exists():
            config = _read_config(config_dir)
        elif config_path:
            raise FileNotFoundError(f"{config_path} has no config.json")
        else:
            config = gguf_checkpoint.config_from_metadata(gguf)
        config.pop("quantization", None)  # the file's tensor types say it
        config.pop("quantization_config", None)
        types = gguf_checkpoint.tensor_types(gguf)
        return Checkpoint(gguf, "gguf", config, {"tensor_types": dict(types),
                                                 "served_as": gguf_checkpoint.describe_types(types),
                                                 "architecture": gguf_checkpoint.read_architecture(gguf)})
    directory = resolve_model_dir(str(model))
    config = _read_config(Path(config_path) if config_path else directory)
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method in ("awq", "gptq") and "quantization" not in config:
        from vllm_metal.formats import awq_gptq

        awq_gptq.preflight(directory, config)
        return Checkpoint(directory, method, config, {"quantization_config": config["quantization_config"]})
    return Checkpoint(directory, "mlx", config)


def build_model(checkpoint: Checkpoint, get_model_classes=None, weights: tuple | None = None):
    """(mlx-lm model, config) of a checkpoint whose weights formats/ converts
    (GGUF, AWQ, GPTQ), built the way mlx-lm's own load_model builds one from
    a directory: its family's classes and sanitize, `nn.quantize` where the
    weights carry scales, a strict load. weights: `load_weights()`'s result,
    if read already."""
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    config = dict(checkpoint.config)
    weights, quantization = weights or checkpoint.load_weights()
    model_class, args_class = (get_model_classes or _get_classes)(config)
    model = model_class(args_class.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if quantization is not None:
        config["quantization"] = quantization

        def quantized_here(path, module):
            if path in quantization:
                return quantization[path]
            return hasattr(module, "to_quantized") and f"{path}.scales" in weights

        nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                    class_predicate=quantized_here)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    return model, config
