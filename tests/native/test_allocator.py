"""tcmalloc for the served engine's process (vllm_metal/native/allocator.py):
the decision in every case it distinguishes, and what it writes into the
environment. tests/engine/test_serve.py checks a real `vllm serve` engine
process runs on it."""

from __future__ import annotations

import os

import pytest

from vllm_metal.native import allocator

LIB = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


@pytest.fixture
def found(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: LIB)


@pytest.mark.parametrize("env, system, device, why", [
    ({}, "Darwin", "gpu", "not on Darwin"),
    ({}, "Darwin", "cpu", "not on Darwin"),
    ({}, "Linux", "gpu", "not on MLX's CPU device"),
    ({"VLLM_METAL_TCMALLOC": "0"}, "Linux", "cpu", "VLLM_METAL_TCMALLOC=0"),
    ({"LD_PRELOAD": "/opt/libjemalloc.so.2"}, "Linux", "cpu", "already names jemalloc"),
    ({"LD_PRELOAD": "/x/libfoo.so:/y/libtcmalloc.so.4"}, "Linux", "cpu", "already names tcmalloc"),
    ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, "Linux", "cpu", "runs in this process"),
    ({"VLLM_WORKER_MULTIPROC_METHOD": "fork"}, "Linux", "cpu", "VLLM_WORKER_MULTIPROC_METHOD=fork"),
])
def test_left_alone(found, env, system, device, why):
    decided = allocator.plan(env, system, device)
    assert decided.library is None
    assert why in decided.reason


def test_preloaded_on_linux_cpu(found):
    decided = allocator.plan({}, "Linux", "cpu")
    assert decided.library == LIB and "spawned" in decided.reason
    # vLLM's own spawn choice (set for several ranks) does not change it.
    assert allocator.plan({"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}, "Linux", "cpu").library == LIB
    for on in ("auto", "1", "on", "yes"):
        assert allocator.plan({"VLLM_METAL_TCMALLOC": on}, "Linux", "cpu").library == LIB


def test_no_library_says_how_to_get_one(monkeypatch):
    monkeypatch.setattr(allocator, "CANDIDATES", ("/nonexistent/libtcmalloc_minimal.so.4",))
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: None)
    decided = allocator.plan({}, "Linux", "cpu")
    assert decided.library is None and "libtcmalloc-minimal4" in decided.reason


def test_a_path_is_used_and_a_missing_one_refused(tmp_path):
    lib = tmp_path / "libtcmalloc_custom.so"
    lib.write_bytes(b"")
    assert allocator.plan({"VLLM_METAL_TCMALLOC": str(lib)}, "Linux", "cpu").library == str(lib)
    for bad in (str(tmp_path / "missing.so"), "sometimes"):
        with pytest.raises(ValueError, match="VLLM_METAL_TCMALLOC=.*" + bad.split("/")[-1]):
            allocator.plan({"VLLM_METAL_TCMALLOC": bad}, "Linux", "cpu")
    # Not Linux: a path is still checked (a typo is not ignored), then left alone.
    with pytest.raises(ValueError):
        allocator.plan({"VLLM_METAL_TCMALLOC": str(tmp_path / "missing.so")}, "Darwin", "gpu")


def test_configure_prepends_and_is_idempotent(found, monkeypatch):
    monkeypatch.setattr(allocator.platform, "system", lambda: "Linux")
    env = {"LD_PRELOAD": "/opt/libother.so"}
    decided = allocator.configure_engine_process("cpu", env)
    assert decided.library == LIB
    assert env == {"LD_PRELOAD": f"{LIB}:/opt/libother.so", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    again = allocator.configure_engine_process("cpu", env)
    assert again.library is None and env["LD_PRELOAD"] == f"{LIB}:/opt/libother.so"
    untouched = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    allocator.configure_engine_process("cpu", untouched)
    assert untouched == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.mark.skipif(allocator.find_tcmalloc() is None, reason="no tcmalloc on this host")
def test_engine_allocator_reads_the_process():
    import subprocess
    import sys

    code = "from vllm_metal.native.allocator import engine_allocator; print(engine_allocator())"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert plain.stdout.strip() == "glibc malloc"
    env["LD_PRELOAD"] = allocator.find_tcmalloc()
    preloaded = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert preloaded.stdout.strip().startswith("tcmalloc (") and "libtcmalloc" in preloaded.stdout


def test_the_test_workers_run_on_tcmalloc_and_what_they_start_does_not():
    """scripts/test.sh preloads tcmalloc into the test workers (VLLM_METAL_TEST_TCMALLOC names
    it); tests/conftest.py takes it out of their environment, so a server or script a test
    starts gets the allocator a user's would."""
    import subprocess
    import sys

    lib = os.environ.get("VLLM_METAL_TEST_TCMALLOC", "")
    if not lib or lib == "0":
        pytest.skip("not run by scripts/test.sh with tcmalloc (VLLM_METAL_TEST_TCMALLOC unset or 0)")
    assert os.path.realpath(lib) in open("/proc/self/maps").read()
    assert lib not in os.environ.get("LD_PRELOAD", "").split(":")
    child = subprocess.run([sys.executable, "-c", "print(open('/proc/self/maps').read())"], capture_output=True,
                           text=True, check=True, timeout=60)
    assert "libtcmalloc" not in child.stdout
