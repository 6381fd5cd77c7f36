"""The macOS install route, proven on Linux: vLLM built for VLLM_TARGET_DEVICE=empty.

vLLM publishes no macOS wheel, and its CPU build compiles kernels the plugin never runs, so
scripts/setup.sh installs vLLM on a Mac with scripts/install_vllm_empty.sh: vLLM's sdist built
for its `empty` target, a pure-Python wheel (docs/install.md). This file runs that same script
on Linux into a scratch virtual environment and serves the embedded model through the vLLM it
installed. The script runs the patched setup.py as macOS runs it (sys.platform "darwin") before
building, so the macOS branch of vLLM's setup.py is exercised here too.

The scratch environment holds the `empty` vLLM only; the project's other packages (torch, MLX,
vllm_metal, vLLM's requirements) are seen through a .pth file that comes after its own
site-packages, so `import vllm` finds the scratch one (asserted), and the project's own vLLM
is left as it was (asserted).

The built wheel is kept in ~/.cache/vllm-metal/install-route/<vLLM pin>-<script hash>/
(VLLM_METAL_ROUTE_CACHE moves the folder): a re-run only installs it, and a change to the
script or to the pin builds it anew. Measured on the 2-core machine: cold (the sdist's download,
the build, the engine) ~2 min, warm ~1-1.5 min (the install ~30 s, the engine the rest). Cold, it
needs the package index: without it the test fails with pip's reason (it never skips).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from engine_helpers import GOLDEN

from vllm_metal.versions import VLLM

# Cold, the script downloads and builds (~1.5 min on 2 cores, more on a busy machine) first.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install_vllm_empty.sh"

CACHE_ROOT = Path(os.environ.get("VLLM_METAL_ROUTE_CACHE")
                  or Path.home() / ".cache" / "vllm-metal" / "install-route")
KEY = f"{VLLM}-{hashlib.sha256(SCRIPT.read_bytes()).hexdigest()[:12]}"
WHEEL = CACHE_ROOT / KEY / f"vllm-{VLLM}+empty-py3-none-any.whl"
COMPILED = (".so", ".dylib", ".pyd", ".dll")

# Run in the scratch environment: what it imports, from where, and the golden prompt's greedy
# tokens through vllm.LLM on the plugin.
PROBE = r"""
import importlib.metadata, importlib.util, json, os, sys
os.environ.setdefault("VLLM_METAL_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from vllm_metal.native import ops  # noqa: F401  (first: MLX's fast BLAS)
import vllm, vllm_metal
from vllm_metal.engine.platform import MetalPlatform
from vllm_metal.versions import check_vllm
from vllm.platforms import current_platform
model_dir, prompt, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
version = importlib.metadata.version("vllm")
check_vllm(version)
package = os.path.dirname(vllm.__file__)
compiled = [os.path.join(d, f) for d, _, fs in os.walk(package) for f in fs
            if f.endswith((".so", ".dylib", ".pyd", ".dll")) or f == "vllm-rs"]
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model_dir, dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20, seed=0)
out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
print("PROBE" + json.dumps({
    "vllm_file": vllm.__file__, "vllm_version": version, "vllm_metal_file": vllm_metal.__file__,
    "compiled": compiled, "has_C": importlib.util.find_spec("vllm._C") is not None,
    "platform": type(current_platform).__name__,
    "platform_is_metal": isinstance(current_platform, MetalPlatform),
    "tokens": list(out[0].outputs[0].token_ids),
}))
"""


def _site_dirs() -> list[str]:
    """This (the project's) environment's site-packages folders."""
    return list(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A fresh virtual environment that gets the `empty` vLLM through the install script; the
    project's packages come after its own. Returns its python."""
    env_dir = tmp_path_factory.mktemp("route") / "venv"
    # No pip of its own: the project's, seen through the .pth, installs into it (sys.prefix).
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    # addsitedir (not a bare path): the project's own .pth files run too (the editable vllm_metal).
    lines = "".join(f"import site; site.addsitedir({d!r})\n" for d in _site_dirs())
    (Path(own) / "zz_vllm_metal_project.pth").write_text(lines)
    # Older keys (another pin, another version of the script) go: one wheel is kept.
    if CACHE_ROOT.is_dir():
        for old in CACHE_ROOT.iterdir():
            if old.is_dir() and old.name != KEY and old.name.count("-") == 1:
                shutil.rmtree(old, ignore_errors=True)
    # PIP_NO_COMPILE: no byte-compiling of vLLM's 3,600 files at install (the probe compiles what it imports).
    env = {**os.environ, "VLLM_METAL_WHEEL_CACHE": str(WHEEL.parent), "PIP_NO_COMPILE": "1"}
    env.pop("PYTHONPATH", None)
    run = subprocess.run(["bash", str(SCRIPT), str(python), VLLM], env=env, capture_output=True, text=True,
                         timeout=900)
    if run.returncode:
        pytest.fail(f"scripts/install_vllm_empty.sh failed (rc {run.returncode}); a cold run needs the "
                    f"package index (PyPI):\n{(run.stdout + run.stderr)[-4000:]}")
    return python


@pytest.fixture(scope="module")
def probe(scratch, model_dir) -> dict:
    golden = GOLDEN[0]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([str(scratch), "-c", PROBE, model_dir, json.dumps(golden["prompt_ids"]),
                          str(len(golden["greedy_ids"]))], cwd=scratch.parent.parent, env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("PROBE")]
    assert run.returncode == 0 and lines, f"the plugin did not serve on the `empty` vLLM:\n{run.stderr[-4000:]}"
    return json.loads(lines[-1][len("PROBE"):])


def test_the_wheel_is_pure_python_built_for_the_empty_target(scratch):
    assert WHEEL.is_file(), f"no {WHEEL.name} in {WHEEL.parent}"
    with zipfile.ZipFile(WHEEL) as whl:
        names = whl.namelist()
        info = f"vllm-{VLLM}+empty.dist-info"
        wheel_meta = whl.read(f"{info}/WHEEL").decode()
        requires = [line.split(":", 1)[1].strip() for line in whl.read(f"{info}/METADATA").decode().splitlines()
                    if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert "Root-Is-Purelib: true" in wheel_meta and "Tag: py3-none-any" in wheel_meta, wheel_meta
    assert [n for n in names if n.endswith(COMPILED) or n.endswith("/vllm-rs")] == []
    assert "vllm/platforms/interface.py" in names and "vllm/v1/engine/core.py" in names
    # `empty` takes requirements/common.txt: no torch, no CUDA package.
    heavy = [r for r in requires if r.split()[0].lower().startswith(("torch", "nvidia", "flashinfer", "triton"))]
    assert requires and heavy == [], heavy


def test_vllm_is_the_scratch_envs_empty_build_with_nothing_compiled(scratch, probe):
    assert Path(probe["vllm_file"]).is_relative_to(scratch.parent.parent), probe["vllm_file"]
    assert probe["vllm_version"] == f"{VLLM}+empty"
    assert probe["compiled"] == [] and not probe["has_C"], probe["compiled"]
    # The plugin itself is the project's (its extension is the one native build).
    assert Path(probe["vllm_metal_file"]).is_relative_to(ROOT), probe["vllm_metal_file"]


def test_the_plugin_is_vllms_platform(probe):
    assert probe["platform"] == "MetalPlatform" and probe["platform_is_metal"]


def test_serves_the_golden_tokens(probe):
    # tests/engine/test_golden.py's first prompt: the same tokens as on the project's vLLM.
    assert probe["tokens"] == GOLDEN[0]["greedy_ids"]


def test_the_projects_vllm_is_left_alone(scratch):
    from importlib import metadata

    dist = metadata.distribution("vllm")
    assert "+empty" not in dist.version
    package = Path(dist.locate_file("vllm/__init__.py"))
    assert package.is_file() and not package.is_relative_to(scratch.parent.parent), package
