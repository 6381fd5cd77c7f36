"""A GLM-4.5-style (glm4_moe) checkpoint with a multi-token-prediction
layer, from random weights: the Hub is out of reach, and no GLM checkpoint
small enough for two CPU cores exists there anyway. What it measures is the
MTP machinery's cost and gain at a known acceptance, not GLM's own.

`add_mtp_layer` turns a checkpoint of n + 1 layers (any family whose MTP
layer is its own decoder block: GLM-4.5's, DeepSeek-V3's) into one of n
layers plus the MTP layer `model.layers.{n}` (its decoder block, and enorm,
hnorm, eh_proj, shared_head.norm beside it; shared_head.head and
embed_tokens only as copies, as DeepSeek-V3 ships them: vLLM uses the
target's), config `num_nextn_predict_layers: 1`. Every
block's output projections are scaled by `damp` and eh_proj is close to
[identity, mix x random]: with a small damp the next token follows mostly
from the last one, and the MTP layer's first draft is taken about half the
time (damp 0.1); with damp 1 its drafts depend on all of its arithmetic.
tests/speculative/mtp_model.py and deepseek_mtp_model.py build their tiny checkpoints with it.

    .venv/bin/python benchmarks/synthetic_mtp.py OUT_DIR     # the benchmark's size (bench_speculative --mtp)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

# About SmolLM2-135M's compute per token (hidden 576, its vocabulary), as GLM-4.5 is built:
# a dense first layer, then MoE layers with a shared expert; 12 + 1 (MTP) layers.
BENCH_CONFIG = dict(
    model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], torch_dtype="float32", vocab_size=49152,
    hidden_size=576, num_hidden_layers=12, intermediate_size=1536, moe_intermediate_size=384,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=4096, tie_word_embeddings=False, norm_topk_prob=True, n_group=1, topk_group=1,
    n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=1.0, num_experts_per_tok=2,
    first_k_dense_replace=1, use_qk_norm=False, attention_bias=True, partial_rotary_factor=0.5,
    rope_scaling=None)
# At this size the layers' damped outputs still outweigh the embedding unless damped further:
# measured (mlx-lm reference, 57 greedy positions): damp 0.04 -> 14% of first drafts taken, 0.02 -> 33%,
# 0.01 -> 58%.
BENCH_MTP = dict(damp=0.01)
# A target whose step dwarfs a two-layer draft's pass (the 49k-token head read whole is ~15% of its
# step, against ~40% in BENCH_CONFIG): where a draft model shows what accepted drafts are worth.
BIG_CONFIG = {**BENCH_CONFIG, "hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 2816,
              "moe_intermediate_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4,
              "n_routed_experts": 4}
# A llama of the big size, without an MTP layer: a target for draft-model runs (vLLM re-detects a
# glm4_moe draft as its method "mtp", a llama draft stays a draft model).
LLAMA_CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], torch_dtype="float32", vocab_size=49152,
                    hidden_size=1024, num_hidden_layers=24, intermediate_size=2816, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                    max_position_embeddings=4096, tie_word_embeddings=False)
CONFIGS = {"small": BENCH_CONFIG, "big": BIG_CONFIG, "llama": LLAMA_CONFIG}
# ... and their damping: at 24 layers 0.01 leaves a two-layer draft agreeing on 37% of first drafts;
# 0.002 on 88% (28 of 32 greedy positions, mlx-lm, 2026-11-27).
DAMP = {"small": BENCH_MTP, "big": dict(damp=0.002), "llama": dict(damp=0.002)}


def add_mtp_layer(out: Path, seed: int = 3, damp: float = 0.1, noise: float = 0.003, mix: float = 0.05,
                  copies: bool = False, spread: float = 0.05) -> str:
    """`out` (model.safetensors + config.json of n + 1 layers) made a checkpoint of n layers and an MTP layer.
    Any family whose MTP layer is its own decoder block with these tensors beside it (GLM-4.5's, DeepSeek-V3's
    layout). copies: the layer also carries copies of the embedding and LM head (`embed_tokens`,
    `shared_head.head`), as DeepSeek-V3's checkpoints do. An MLX-quantized checkpoint's quantized matrices
    are left undamped. spread: the MTP layer's norm weights' deviation from 1 (their shape matters where
    a pass reads the pass before's normed rows: DeepSeek-V3's chaining)."""
    import mlx.core as mx

    weights = mx.load(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    n, hidden = config["num_hidden_layers"] - 1, config["hidden_size"]
    rng = np.random.default_rng(seed + 1)
    p = f"model.layers.{n}."
    for name in list(weights):
        if ("o_proj" in name or "down_proj" in name) and name.endswith("weight") \
                and mx.issubdtype(weights[name].dtype, mx.floating):
            weights[name] = weights[name] * damp
    if copies:
        weights[p + "embed_tokens.weight"] = weights["model.embed_tokens.weight"]
        weights[p + "shared_head.head.weight"] = weights["lm_head.weight"]
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        weights[p + norm + ".weight"] = mx.array((1 + spread * rng.standard_normal(hidden)).astype(np.float32))
    eh = np.concatenate([np.eye(hidden), mix * rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)], axis=1)
    weights[p + "eh_proj.weight"] = mx.array((eh + noise * rng.standard_normal(eh.shape)).astype(np.float32))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    config.update(num_hidden_layers=n, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return str(out)


def damp_blocks(out: Path, damp: float) -> None:
    import mlx.core as mx

    weights = mx.load(str(out / "model.safetensors"))
    mx.save_safetensors(str(out / "model.safetensors"), {
        k: v * damp if ("o_proj" in k or "down_proj" in k) and k.endswith("weight") else v
        for k, v in weights.items()})


def build(out: Path, tokenizer_dir: str, config: dict = BENCH_CONFIG, seed: int = 0, **mtp) -> str:
    """A random-weight checkpoint of `config` (mlx-lm's own classes) with an MTP layer (add_mtp_layer's `mtp`)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    marker = {"config": config, "seed": seed, "mtp": mtp}  # what was built (built again when it changes)
    if (out / "config.json").exists() and json.loads((out / "config.json").read_text()).get("mtp_build") == marker:
        return str(out)
    with_mtp = config["model_type"] == "glm4_moe"  # (other families: the damping only)
    full = {**config, "num_hidden_layers": config["num_hidden_layers"] + with_mtp}
    model_class, args_class = _get_classes(full)
    model = model_class(args_class.from_dict(full))
    rng = np.random.default_rng(seed)
    params = {}
    for name, value in tree_flatten(model.parameters()):
        if value.ndim >= 2:  # unit-variance activations; peaked logits
            w = rng.standard_normal(value.shape) / np.sqrt(value.shape[-1])
            params[name] = mx.array((w * (4.0 if "embed_tokens" in name or "lm_head" in name else 1.0)).astype(np.float32))
        else:
            params[name] = value + mx.array(0.05 * rng.standard_normal(value.shape).astype(np.float32))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), params)
    (out / "config.json").write_text(json.dumps(full, indent=1))
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_dir) / name, out / name)
    if with_mtp:
        add_mtp_layer(out, **mtp)
    else:
        damp_blocks(out, mtp.get("damp", 1.0))
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**saved, "mtp_build": marker}, indent=1))
    return str(out)


if __name__ == "__main__":
    from vllm_metal.formats.default_model import ensure_default_model

    print(build(Path(sys.argv[1]), ensure_default_model()))
