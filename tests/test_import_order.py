"""The fast BLAS (the BLAS shim to numpy's OpenBLAS, and the system OpenBLAS) is
loaded before MLX whichever vllm_metal module is imported first, and
importing mlx before vllm_metal is reported loudly instead of silently
running 30-50x slower matmuls.

One fresh interpreter per package (each folder of vllm_metal, and the
top-level modules): it imports every module of the package, its first module
first, and the probe then checks the BLAS state; an interpreter costs ~3 s
(vLLM and torch imports), one per module was ~3 min of the suite."""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_metal

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the BLAS preload is Linux-only")

# Every importable module (the BLAS shim, a plain shared library beside the
# extension, looks like one to pkgutil but is not Python).
MODULES = sorted(m.name for m in pkgutil.walk_packages(vllm_metal.__path__, "vllm_metal.")
                 if not m.name.endswith("__main__") and not m.name.endswith("blas_shim"))

PROBE = """
import json, sys
import {module}
import mlx.core as mx
from vllm_metal.native import fast_blas
maps = open("/proc/self/maps").read()
print(json.dumps({{"status": list(fast_blas.status), "openblas_mapped": "libopenblas" in maps,
                  "shim_mapped": fast_blas.SHIM_NAME in maps}}))
"""


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_METAL_DEVICE="cpu")
    env.pop("VLLM_METAL_BLAS", None)
    return subprocess.run([sys.executable, "-W", "always::RuntimeWarning", "-c", code], env=env,
                          capture_output=True, text=True, timeout=300)


def test_every_module_is_covered():
    assert {"vllm_metal.native.ops", "vllm_metal.models.attention_adapter", "vllm_metal.models.loader",
            "vllm_metal.engine.worker", "vllm_metal.engine.model_runner"} <= set(MODULES)


SUBPACKAGES = {m.name for m in pkgutil.iter_modules(vllm_metal.__path__, "vllm_metal.") if m.ispkg}


def _package(module: str) -> str:
    """The folder a module belongs to ("engine" for vllm_metal.engine and vllm_metal.engine.worker)."""
    top = ".".join(module.split(".")[:2])
    return top.split(".")[1] if top in SUBPACKAGES else "(top level)"


PACKAGES: dict[str, list[str]] = {}
for _m in MODULES:
    PACKAGES.setdefault(_package(_m), []).append(_m)


def test_every_module_is_in_one_package_probe():
    assert sorted(m for mods in PACKAGES.values() for m in mods) == MODULES
    assert {"native", "models", "engine", "(top level)"} <= set(PACKAGES)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_fast_blas_whatever_is_imported_first(package):
    out = _run(PROBE.format(module=", ".join(PACKAGES[package])))
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["status"][0] and "openblas" in got["status"][0], got
    assert got["openblas_mapped"]
    assert got["shim_mapped"], got  # MLX's matmuls go to numpy's OpenBLAS through the shim


def test_mlx_before_vllm_metal_warns_loudly():
    out = _run("import mlx.core\nimport vllm_metal.native.ops\n")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "RuntimeWarning" in out.stderr and "imported before vllm_metal" in out.stderr
    assert "30-50x slower" in out.stderr
