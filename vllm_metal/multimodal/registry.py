"""Which vision-language checkpoints serve images, and how each one's
vision side loads: the tower (in this package), where its tensors are, how
its images' tokens sit in the text model (M-RoPE positions, prefix-LM
attention, embedding scale), and how vLLM's processed image (its
MultiModalKwargsItem) becomes the tower's input.

The text model is the mlx-lm family that serves the checkpoint text-only
(models/registry.py); only the image tokens' embeddings, positions and
attention change. Each family is proven by tests/multimodal against
transformers' forward on the same weights and processed inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from vllm_metal.multimodal import vit
from vllm_metal.multimodal.mrope import MRopeSpec


@dataclass(frozen=True)
class VisionFamily:
    notes: str
    architectures: tuple[str, ...]
    prefixes: tuple[str, ...]  # the tower's tensor prefixes (old layout first, then transformers 5's)
    tower: tuple[str, ...] = ("visual.", "model.visual.")  # names that say the checkpoint holds its tower
    mrope: str = ""  # M-RoPE positions (Qwen-VL): "sections" or "interleaved" (its checkpoints' layout)
    prefix_lm: bool = False  # image tokens attend to their whole image (Gemma 3)


VISION: dict[str, VisionFamily] = {
    "qwen2_5_vl": VisionFamily(
        "windowed ViT (2-D RoPE, RMSNorm, SwiGLU; full-attention blocks), 2x2 patch merger, dynamic resolution",
        ("Qwen2_5_VLForConditionalGeneration",), ("visual.", "model.visual."), mrope="sections"),
    "qwen3_5": VisionFamily(
        "ViT with learned positions interpolated to the image's grid, 2-D RoPE, LayerNorm, GELU MLP (no windows, no "
        "deepstack), 2x2 patch merger, dynamic resolution; the hybrid (Gated DeltaNet) text model",
        ("Qwen3_5ForConditionalGeneration",), ("visual.", "model.visual."), mrope="interleaved"),
    "gemma3": VisionFamily(
        "SigLIP (learned positions, LayerNorm, tanh-GELU) at a fixed size, average-pooled to mm_tokens_per_image "
        "tokens, RMSNorm (1 + w) projector", ("Gemma3ForConditionalGeneration",),
        ("", "model."), tower=("vision_tower.", "model.vision_tower."), prefix_lm=True),
}


def has_tower(model_dir, family: VisionFamily) -> bool:
    """Whether the checkpoint holds its vision tower's tensors (a checkpoint
    converted for text only may declare the multimodal architecture without
    them: its text model is what can be served)."""
    try:
        names = vit.tensor_names(model_dir)
    except (OSError, ValueError):
        return False
    return any(n.startswith(family.tower) for n in names)


def vision_family(config: dict) -> VisionFamily | None:
    """The checkpoint's vision family, or None (text-only, or a multimodal
    architecture whose images are not served)."""
    return VISION.get(config.get("model_type"))


class VisionModel:
    """A checkpoint's vision side: `encode` maps vLLM's processed images (one
    dict of tensors per item) to each item's embeddings in the text model's
    input space (lazy)."""

    def __init__(self, model_type: str, config: dict, tower, dtype: mx.Dtype, embed_scale: float = 1.0):
        self.model_type = model_type
        # vLLM's mm_device_do_normalize (on by default for Qwen-VL): the
        # processor leaves pixels raw (0..255) and the model rescales and
        # normalizes them per channel, x * weight[c] + bias[c] (set_pixel_norm).
        self.pixel_norm: tuple[np.ndarray, np.ndarray] | None = None
        self.family = VISION[model_type]
        self.config = config
        self.tower = tower
        self.dtype = dtype
        # The text model multiplies its input embeddings by this (Gemma); an
        # image's embeddings are divided by it so they enter unscaled.
        self.embed_scale = embed_scale
        self.mrope = (MRopeSpec(tuple(int(x) for x in _mrope_section(config)), _interleaved(config),
                                int(config["vision_config"].get("spatial_merge_size", 2)))
                      if self.family.mrope else None)

    @property
    def image_token_id(self) -> int:
        c = self.config
        return int(c.get("image_token_id", c.get("image_token_index", -1)))

    def encode(self, items: list[dict]) -> list[mx.array]:
        """vLLM's MultiModalKwargsItem data (name -> torch tensor) of some
        images -> one [tokens, hidden] array per image, lazy."""
        if not items:
            return []
        if self.model_type == "gemma3":
            crops = [np.asarray(_numpy(i["pixel_values"]), np.float32) for i in items]
            out = self.tower(np.concatenate(crops))
            out = out.reshape(-1, out.shape[-1])
            sizes = np.cumsum([len(c) * self.tower.mm_tokens for c in crops])[:-1].tolist()
            parts = mx.split(out, sizes) if sizes else [out]
        else:
            pixels = np.concatenate([np.asarray(_numpy(i["pixel_values"]), np.float32) for i in items])
            if self.pixel_norm is not None:  # [patches, channels * rest]: per-channel affine, float32
                weight, bias = self.pixel_norm
                shaped = pixels.reshape(pixels.shape[0], len(weight), -1)
                pixels = (shaped * weight[None, :, None] + bias[None, :, None]).reshape(pixels.shape)
            grids = [tuple(int(x) for x in np.asarray(_numpy(i["image_grid_thw"])).reshape(-1)) for i in items]
            parts = self.tower(pixels, grids)
        if self.embed_scale != 1.0:
            parts = [p / self.embed_scale for p in parts]
        return [p.astype(self.dtype) for p in parts]


def pixel_norm(processor_config: dict) -> tuple[np.ndarray, np.ndarray]:
    """(weight, bias) per channel that turn raw pixels into the processor's
    normalized ones: rescale_factor / std and -mean / std (vLLM's
    mm_input_norm resolves the same fields the same way)."""
    c = processor_config.get("image_processor", processor_config)
    has = "image_mean" in c and "image_std" in c
    rescale = float(c.get("rescale_factor", 1 / 255)) if c.get("do_rescale", has) else 1.0
    normalize = c.get("do_normalize", has)
    mean = np.asarray(c.get("image_mean") if normalize else [0.0] * 3, np.float64)
    std = np.asarray(c.get("image_std") if normalize else [1.0] * 3, np.float64)
    return (rescale / std).astype(np.float32), (-mean / std).astype(np.float32)


def _numpy(x):
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def _rope_parameters(config: dict) -> dict:
    text = config.get("text_config") or config
    return text.get("rope_parameters") or text.get("rope_scaling") or config.get("rope_scaling") or {}


def _mrope_section(config: dict) -> list[int]:
    section = _rope_parameters(config).get("mrope_section")
    if not section or len(section) != 3:
        raise ValueError(f"{config.get('model_type')}: the text config has no 3-part mrope_section")
    return section


def _interleaved(config: dict) -> bool:
    return bool(_rope_parameters(config).get("mrope_interleaved", False))


def load_vision(model_dir: str | Path, config: dict, dtype: mx.Dtype) -> VisionModel:
    """The vision side of the checkpoint in `model_dir` (config: its
    config.json), its tensors read and cast to `dtype`."""
    model_type = config.get("model_type")
    family = VISION.get(model_type)
    if family is None:
        raise NotImplementedError(f"vllm-metal serves no images for model type {model_type!r} (served: "
                                  f"{', '.join(sorted(VISION))})")
    if model_type == "gemma3":
        from vllm_metal.multimodal.gemma3 import Gemma3VisionTower

        weights = _both(model_dir, family.prefixes, dtype)
        tower = Gemma3VisionTower(config, weights, dtype)
        hidden = int(config["text_config"]["hidden_size"])
        # mlx-lm's gemma3_text scales by sqrt(hidden) rounded to bfloat16
        scale = float(np.array(mx.array(hidden ** 0.5, mx.bfloat16).astype(mx.float32)))
        return VisionModel(model_type, config, tower, dtype, embed_scale=scale)
    from vllm_metal.multimodal.qwen2_5_vl import Qwen25VisionTower
    from vllm_metal.multimodal.qwen3_vl import Qwen3VisionTower

    weights = vit.read_tensors(model_dir, family.prefixes, dtype)
    tower = (Qwen3VisionTower if model_type == "qwen3_5" else Qwen25VisionTower)(config, weights, dtype)
    return VisionModel(model_type, config, tower, dtype)


def _both(model_dir, prefixes, dtype) -> dict:
    """Gemma 3's two parts (tower, projector), under one of the layouts."""
    for p in prefixes:
        try:
            tower = vit.read_tensors(model_dir, (p + "vision_tower.",), dtype)
            projector = vit.read_tensors(model_dir, (p + "multi_modal_projector.",), dtype)
        except KeyError:
            continue
        # SigLIP's tensors sit under `vision_model.` in Gemma 3's released checkpoints, directly in transformers 5's
        tower = {k.removeprefix("vision_model."): v for k, v in tower.items()}
        return {**{"vision_tower." + k: v for k, v in tower.items()},
                **{"multi_modal_projector." + k: v for k, v in projector.items()}}
    raise KeyError(f"{model_dir}: no vision_tower.* / multi_modal_projector.* tensors (Gemma 3's vision side)")


def markdown_table() -> str:
    """docs/models.md's vision-language table (regenerate: python -m vllm_metal.multimodal.registry)."""
    lines = ["| model_type | architectures | images | text positions / attention | vision tower |",
             "|---|---|---|---|---|"]
    for name in sorted(VISION):
        f = VISION[name]
        positions = (f"M-RoPE (t, h, w), {f.mrope}" if f.mrope
                     else "1-D; image tokens attend to their whole image" if f.prefix_lm else "1-D")
        lines.append(f"| `{name}` | {', '.join(f'`{a}`' for a in f.architectures)} | served; video, audio "
                     f"refused | {positions} | {f.notes} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
