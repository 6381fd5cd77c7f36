"""vllm-metal: a vLLM platform plugin that serves LLMs on Apple Silicon with MLX.

Importing this package is cheap and imports no MLX: vLLM imports it in every
process to call `register()`. The primitives live in `vllm_metal.native.ops`
(`from vllm_metal import ops` still works: imported on first use).

Folders, lowest first; a module imports only from its own folder or lower
(tests/test_layout.py): this top level (envs, versions, activation), native/,
formats/, distributed/, models/, kv/, doctor/, engine/.
"""

from __future__ import annotations

import os

__version__ = "0.1.0"


def _blas_before_mlx() -> None:
    """On Linux, MLX's CPU matmuls are 30-50x faster when an optimized
    OpenBLAS is loaded before `mlx.core` (vllm_metal.native.fast_blas). Whatever
    vllm_metal module is imported first, this package runs first: it arms a
    finder that loads OpenBLAS the moment anything imports `mlx.core`, and
    costs nothing until then (vLLM imports this package in every process)."""
    import importlib.abc
    import sys

    if not sys.platform.startswith("linux") or "mlx.core" in sys.modules:
        return  # not needed / too late (vllm_metal.native.ops warns about the latter)

    class _LoadBlasBeforeMLX(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "mlx.core":
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                from vllm_metal.native import fast_blas

                fast_blas.preload()
            return None  # the normal finders import it

    if not any(type(f).__name__ == "_LoadBlasBeforeMLX" for f in sys.meta_path):
        sys.meta_path.insert(0, _LoadBlasBeforeMLX())


_blas_before_mlx()


def __getattr__(name: str):
    """`vllm_metal.ops` (the public name of vllm_metal.native.ops), imported on
    first use so that importing this package never imports MLX."""
    if name == "ops":
        import importlib

        return importlib.import_module("vllm_metal.native.ops")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    # The runner implements vLLM's V1 model-runner contract; vLLM picks its V2
    # runner wherever Triton imports, unless told otherwise.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    if activation.is_apple_silicon():
        # Forking after Metal / Objective-C initialised crashes the child.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    return platform_class
