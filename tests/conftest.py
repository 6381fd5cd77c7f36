"""Shared fixtures and helpers' home (tests/ is on sys.path: array_helpers,
numpy_reference, engine_helpers, families, server_helpers, model_variants).
Importing vllm_metal.native.ops first gives MLX the fast BLAS.

Engines in tests run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so
tests can look at the runner's instrumentation; `vllm serve` tests start a
real server subprocess instead.
"""

from __future__ import annotations

import os
import zlib

os.environ.setdefault("VLLM_METAL_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import pytest

from vllm_metal.native import ops  # noqa: F401  (must precede any other mlx import)


# The longest test files, longest first (`scripts/test.sh` prints the slowest tests). With
# pytest-xdist's --dist loadfile each file runs whole on one worker, in collection order: started
# first, the long files overlap the many short ones instead of running alone at the end.
LONG_FILES = (
    "tests/install/test_vllm_empty_route.py",
    "tests/speculative/test_engine_speculation.py",
    "tests/speculative/test_mtp.py",
    "tests/speculative/test_gemma4_assistant.py",
    "tests/speculative/test_deepseek_mtp.py",
    "tests/speculative/test_qwen_mtp.py",
    "tests/speculative/test_eagle3.py",
    "tests/models/test_model_families.py",
    "tests/distributed/test_engines.py",
    "tests/reliability/test_option_fuzz.py",
    "tests/reliability/test_soak.py",
    "tests/engine/test_golden.py",
    "tests/distributed/test_multi_host.py",
    "tests/engine/test_serve.py",
    "tests/engine/test_prompt_logprobs.py",
    "tests/pooling/test_pooling_families.py",
    "tests/multimodal/test_images.py",
    "tests/multimodal/test_serve_images.py",
)


def pytest_configure(config):
    """scripts/test.sh runs the test workers on tcmalloc (LD_PRELOAD); each process that runs
    tests takes it back out of its environment, so the processes a test starts (servers, ranks,
    scripts) start as a user's would. xdist's controller keeps it: it starts the workers."""
    lib = os.environ.get("VLLM_METAL_TEST_TCMALLOC", "")
    controller = config.getoption("dist", "no") != "no" and not hasattr(config, "workerinput")
    if lib and lib != "0" and not controller:
        kept = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p and p != lib]
        if kept:
            os.environ["LD_PRELOAD"] = ":".join(kept)
        else:
            os.environ.pop("LD_PRELOAD", None)


def pytest_collection_modifyitems(config, items):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    missing = [f for f in LONG_FILES if not os.path.exists(os.path.join(root, f))]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py LONG_FILES names missing files: {missing}")
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(LONG_FILES)))  # stable


@pytest.fixture(scope="module", autouse=True)
def _release_between_files():
    """Each test file leaves the worker as it found it: upstream caches keyed by model path
    emptied, garbage collected, freed heap returned (see engine_helpers.release_upstream_caches).
    Without it two xdist workers grew to 8-10 GB each and one was OOM-killed."""
    yield
    from engine_helpers import release_free_memory, release_upstream_caches, upstream_caches_hold_entries

    if upstream_caches_hold_entries():  # an engine or server config was built in this process
        release_upstream_caches()
    else:
        release_free_memory()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """The embedded default model (SmolLM2-135M-Instruct): its GGUF with config and
    tokenizer beside it, built once per session (served straight from the GGUF)."""
    from vllm_metal.formats.default_model import ensure_default_model

    return ensure_default_model(str(tmp_path_factory.mktemp("model") / "SmolLM2-135M-Instruct"))


@pytest.fixture(scope="session")
def mlx_model_dir(model_dir, tmp_path_factory) -> str:
    """The default model's weights as an MLX-format directory (model.safetensors),
    for references that read only that format (mlx-lm's own loader)."""
    from vllm_metal.formats.default_model import export_mlx

    return export_mlx(model_dir, tmp_path_factory.mktemp("model-mlx") / "SmolLM2-135M-Instruct")


@pytest.fixture
def rng(request):
    # A stable seed per test id: failures reproduce.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
