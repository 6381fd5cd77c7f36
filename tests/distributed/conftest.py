"""Fixtures for the tensor/pipeline-parallel tests (vllm_metal/distributed/).

The engines here start vLLM's multiprocess executor: one spawned worker
process per rank, MLX's ring over loopback (or network namespaces: the
multi-host tests). The tiny family models and engine helpers are the
shared tests' (tests/families.py, tests/engine_helpers.py).
"""

from __future__ import annotations

