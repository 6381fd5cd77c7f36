"""Decides, without importing MLX, whether the plugin should take over vLLM.

Active on macOS on Apple Silicon (arm64) when MLX's Metal backend is
installed; on any other host only with the explicit opt-in
VLLM_METAL_DEVICE=cpu, so a normal vLLM install is never hijacked.
"""

from __future__ import annotations

import importlib.util
import platform
import sys

from vllm_metal import envs

PLATFORM_CLASS = "vllm_metal.platform.MetalPlatform"


def is_apple_silicon(system: str | None = None, machine: str | None = None) -> bool:
    system = system if system is not None else sys.platform
    machine = machine if machine is not None else platform.machine()
    return system == "darwin" and machine == "arm64"


def activation_reason(system: str | None = None, machine: str | None = None,
                      device: str | None = None, has_mlx: bool | None = None) -> tuple[bool, str]:
    """(active, why). Arguments default to the real host; tests fake them."""
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
    return False, "not Apple Silicon and VLLM_METAL_DEVICE=cpu not set"


def platform_class_if_active() -> str | None:
    active, _ = activation_reason()
    return PLATFORM_CLASS if active else None
