"""What vLLM's configuration asks of the multimodal side, and the vision
side built for a loaded text model.

A checkpoint serves images when its family is in multimodal/registry.py and
vLLM's multimodal config allows images (not --language-model-only, image
limit above 0). Video and audio are refused at start when asked for (their
limit above 0), naming the modality; a multimodal checkpoint whose images are
not served keeps being served text-only as vLLM's --language-model-only.
"""

from __future__ import annotations

import mlx.core as mx
from vllm.logger import init_logger

from vllm_metal.multimodal.registry import VISION, has_tower, load_vision, pixel_norm, vision_family
from vllm_metal.multimodal.step import MultimodalStep

logger = init_logger("vllm." + __name__)


def configure(model, scheduler, parallel=None) -> bool:
    """vLLM's model config of a multimodal architecture (`model`, a
    ModelConfig whose is_multimodal_model is true) and its scheduler config,
    set for what this plugin serves. Returns whether images are served.

    Images served (the family is in multimodal/registry.py and the user did
    not switch them off): other modalities the user left unset get limit 0
    (vLLM's input processing refuses them, naming the limit), one the user
    asked for is refused here; a prefix-LM family's images are never split
    across chunks (vLLM's disable_chunked_mm_input, as its CUDA platform
    forces it), since their tokens attend to each other both ways. Images
    are served by the generate runner on one rank: a pooling runner or
    tensor / pipeline parallel serve the text model (refused when images
    are asked for).
    Otherwise the text model is served: vLLM's default limits become
    --language-model-only, a user who asked for media is refused."""
    mm = model.multimodal_config
    asked = dict(mm.limit_per_prompt or {}) if mm is not None else {}
    family = vision_family({"model_type": getattr(model.hf_config, "model_type", None)})
    if family is not None and not has_tower(model.model, family):
        family = None  # converted for text only: the multimodal architecture without its tower
    ranks = (parallel.tensor_parallel_size * parallel.pipeline_parallel_size) if parallel is not None else 1
    if family is not None and (model.runner_type == "pooling" or ranks > 1):
        family, why = None, ("the pooling runner" if model.runner_type == "pooling" else "tensor / pipeline parallel")
        if any(_count(v) for v in asked.values()):
            raise ValueError(f"vllm-metal serves the images of {model.architecture} with the generate runner on one "
                             f"rank, not with {why}: serve it text-only (--language-model-only) or drop {why}.")
    if family is not None and mm is not None and not mm.language_model_only and mm.get_limit_per_prompt("image"):
        check_limits(model.hf_config.model_type, asked)
        # vLLM's own validator turns counts into its option objects
        mm.limit_per_prompt = type(mm)._validate_limit_per_prompt(
            {m: {"count": 0} for m in ("video", "audio") if m not in asked})
        mm.limit_per_prompt.update(asked)
        if family.prefix_lm:
            scheduler.disable_chunked_mm_input = True
        return True
    if mm is not None and not any(_count(v) for v in asked.values()):
        mm.language_model_only = True
        logger.warning("vllm-metal serves the text model of %s: it runs no vision or audio encoder for it, so "
                       "prompts with images, video or audio are refused (--language-model-only says so "
                       "explicitly; images are served for: %s)", model.architecture, ", ".join(sorted(VISION)))
        return False
    if mm is not None and mm.language_model_only:
        return False
    raise ValueError(f"vllm-metal serves only the text model of {model.architecture}: it runs no vision or audio "
                     f"encoder for it (images are served for model types {', '.join(sorted(VISION))}). Serve it "
                     "text-only: --language-model-only (LLM(..., language_model_only=True)), or --limit-mm-per-prompt "
                     "with 0 for every modality (or leave it unset).")


def check_limits(model_type: str | None, limits: dict) -> None:
    """vLLM's --limit-mm-per-prompt for a checkpoint whose images are served:
    any modality other than image with a limit above 0 is refused."""
    other = sorted(m for m, v in (limits or {}).items() if m != "image" and _count(v) > 0)
    if other:
        raise ValueError(f"vllm-metal serves image inputs of {model_type} but not {', '.join(other)}: set "
                         f"--limit-mm-per-prompt '{{{', '.join(repr(m) + ': 0' for m in other)}}}' (images stay served)")


def _count(v) -> int:
    return int(v if isinstance(v, int) else getattr(v, "count", 0) or 0)


def build(model_config, loaded, dtype: mx.Dtype) -> MultimodalStep:
    """The vision tower for `loaded` (models/loaded_model.LoadedModel) of
    vLLM's `model_config`, with its attention layers set up for M-RoPE where
    the family uses it, and the pixel normalization vLLM leaves to the model
    (mm_device_do_normalize)."""
    vision = load_vision(model_config.model, loaded.config, dtype)
    if getattr(model_config.multimodal_config, "mm_device_do_normalize", False):
        from vllm.transformers_utils.processor import get_processor_config

        vision.pixel_norm = pixel_norm(get_processor_config(model_config.model, revision=model_config.revision))
    if vision.mrope is not None:
        _attach_mrope(loaded, vision)
    mx.eval([v for v in vision.tower.w.values()])
    return MultimodalStep(vision)


def _attach_mrope(loaded, vision) -> None:
    from vllm_metal.models.cpu_norm_rope import plan_rope
    from vllm_metal.models.loaded_model import decoder_owner

    for i, layer in enumerate(decoder_owner(loaded.model)["model"].layers):
        attn = getattr(layer, "self_attn", None)
        rope = attn.rope() if attn is not None and hasattr(attn, "rope") else None
        if rope is None:
            continue
        plan = plan_rope(rope, attn.rope_dims)
        if plan is None:
            raise NotImplementedError(f"{vision.model_type}: layer {i}'s RoPE is not a per-pair rotation a table "
                                      "reproduces, so M-RoPE positions cannot be applied")
        attn.mrope_plan = plan
        attn.mrope_streams = mx.array(vision.mrope.stream_of_frequency(plan.rotated // 2).astype("int32"))


def weights_bytes(step: MultimodalStep) -> int:
    """The vision tower's resident bytes (the worker's memory budget counts them beside the text model's)."""
    return sum(v.nbytes for v in step.vision.tower.w.values())


__all__ = ["VISION", "build", "check_limits", "configure", "weights_bytes"]
