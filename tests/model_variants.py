"""Builds model directories of other mlx-lm families from the embedded model's
weights (so logits stay peaked and greedy decoding is stable): llama in
float32, qwen2 (zero q/k/v biases), qwen3 (unit q/k norms), mistral."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from vllm_metal.native import ops  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM"}


def float32_weights(model_dir: str) -> dict[str, mx.array]:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model, load_model

    model, _ = load_model(Path(model_dir))
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    return dict(tree_flatten(model.parameters()))


def make_variant(model_dir: str, out: Path, family: str, weights: dict[str, mx.array], layers: int = 12) -> str:
    """The first `layers` layers of the embedded model as `family` (fewer
    layers keep the test fast; greedy decoding stays well defined)."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config.pop("quantization", None)
    config.update(model_type=family, architectures=[ARCHITECTURES[family]], torch_dtype="float32",
                  num_hidden_layers=layers)
    weights = {k: v for k, v in weights.items()
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    if family == "qwen2":
        for i in range(layers):
            for proj in ("q_proj", "k_proj", "v_proj"):
                w = weights[f"model.layers.{i}.self_attn.{proj}.weight"]
                weights[f"model.layers.{i}.self_attn.{proj}.bias"] = mx.zeros((w.shape[0],))
    if family == "qwen3":
        for i in range(layers):
            for norm in ("q_norm", "k_norm"):
                weights[f"model.layers.{i}.self_attn.{norm}.weight"] = mx.ones((config["head_dim"],))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        shutil.copy(Path(model_dir) / name, out / name)
    return str(out)
