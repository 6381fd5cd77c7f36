"""Prints the requirements of the installed vLLM that vllm-metal needs.

On a Mac vLLM is built for the empty target (scripts/install_vllm_empty.sh)
and installed with --no-deps, and this prints what it declares, less what is
skipped below. On Linux vLLM's wheel is its CUDA build: its metadata pins CUDA kernel packages
(FlashInfer, TileLang, CUTLASS DSL, ...) that never load on this platform, and
at times a pin the package index cannot satisfy yet. scripts/setup.sh installs
vLLM itself with --no-deps and then exactly the lines this prints (binary
wheels only), so nothing is built from source and nothing CUDA-only is
downloaded beyond what torch itself needs. `python scripts/vllm_requirements.py
--check` lists what is skipped and why (tests/engine/test_vllm_version.py
checks the installed vLLM still matches these tables).
"""

from __future__ import annotations

import sys
from importlib import metadata

# Requirement name (normalized) -> why vllm-metal never needs it.
SKIPPED: dict[str, str] = {
    "flashinfer-python": "CUDA attention/sampling kernels",
    "apache-tvm-ffi": "FlashInfer's CUDA JIT runtime",
    "tilelang": "CUDA kernel DSL",
    "nvidia-cudnn-frontend": "cuDNN (CUDA)",
    "nvtx": "CUDA profiler ranges",
    "nvidia-cutlass-dsl": "CUTLASS CUDA kernels",
    "quack-kernels": "CUDA kernels",
    "tokenspeed-mla": "CUDA MLA kernels",
    "humming-kernels": "CUDA kernels",
    "pynvvideocodec": "NVIDIA video decoding",
    "fastsafetensors": "GPU-direct weight loading (weights load through MLX)",
    "instanttensor": "GPU-direct weight loading (weights load through MLX)",
    # Media towers for multimodal models; their Linux builds do not load
    # against a torch they were not built with and break transformers' imports.
    # (torchvision is kept, pinned to vLLM's build for its torch: resolving
    # Qwen3.5's architectures imports it; vllm_metal/versions.py.)
    "torchaudio": "audio models (not served)",
    "torchcodec": "video/audio decoding (not served)",
}

# Requirement name -> (replacement requirement, why). Pins the package index
# cannot satisfy; the replacement is what was verified to work.
RELAXED: dict[str, tuple[str, str]] = {
    "certifi": ("certifi", "vLLM 0.33.0 pins certifi>=2026.10.19, newer than the index's newest "
                           "certifi; it is only a CA bundle"),
}


def _name(requirement: str) -> str:
    head = requirement.split(";")[0].strip()
    for sep in "<>=!~[ (":
        head = head.split(sep)[0]
    return head.strip().lower().replace("_", "-")


def requirements(dist: str = "vllm") -> tuple[list[str], list[str]]:
    """(lines to install, lines skipped) from the installed `dist`'s metadata,
    without extras and evaluated for this interpreter and platform."""
    from packaging.requirements import Requirement

    keep, skipped = [], []
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = _name(line)
        if name in SKIPPED:
            skipped.append(line)
        elif name in RELAXED:
            keep.append(RELAXED[name][0])
        else:
            keep.append(str(req).split(";")[0].strip())
    return keep, skipped


def main(argv: list[str]) -> int:
    keep, skipped = requirements()
    if "--check" in argv:
        for line in skipped:
            print(f"skipped  {line}  ({SKIPPED[_name(line)]})")
        for name, (_, why) in RELAXED.items():
            print(f"relaxed  {name}  ({why})")
        return 0
    print("\n".join(keep))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
