"""vllm-metal: a vLLM platform plugin that serves LLMs on Apple Silicon with MLX.

Importing this package is cheap and imports no MLX: vLLM imports it in every
process to call `register()`. The primitives live in `vllm_metal.ops`.
"""

from __future__ import annotations

import os

__version__ = "0.1.0"


def register() -> str | None:
    """vLLM platform-plugin entry point (group `vllm.platform_plugins`).

    Returns the platform class path when this host should use the plugin,
    else None. Cheap, idempotent, and never imports MLX.
    """
    from vllm_metal import activation, envs

    platform_class = activation.platform_class_if_active()
    if platform_class is None:
        return None
    try:
        import vllm.envs as vllm_envs
    except ImportError:  # called outside vLLM: nothing to tell it
        pass
    else:
        # Known to vLLM, so it does not warn about unknown VLLM_* variables.
        for name, getter in envs.environment_variables().items():
            vllm_envs.environment_variables.setdefault(name, getter)
    if activation.is_apple_silicon():
        # Forking after Metal / Objective-C initialised crashes the child.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    return platform_class
