"""Shared fixtures. Importing vllm_metal.native.ops first gives MLX the fast BLAS."""

from __future__ import annotations

import zlib

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
