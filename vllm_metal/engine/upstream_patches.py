"""The one place vllm-metal changes upstream behaviour at run time: four patches.

1. Targets vLLM 0.33.0 (and torch 2.14): `vllm.distributed.parallel_state.
cleanup_dist_env_and_memory`, run when the engine core shuts down, calls
`torch.accelerator.empty_cache()` / `empty_host_cache()` on every platform
whose `is_cpu()` is false, and vLLM offers no platform hook to replace those
calls. vllm-metal's platform is out-of-tree, not CPU (`is_cpu()` would route
sampling to vLLM's compiled torch.ops._C kernels, which are never loaded), and
where torch has no accelerator (Linux, MLX's CPU device) those calls can raise
("Found no NVIDIA driver" for a CUDA build of torch). vLLM's own CPU worker
replaces the same functions (v1/worker/cpu_model_runner.py). On Apple Silicon
torch sees MPS as its accelerator, and nothing is replaced.

2. `/v1/load_lora_adapter` (and `--lora-modules`) answers every engine error
but "not found" with HTTP 500; an adapter this plugin refuses (a bad file, a
rank above --max-lora-rank, ...) is the client's error: 400 (patch_lora_load_status).

3. vLLM 0.33 dropped its GGUF support: `--model x.gguf` fails config
detection ("no config.json"), and a tokenizer cannot be loaded from the file.
`EngineArgs.create_model_config` is wrapped (patch_gguf_model_args) so that a
GGUF model (a file, or a directory holding one and no config.json) is parsed
by vllm-metal's registered config parser (config_format "gguf", a public vLLM
extension point: formats/gguf_vllm.py) and, without --tokenizer, tokenized by
the GGUF's own vocabulary converted once to a tokenizer directory.

4. An image URL the server cannot reach (no route, DNS failure, connection
refused, timeout) is answered 500 by vLLM 0.33 (`vllm.multimodal.media.
connector._wrap_media_fetch_error` keeps network errors "transient"). The
URL is the client's input, and a Mac serving offline never reaches it: 422,
naming the URL and the alternatives (a data: URL, or a file: URL under
--allowed-local-media-path) (patch_media_fetch_status).

tests/engine/test_upstream_patches.py fails when vLLM's code stops doing what
each patch answers, so the patches are re-examined on upgrades.
"""

from __future__ import annotations

TARGETS = ("empty_cache", "synchronize", "empty_host_cache")
UPSTREAM = "vllm==0.33.0: vllm.distributed.parallel_state.cleanup_dist_env_and_memory"


def _noop(*args, **kwargs) -> None:
    return None


def patch_torch_accelerator() -> list[str]:
    """Makes torch.accelerator's cache/sync calls no-ops when torch has no
    accelerator. Returns the names replaced (empty when there is one)."""
    import torch

    if torch.accelerator.is_available():
        return []
    for name in TARGETS:
        setattr(torch.accelerator, name, _noop)
    return list(TARGETS)


# vllm==0.33.0: OpenAIServingModels.load_lora_adapter (/v1/load_lora_adapter
# and --lora-modules) answers every engine error but "not found" with HTTP 500
# InternalServerError. An adapter vllm-metal refuses (adapters/adapter_files.py:
# its message starts with REFUSED) is the client's bad input: 400, same message.
LORA_UPSTREAM = "vllm==0.33.0: vllm.entrypoints.openai.models.serving.OpenAIServingModels.load_lora_adapter"


def patch_lora_load_status() -> bool:
    """Maps load_lora_adapter's 500 for a refused adapter to 400. Returns
    whether it patched now (False: already patched)."""
    from http import HTTPStatus

    from vllm.entrypoints.openai.models import serving

    from vllm_metal.adapters.adapter_files import REFUSED

    cls = serving.OpenAIServingModels
    original = cls.load_lora_adapter
    if getattr(original, "_vllm_metal_patched", False):
        return False

    async def load_lora_adapter(self, request, base_model_name=None):
        result = await original(self, request, base_model_name)
        error = getattr(result, "error", None)
        if error is not None and error.code == HTTPStatus.INTERNAL_SERVER_ERROR and REFUSED in error.message:
            return serving.create_error_response(message=error.message, err_type="BadRequestError",
                                                 status_code=HTTPStatus.BAD_REQUEST)
        return result

    load_lora_adapter._vllm_metal_patched = True
    load_lora_adapter.__wrapped__ = original
    cls.load_lora_adapter = load_lora_adapter
    return True


GGUF_UPSTREAM = "vllm==0.33.0: vllm.engine.arg_utils.EngineArgs.create_model_config (no GGUF detection)"


def patch_gguf_model_args() -> bool:
    """Routes a GGUF --model to the "gguf" config parser and its own
    tokenizer. Returns whether it patched now (False: already patched)."""
    from pathlib import Path

    from vllm.engine.arg_utils import EngineArgs

    from vllm_metal.formats import gguf_checkpoint, gguf_vllm

    gguf_vllm.register_config_parser()
    original = EngineArgs.create_model_config
    if getattr(original, "_vllm_metal_patched", False):
        return False

    def create_model_config(self, *args, **kwargs):
        gguf = gguf_checkpoint.find_gguf(self.model) if isinstance(self.model, str) else None
        if gguf is not None:
            config_dir = Path(self.hf_config_path or self.model).expanduser()
            if self.config_format == "auto" and not (config_dir / "config.json").exists():
                self.config_format = gguf_vllm.CONFIG_FORMAT
            given = Path(self.tokenizer).expanduser() if self.tokenizer and self.tokenizer != self.model else None
            if given is None:
                here = Path(self.model).expanduser()
                if not (here.is_dir() and gguf_vllm.has_tokenizer(here)):
                    self.tokenizer = gguf_vllm.tokenizer_dir(gguf)  # the GGUF's own vocabulary
            elif given.exists() and not (given.is_dir() and gguf_vllm.has_tokenizer(given)):
                raise ValueError(f"--tokenizer {self.tokenizer}: no tokenizer files "
                                 f"({', '.join(gguf_vllm.TOKENIZER_FILES)}) there; give the model's tokenizer "
                                 "directory, or leave --tokenizer out to use the GGUF's own vocabulary")
        return original(self, *args, **kwargs)

    create_model_config._vllm_metal_patched = True
    create_model_config.__wrapped__ = original
    EngineArgs.create_model_config = create_model_config
    return True


MEDIA_UPSTREAM = "vllm==0.33.0: vllm.multimodal.media.connector._wrap_media_fetch_error (network errors stay 500)"


def patch_media_fetch_status() -> bool:
    """Network errors fetching a media URL become VLLMUnprocessableEntityError
    (HTTP 422). Returns whether it patched now (False: already patched)."""
    import asyncio

    import aiohttp

    from vllm.exceptions import VLLMUnprocessableEntityError
    from vllm.multimodal.media import connector

    original = connector._wrap_media_fetch_error
    if getattr(original, "_vllm_metal_patched", False):
        return False

    def wrap(url, exc):
        wrapped = original(url, exc)
        if wrapped is exc and isinstance(exc, (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError)):
            return VLLMUnprocessableEntityError(
                f"Failed to fetch media from URL: the server cannot reach it ({type(exc).__name__}: {exc}); send "
                "the image inline as a data: URL, or as a file: URL under --allowed-local-media-path",
                parameter="image_url", value=url)
        return wrapped

    wrap._vllm_metal_patched = True
    wrap.__wrapped__ = original
    connector._wrap_media_fetch_error = wrap
    return True
