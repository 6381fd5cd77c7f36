"""Fixtures for the tensor/pipeline-parallel tests (vllm_metal/distributed/).

The engines here start vLLM's multiprocess executor: one spawned worker
process per rank, MLX's ring over loopback (or network namespaces: the
multi-host tests). The tiny family models and engine helpers are the
plugin tests' (tests/plugin/).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_METAL_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).parent.parent / "plugin"))
