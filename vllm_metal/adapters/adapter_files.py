"""Reads a LoRA adapter directory into low-rank pairs, one per target module.

Two formats, told apart by `adapter_config.json`:

- PEFT (`r`, `lora_alpha`, `target_modules`; weights in
  `adapter_model.safetensors`, `lora_A.weight` [r, in] and `lora_B.weight`
  [out, r] per module): scale `lora_alpha / r`, or `lora_alpha / sqrt(r)` with
  `use_rslora`, per module where `rank_pattern` / `alpha_pattern` say so
  (vLLM's own PEFTHelper parses and vets the config).
- mlx-lm's `mlx_lm.lora` (`fine_tune_type`, `num_layers`, `lora_parameters`
  {rank, scale, keys}; weights in `adapters.safetensors`, `lora_a` [in, r]
  and `lora_b` [r, out] per module): the delta is `scale * x @ a @ b`.

Either way a module is named by its decoder layer and its path inside the
layer in mlx-lm's names (`self_attn.q_proj`, `mlp.down_proj`), which are the
checkpoint's names for every family mlx-lm loads without renaming. Whatever
cannot be served is refused here with the reason (AdapterError, a
ValueError): embedding / output-head adapters, modules_to_save, DoRA, adapter
biases, per-expert MoE adapters, a full fine-tune named as an adapter, a
rank above --max-lora-rank, mismatched or non-finite tensors, unreadable
files. A missing directory or file is vLLM's LoRAAdapterNotFoundError (404).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
MLX_WEIGHTS = "adapters.safetensors"
# "<anything>.layers.<i>.<module path inside the layer>"
LAYER_MODULE = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(.+)$")
PEFT_TENSOR = re.compile(r"^(.*)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
                         r"(?:\.default)?(?:\.weight)?$")
MLX_TENSOR = re.compile(r"^(.*)\.(lora_a|lora_b|m)$")


REFUSED = "vllm-metal cannot serve LoRA adapter"  # every AdapterError starts so (the API maps it to 400)


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names it, its path and why."""


def refusal(name: str, path: str, problem: str) -> AdapterError:
    return AdapterError(f"{REFUSED} {name!r} at {path}: {problem}")


@dataclass
class LoRAModule:
    layer: int
    path: str  # the module inside its decoder layer, in mlx-lm's names: "self_attn.q_proj"
    a: np.ndarray  # [in, r] float32
    b: np.ndarray  # [r, out] float32
    scale: float


@dataclass
class AdapterWeights:
    name: str
    path: str
    format: str  # "peft" or "mlx-lm"
    modules: list[LoRAModule]



def read_adapter(name: str, path: str, max_rank: int) -> AdapterWeights:
    """The adapter at `path` (a directory), vetted; AdapterError says what is wrong."""
    from vllm.exceptions import LoRAAdapterNotFoundError

    def fail(problem: str) -> AdapterError:
        return refusal(name, path, problem)

    root = Path(path).expanduser()
    if not (root / CONFIG).is_file():
        raise LoRAAdapterNotFoundError(name, path)
    try:
        config = json.loads((root / CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(f"{CONFIG} cannot be read as JSON ({type(e).__name__}: {e})") from e
    if not isinstance(config, dict):
        raise fail(f"{CONFIG} holds {type(config).__name__}, not an object")
    if "fine_tune_type" in config or "lora_parameters" in config:
        modules = _mlx_lm(root, config, max_rank, fail)
        fmt = "mlx-lm"
    elif "r" in config or "peft_type" in config:
        modules = _peft(root, config, max_rank, fail)
        fmt = "peft"
    else:
        raise fail(f"{CONFIG} is neither PEFT's (r, lora_alpha, target_modules) nor mlx-lm's "
                   "(fine_tune_type, lora_parameters)")
    if not modules:
        raise fail("its weights hold no LoRA pairs")
    for m in modules:
        if not (np.isfinite(m.a).all() and np.isfinite(m.b).all()):
            raise fail(f"layer {m.layer} {m.path}: non-finite values in its weights")
    return AdapterWeights(name, str(path), fmt, modules)


def _tensors(file: Path, fail) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: f.get_tensor(k).float().numpy() for k in f.keys()}
    except Exception as e:  # noqa: BLE001 -- safetensors' errors have no common base; the message says it
        raise fail(f"{file.name} cannot be read as safetensors ({type(e).__name__}: {e})") from e


def _locate(module: str, fail) -> tuple[int, str]:
    """'model.layers.3.self_attn.q_proj' -> (3, 'self_attn.q_proj')."""
    match = LAYER_MODULE.match(module)
    if match is None:
        if "embed" in module or "lm_head" in module or "output" in module:
            raise fail(f"{module}: adapters on the embedding or the output head are not served "
                       "(only the decoder layers' projections)")
        raise fail(f"{module}: not a module of a decoder layer (<model>.layers.<i>.<module>)")
    layer, inner = int(match.group(1)), match.group(2)
    if re.search(r"(^|\.)(experts|switch_mlp)(\.|$)", inner):
        raise fail(f"{module}: LoRA on MoE expert projections is not served (attention, dense MLP, "
                   "shared-expert and router projections are)")
    return layer, inner


def _pairs(tensors: dict, pattern: re.Pattern, refuse_kind, fail) -> dict[str, dict[str, np.ndarray]]:
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, t in tensors.items():
        match = pattern.match(key)
        if match is None:
            raise fail(f"tensor {key!r} is not a LoRA weight: full-weight modules (modules_to_save, "
                       "a fine-tuned head) are not served")
        module, kind = match.group(1), match.group(2)
        refuse_kind(module, kind)
        pairs.setdefault(module, {})[kind] = t
    return pairs


def _peft(root: Path, config: dict, max_rank: int, fail) -> list[LoRAModule]:
    from vllm.exceptions import LoRAAdapterNotFoundError
    from vllm.lora.peft_helper import PEFTHelper

    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise fail(f"peft_type {config.get('peft_type')!r} is not LoRA")
    try:
        helper = PEFTHelper.from_dict(config)
        helper.validate_legal(SimpleNamespace(max_lora_rank=max_rank))  # DoRA, biases, modules_to_save, rank
    except (ValueError, TypeError) as e:
        raise fail(f"{CONFIG}: {e}") from e
    weights = root / PEFT_WEIGHTS
    if not weights.is_file():
        if (root / "adapter_model.bin").is_file():
            raise fail("adapter_model.bin (a pickle) is not loaded: save the adapter as safetensors "
                       "(PEFT's default, safe_serialization=True)")
        raise LoRAAdapterNotFoundError(str(config.get("name", root.name)), str(root))

    def refuse(module, kind):
        if kind.startswith("lora_embedding"):
            raise fail(f"{module}: embedding adapters ({kind}) are not served")
        if kind == "lora_magnitude_vector":
            raise fail(f"{module}: DoRA magnitudes are not served")

    modules = []
    for module, p in _pairs(_tensors(weights, fail), PEFT_TENSOR, refuse, fail).items():
        name = module.removeprefix("base_model.model.")
        if set(p) != {"lora_A", "lora_B"}:
            raise fail(f"{name}: has {sorted(p)}, needs lora_A and lora_B")
        a, b = p["lora_A"], p["lora_B"]  # [r, in], [out, r]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise fail(f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not a rank-r pair "
                       "([r, in] and [out, r])")
        rank, scale = helper.get_rank_and_scaling(name)
        if a.shape[0] != rank:
            raise fail(f"{name}: rank {a.shape[0]} in the weights, {rank} in {CONFIG}")
        layer, inner = _locate(name, fail)
        modules.append(LoRAModule(layer, inner, np.ascontiguousarray(a.T), np.ascontiguousarray(b.T), float(scale)))
    return modules


def _mlx_lm(root: Path, config: dict, max_rank: int, fail) -> list[LoRAModule]:
    from vllm.exceptions import LoRAAdapterNotFoundError

    kind = config.get("fine_tune_type", "lora")
    if kind == "full":
        raise fail("a full fine-tune (fine_tune_type: full), not an adapter: its weights replace the model's. "
                   "Serve it as a model: mlx_lm.fuse --model BASE --adapter-path DIR --save-path OUT, then "
                   "vllm serve OUT")
    if kind == "dora":
        raise fail("DoRA (fine_tune_type: dora) is not served; fuse it into the model (mlx_lm.fuse) and serve that")
    if kind != "lora":
        raise fail(f"fine_tune_type {kind!r} is not one of lora, dora, full")
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise fail("lora_parameters (rank, scale) is missing")
    rank, scale = params.get("rank"), params.get("scale")
    if scale is None:
        hint = " (found 'alpha': mlx-lm's LoRA config uses 'scale')" if "alpha" in params else ""
        raise fail(f"lora_parameters has no 'scale'{hint}")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise fail(f"lora_parameters.rank {rank!r} is not a positive integer")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not np.isfinite(scale):
        raise fail(f"lora_parameters.scale {scale!r} is not a finite number")
    if rank > max_rank:
        raise fail(f"rank {rank} is above --max-lora-rank {max_rank}")
    weights = root / MLX_WEIGHTS
    if not weights.is_file():
        raise LoRAAdapterNotFoundError(root.name, str(root))

    def refuse(module, kind):
        if kind == "m":
            raise fail(f"{module}: DoRA magnitudes are not served")

    modules = []
    for module, p in _pairs(_tensors(weights, fail), MLX_TENSOR, refuse, fail).items():
        if set(p) != {"lora_a", "lora_b"}:
            raise fail(f"{module}: has {sorted(p)}, needs lora_a and lora_b")
        a, b = p["lora_a"], p["lora_b"]  # [in, r], [r, out]
        layer, inner = _locate(module, fail)
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise fail(f"{module}: lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} are not a rank-r pair "
                       "([in, r] and [r, out])")
        if a.shape[1] != rank:
            raise fail(f"{module}: rank {a.shape[1]} in the weights, {rank} in {CONFIG}")
        modules.append(LoRAModule(layer, inner, np.ascontiguousarray(a), np.ascontiguousarray(b), float(scale)))
    return modules
