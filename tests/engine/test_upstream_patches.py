"""vllm_metal/engine/upstream_patches.py: the one run-time change to upstream
behaviour, checked against the vLLM code that makes it necessary."""

from __future__ import annotations

import inspect

import pytest
import torch

from vllm_metal import versions
from vllm_metal.engine import upstream_patches


def test_targets_the_pinned_vllm():
    assert upstream_patches.UPSTREAM.startswith(f"vllm=={versions.VLLM}:")


def test_vllm_shutdown_still_calls_what_the_patch_replaces():
    # Fails when vLLM changes its shutdown path: re-examine the patch then
    # (a public platform hook may have appeared, or other calls).
    from vllm.distributed import parallel_state

    source = inspect.getsource(parallel_state.cleanup_dist_env_and_memory)
    assert "current_platform.is_cpu()" in source
    assert "torch.accelerator.empty_cache()" in source
    assert "torch.accelerator.empty_host_cache()" in source
    from vllm.platforms.interface import Platform

    assert not any(hasattr(Platform, name) for name in ("empty_cache", "empty_host_cache")), \
        "vLLM now has a platform hook for the accelerator cache: use it instead of the patch"


def _keep_originals(monkeypatch):
    for name in upstream_patches.TARGETS:
        monkeypatch.setattr(torch.accelerator, name, getattr(torch.accelerator, name))


def test_patch_only_without_an_accelerator(monkeypatch):
    _keep_originals(monkeypatch)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)  # e.g. MPS on a Mac
    before = {n: getattr(torch.accelerator, n) for n in upstream_patches.TARGETS}
    assert upstream_patches.patch_torch_accelerator() == []
    assert {n: getattr(torch.accelerator, n) for n in upstream_patches.TARGETS} == before

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert upstream_patches.patch_torch_accelerator() == list(upstream_patches.TARGETS)
    for name in upstream_patches.TARGETS:
        assert getattr(torch.accelerator, name)() is None


def test_cleanup_runs_with_the_patch(monkeypatch):
    # vLLM's own shutdown cleanup, on this platform, with the patch: no error.
    _keep_originals(monkeypatch)
    monkeypatch.setenv("VLLM_METAL_DEVICE", "cpu")
    from vllm.distributed import parallel_state

    if torch.accelerator.is_available():
        pytest.skip("torch has an accelerator here: nothing is patched")
    upstream_patches.patch_torch_accelerator()
    parallel_state.cleanup_dist_env_and_memory()


# ---- LoRA load errors: 400 for an adapter vllm-metal refuses ---------------------

def test_lora_patch_targets_the_pinned_vllm_and_its_500():
    # Fails when vLLM changes how load_lora_adapter answers an engine error:
    # re-examine the patch then (it may answer client errors as 4xx itself).
    from vllm.entrypoints.openai.models import serving

    assert upstream_patches.LORA_UPSTREAM.startswith(f"vllm=={versions.VLLM}:")
    original = getattr(serving.OpenAIServingModels.load_lora_adapter, "__wrapped__",
                       serving.OpenAIServingModels.load_lora_adapter)
    source = inspect.getsource(original)
    assert "await self.engine_client.add_lora(lora_request)" in source
    assert 'err_type="InternalServerError"' in source and "HTTPStatus.INTERNAL_SERVER_ERROR" in source


@pytest.mark.parametrize("message,status", [
    ("Call to add_lora method failed: vllm-metal cannot serve LoRA adapter 'x' at /p: rank 32 is above "
     "--max-lora-rank 16", 400),
    ("Call to add_lora method failed: something else broke", 500),
])
def test_lora_patch_maps_only_refusals_to_400(message, status, monkeypatch):
    import asyncio

    from vllm.entrypoints.openai.models import serving
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    cls = serving.OpenAIServingModels
    monkeypatch.setattr(cls, "load_lora_adapter", getattr(cls.load_lora_adapter, "__wrapped__",
                                                          cls.load_lora_adapter))
    assert upstream_patches.patch_lora_load_status() and not upstream_patches.patch_lora_load_status()

    class Engine:
        async def add_lora(self, request):
            raise RuntimeError(message)

    models = object.__new__(cls)
    models.engine_client, models.lora_requests = Engine(), {}
    models.lora_id_counter = serving.AtomicCounter(0)
    models.lora_resolver_lock = serving.defaultdict(asyncio.Lock)
    models.registry = type("R", (), {"is_base_model": lambda self, name: False})()
    result = asyncio.run(models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name="x", lora_path="/p")))
    assert result.error.code == status
    assert message.split("failed: ")[1] in result.error.message
    assert models.lora_requests == {}


def test_gguf_patch_targets_the_pinned_vllm_without_gguf_support():
    # Fails when vLLM detects GGUF models again: re-examine the patch then.
    from vllm.engine.arg_utils import EngineArgs
    from vllm.transformers_utils import config as vllm_config

    from vllm_metal.formats.default_model import gguf_path

    assert upstream_patches.GGUF_UPSTREAM.startswith(f"vllm=={versions.VLLM}:")
    assert "gguf" not in inspect.getsource(vllm_config.get_config).lower()
    create = getattr(EngineArgs.create_model_config, "__wrapped__", EngineArgs.create_model_config)
    with pytest.raises(Exception, match="Invalid repository ID or local directory"):
        create(EngineArgs(model=str(gguf_path())))


def test_gguf_patch_routes_a_gguf_model_to_its_parser(tmp_path, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_metal.formats.default_model import gguf_path

    monkeypatch.setenv("VLLM_METAL_CACHE_DIR", str(tmp_path))
    upstream_patches.patch_gguf_model_args()
    assert upstream_patches.patch_gguf_model_args() is False  # idempotent
    config = EngineArgs(model=str(gguf_path()), max_model_len=512).create_model_config()
    assert config.architectures == ["LlamaForCausalLM"] and config.hf_config.num_key_value_heads == 3
    assert config.tokenizer.startswith(str(tmp_path / "gguf-tokenizers"))
    with pytest.raises(ValueError, match="no tokenizer files"):  # a --tokenizer without a tokenizer
        EngineArgs(model=str(gguf_path()), tokenizer=str(tmp_path)).create_model_config()


def _connection_error():
    import aiohttp

    from types import SimpleNamespace

    key = SimpleNamespace(host="example.invalid", port=80, ssl=True)
    return aiohttp.ClientConnectorError(connection_key=key, os_error=OSError(-2, "Name or service not known"))


def test_media_patch_targets_the_pinned_vllm_and_its_500():
    # Fails when vLLM answers an unreachable media URL as a client error itself:
    # the patch can go then.
    from vllm.multimodal.media import connector

    assert upstream_patches.MEDIA_UPSTREAM.startswith(f"vllm=={versions.VLLM}:")
    original = getattr(connector._wrap_media_fetch_error, "__wrapped__", connector._wrap_media_fetch_error)
    exc = _connection_error()
    assert original("http://example.invalid/a.png", exc) is exc  # left as is: HTTP 500
    assert "_wrap_media_fetch_error(url, e)" in inspect.getsource(connector.MediaConnector.load_from_url_async)


def test_media_patch_maps_network_errors_to_422(monkeypatch):
    import aiohttp
    from vllm.exceptions import VLLMUnprocessableEntityError
    from vllm.multimodal.media import connector

    original = getattr(connector._wrap_media_fetch_error, "__wrapped__", connector._wrap_media_fetch_error)
    monkeypatch.setattr(connector, "_wrap_media_fetch_error", original)
    assert upstream_patches.patch_media_fetch_status() and not upstream_patches.patch_media_fetch_status()
    wrapped = connector._wrap_media_fetch_error("http://example.invalid/a.png", _connection_error())
    assert isinstance(wrapped, VLLMUnprocessableEntityError)
    assert "http://example.invalid/a.png" in str(wrapped.value) and "data: URL" in str(wrapped)
    # what vLLM already answers stays its answer: a 404 is 422, a 503 stays 503
    not_found = aiohttp.ClientResponseError(None, (), status=404)
    assert isinstance(connector._wrap_media_fetch_error("u", not_found), VLLMUnprocessableEntityError)
    unavailable = aiohttp.ClientResponseError(None, (), status=503)
    assert connector._wrap_media_fetch_error("u", unavailable) is unavailable
