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
