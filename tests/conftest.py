"""Shared fixtures and helpers' home (tests/ is on sys.path: array_helpers,
numpy_reference, engine_helpers, families, server_helpers, model_variants).
Importing vllm_metal.native.ops first gives MLX the fast BLAS.

Engines in tests run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so
tests can look at the runner's instrumentation; `vllm serve` tests start a
real server subprocess instead.
"""

from __future__ import annotations

import os
import zlib

os.environ.setdefault("VLLM_METAL_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import pytest

from vllm_metal.native import ops  # noqa: F401  (must precede any other mlx import)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """The embedded default model (SmolLM2-135M-Instruct), converted once per session."""
    from vllm_metal.formats.default_model import ensure_default_model

    return ensure_default_model(str(tmp_path_factory.mktemp("model") / "SmolLM2-135M-Instruct"))


@pytest.fixture
def rng(request):
    # A stable seed per test id: failures reproduce.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
