"""vllm-metal: a vLLM platform plugin that serves LLMs on Apple Silicon with MLX.

Importing this package is cheap and imports no MLX: vLLM imports it in every
process to call `register()`. The primitives live in `vllm_metal.ops`.
"""

from __future__ import annotations

__version__ = "0.1.0"


def register() -> str | None:
    """vLLM platform-plugin entry point (group `vllm.platform_plugins`).

    Returns the platform class path when this host should use the plugin,
    else None. Cheap, idempotent, and never imports MLX.
    """
    from vllm_metal.activation import platform_class_if_active

    return platform_class_if_active()
