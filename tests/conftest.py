"""Shared fixtures. Importing vllm_metal.ops first gives MLX the fast BLAS."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from vllm_metal import ops  # noqa: F401  (must precede any other mlx import)


@pytest.fixture
def rng(request):
    # A stable seed per test id: failures reproduce.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
