"""Keeps vLLM off its CUDA-only paths on this platform.

Placeholder gate for the plugin issue; the capability-report issue extends it
into the full table of CUDA paths.
"""

from __future__ import annotations


def gate_config(vllm_config) -> None:
    if vllm_config.speculative_config is not None:
        raise ValueError("speculative decoding is not supported by vllm-metal")


def reject_attention_backend(selected_backend) -> None:
    return None
