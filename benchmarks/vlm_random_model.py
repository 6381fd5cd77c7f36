"""A random-weight Qwen2.5-VL-3B-shaped checkpoint for the image benchmark
(the Hugging Face Hub is unreachable here), laid out as the published
Qwen/Qwen2.5-VL-3B-Instruct is (transformers 4.4x names: `visual.*`,
`model.layers.*`, text fields at the top of config.json, rope_scaling
{"type": "mrope"}), which every peer reads: vLLM's CPU backend, mlx-vlm and
vllm-metal. float32, safetensors shards of at most 2 GiB.

Shapes are the 3B's (text: 36 layers, hidden 2048, 16 heads / 2 KV heads of
128, MLP 11008, vocabulary 151,936, tied head; vision: 32 blocks of 1280, 16
heads, MLP 3420, window 112 px, full attention in blocks 7/15/23/31, 2x2
merger to 2048). The tokenizer is the embedded SmolLM2 one with Qwen's
vision tokens (tests/vlm_models.py), and the image processor keeps
Qwen2.5-VL's own pixel bounds (3,136 .. 12,845,056 pixels: a 1024x1024 image
is 1,369 image tokens, 448x448 is 256). Timing depends on the shapes only.

    python benchmarks/vlm_random_model.py OUT_DIR   # prints OUT_DIR
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TEXT = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
            num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
            rope_theta=1000000.0, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
            tie_word_embeddings=True, hidden_act="silu", sliding_window=32768, use_sliding_window=False,
            max_window_layers=70, attention_dropout=0.0)
VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_chans=3, in_channels=3,
              out_hidden_size=2048, patch_size=14, spatial_merge_size=2, spatial_patch_size=14,
              temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2,
              hidden_act="silu")
MIN_PIXELS, MAX_PIXELS = 3136, 12845056  # Qwen2.5-VL's processor defaults
SHARD_BYTES = 2 << 30


def tensor_shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, published names, shapes."""
    t, v = TEXT, VISION
    h, kv = t["hidden_size"], t["num_key_value_heads"] * (t["hidden_size"] // t["num_attention_heads"])
    shapes = {"model.embed_tokens.weight": (t["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(t["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (t["intermediate_size"], h), p + "mlp.up_proj.weight": (t["intermediate_size"], h),
            p + "mlp.down_proj.weight": (h, t["intermediate_size"])})
    e, m = v["hidden_size"], v["intermediate_size"]
    shapes["visual.patch_embed.proj.weight"] = (e, 3, v["temporal_patch_size"], v["patch_size"], v["patch_size"])
    for i in range(v["depth"]):
        p = f"visual.blocks.{i}."
        shapes.update({
            p + "norm1.weight": (e,), p + "norm2.weight": (e,),
            p + "attn.qkv.weight": (3 * e, e), p + "attn.qkv.bias": (3 * e,),
            p + "attn.proj.weight": (e, e), p + "attn.proj.bias": (e,),
            p + "mlp.gate_proj.weight": (m, e), p + "mlp.gate_proj.bias": (m,),
            p + "mlp.up_proj.weight": (m, e), p + "mlp.up_proj.bias": (m,),
            p + "mlp.down_proj.weight": (e, m), p + "mlp.down_proj.bias": (e,)})
    merged = e * v["spatial_merge_size"] ** 2
    shapes.update({"visual.merger.ln_q.weight": (e,), "visual.merger.mlp.0.weight": (merged, merged),
                   "visual.merger.mlp.0.bias": (merged,), "visual.merger.mlp.2.weight": (v["out_hidden_size"], merged),
                   "visual.merger.mlp.2.bias": (v["out_hidden_size"],)})
    return shapes


def draw(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Unit-variance activations: matrices at std 1/sqrt(fan_in) (the tied
    embedding 4x: peaked logits), norms 1, biases small."""
    if len(shape) >= 2:
        w = rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(math.prod(shape[1:])))
        return w * np.float32(4.0) if "embed_tokens" in name else w
    if name.endswith("norm.weight") or "layernorm" in name or name.endswith(("norm1.weight", "norm2.weight",
                                                                            "ln_q.weight")):
        return np.ones(shape, np.float32)
    return (0.02 * rng.standard_normal(shape)).astype(np.float32)


def build(out: Path, seed: int = 0) -> Path:
    sys.path.insert(0, str(HERE.parent / "tests"))
    import vlm_models
    from safetensors.numpy import save_file

    from vllm_metal.formats.default_model import ensure_default_model

    out = Path(out)
    if (out / "config.json").exists() and (out / "model.safetensors.index.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tiny = vlm_models.build_qwen2_5_vl(out / "_tiny", ensure_default_model(str(out / "_tokenizer")), seed=seed)
    tiny_config = json.loads((tiny / "config.json").read_text())
    for f in tiny.iterdir():  # tokenizer, chat template, processor, generation config
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    processor = json.loads((out / "processor_config.json").read_text())
    processor["image_processor"]["size"] = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    ids = {k: tiny_config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                       "vision_end_token_id")}
    text = tiny_config["text_config"]
    config = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
              "torch_dtype": "float32", **TEXT, **ids, "bos_token_id": text["bos_token_id"],
              "eos_token_id": text["eos_token_id"], "vision_config": VISION}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    rng = np.random.default_rng(seed)
    shard, size, weight_map, n = {}, 0, {}, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            n += 1
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for name, shape in tensor_shapes().items():
        w = draw(name, shape, rng)
        if size + w.nbytes > SHARD_BYTES:
            flush()
        shard[name], size = w, size + w.nbytes
    flush()
    total = sum(4 * math.prod(s) for s in tensor_shapes().values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    shutil.rmtree(out / "_tiny")
    shutil.rmtree(out / "_tokenizer", ignore_errors=True)
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
