"""Fixtures for the vLLM plugin tests: the embedded model, in-process engines.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so tests
can look at the runner's instrumentation; `vllm serve` tests start a real
server subprocess instead.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_METAL_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from vllm_metal.default_model import ensure_default_model  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    return ensure_default_model(str(tmp_path_factory.mktemp("model") / "SmolLM2-135M-Instruct"))
