"""The one place vllm-metal changes upstream behaviour at run time.

Targets vLLM 0.33.0 (and torch 2.14): `vllm.distributed.parallel_state.
cleanup_dist_env_and_memory`, run when the engine core shuts down, calls
`torch.accelerator.empty_cache()` / `empty_host_cache()` on every platform
whose `is_cpu()` is false, and vLLM offers no platform hook to replace those
calls. vllm-metal's platform is out-of-tree, not CPU (`is_cpu()` would route
sampling to vLLM's compiled torch.ops._C kernels, which are never loaded), and
where torch has no accelerator (Linux, MLX's CPU device) those calls can raise
("Found no NVIDIA driver" for a CUDA build of torch). vLLM's own CPU worker
replaces the same functions (v1/worker/cpu_model_runner.py). On Apple Silicon
torch sees MPS as its accelerator, and nothing is replaced.

tests/engine/test_upstream_patches.py fails when vLLM's shutdown stops
calling these functions this way, so the patch is re-examined on upgrades.
"""

from __future__ import annotations

TARGETS = ("empty_cache", "synchronize", "empty_host_cache")
UPSTREAM = "vllm==0.33.0: vllm.distributed.parallel_state.cleanup_dist_env_and_memory"


def _noop(*args, **kwargs) -> None:
    return None


def patch_torch_accelerator() -> list[str]:
    """Makes torch.accelerator's cache/sync calls no-ops when torch has no
    accelerator. Returns the names replaced (empty when there is one)."""
    import torch

    if torch.accelerator.is_available():
        return []
    for name in TARGETS:
        setattr(torch.accelerator, name, _noop)
    return list(TARGETS)
