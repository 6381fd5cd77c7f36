"""Fixtures of the Metal backend tests: the MSL executor, built once per
session (`rng` comes from tests/conftest.py)."""

from __future__ import annotations

import sys

import pytest

import msl_executor
from metal_tools import tool_missing


@pytest.fixture(scope="session")
def executor() -> msl_executor.Executor:
    if sys.platform != "linux":
        pytest.skip("the MSL executor is the Linux stand-in for an Apple GPU; on a Mac, "
                    "test_paged_attention_gpu.py runs the kernels on the GPU itself")
    try:
        return msl_executor.Executor(msl_executor.build())
    except msl_executor.ExecutorUnavailable as e:
        tool_missing(str(e))
