"""Decides, without importing MLX, whether the plugin should take over vLLM.

Active on macOS on Apple Silicon (arm64) when MLX's Metal backend is
installed; on any other host with the explicit opt-in VLLM_METAL_DEVICE=cpu,
or by itself on MLX's CPU device where none of vLLM's own platforms (CUDA,
ROCm, TPU, XPU, its CPU build) claims the host -- where vLLM alone would stop
with "Failed to infer device type". A host one of them serves is never
taken from it: vLLM prefers a plugin over its own platforms, so the plugin
asks theirs first.
"""

from __future__ import annotations

import importlib.util
import platform
import sys

from vllm_metal import envs

PLATFORM_CLASS = "vllm_metal.engine.platform.MetalPlatform"


def is_apple_silicon(system: str | None = None, machine: str | None = None) -> bool:
    system = system if system is not None else sys.platform
    machine = machine if machine is not None else platform.machine()
    return system == "darwin" and machine == "arm64"


def other_platforms() -> list[str]:
    """vLLM's own platforms that claim this host, asked as vLLM asks them
    (`vllm.platforms.builtin_platform_plugins`; one that fails to answer
    claims nothing, as in vLLM)."""
    try:
        from vllm.platforms import builtin_platform_plugins
    except ImportError:  # no vLLM: nothing to take a host from
        return []
    claimed = []
    for name, detect in builtin_platform_plugins.items():
        try:
            if detect() is not None:
                claimed.append(name)
        except Exception:  # noqa: BLE001 -- vLLM treats a failing detector as absent
            pass
    return claimed


def activation_reason(system: str | None = None, machine: str | None = None,
                      device: str | None = None, has_mlx: bool | None = None,
                      others: list[str] | None = None) -> tuple[bool, str]:
    """(active, why). Arguments default to the real host; tests fake them.
    `others`: vLLM's own platforms claiming the host (asked only when it matters)."""
    device = (device if device is not None else (envs.get("VLLM_METAL_DEVICE") or "")).strip().lower()
    if has_mlx is None:
        has_mlx = importlib.util.find_spec("mlx") is not None
    if device not in ("", "gpu", "cpu"):
        return False, f"VLLM_METAL_DEVICE={device!r} is not one of 'gpu', 'cpu'"
    if not has_mlx:
        return False, "MLX is not installed"
    if is_apple_silicon(system, machine):
        return True, f"Apple Silicon host, MLX device {device or 'gpu'}"
    if device == "cpu":
        return True, "VLLM_METAL_DEVICE=cpu opt-in on a non-Apple host (MLX CPU device)"
    if device == "gpu":
        return False, "VLLM_METAL_DEVICE=gpu on a host without Apple Silicon (MLX has no Metal here)"
    others = other_platforms() if others is None else others
    if others:
        return False, (f"vLLM's own {'/'.join(others)} platform serves this host (VLLM_METAL_DEVICE=cpu "
                       "would use MLX's CPU device instead)")
    return True, ("no vLLM platform claims this host (not Apple Silicon, no CUDA/ROCm/TPU/XPU, not vLLM's CPU "
                  "build): MLX's CPU device (VLLM_METAL_DEVICE=cpu says so explicitly)")


def platform_class_if_active() -> str | None:
    active, _ = activation_reason()
    return PLATFORM_CLASS if active else None
