"""benchmarks/served_malloc.py: a benchmark process re-executes itself on the
malloc a served engine gets, for the device the platform would pick when
VLLM_METAL_DEVICE is unset (MLX's CPU device off Apple silicon)."""

from __future__ import annotations

import importlib

import pytest

from vllm_metal import activation
from vllm_metal.native.allocator import find_tcmalloc


class Reexec(Exception):
    pass


def run(monkeypatch, apple: bool, device: str | None):
    served_malloc = importlib.import_module("served_malloc")
    for name in ("VLLM_METAL_DEVICE", "VLLM_METAL_TCMALLOC", "LD_PRELOAD", "VLLM_WORKER_MULTIPROC_METHOD"):
        monkeypatch.delenv(name, raising=False)
    if device is not None:
        monkeypatch.setenv("VLLM_METAL_DEVICE", device)
    monkeypatch.setattr(activation, "is_apple_silicon", lambda *a, **k: apple)
    monkeypatch.setattr(served_malloc.os, "uname", lambda: type("U", (), {"sysname": "Linux"})())

    def execve(path, argv, env):
        raise Reexec(env["LD_PRELOAD"])

    monkeypatch.setattr(served_malloc.os, "execve", execve)
    try:
        served_malloc.reexec()
    except Reexec as e:
        return str(e)
    return None


@pytest.mark.skipif(find_tcmalloc() is None, reason="no tcmalloc on this host")
def test_the_platforms_device_decides_without_the_variable(monkeypatch):
    # Off Apple silicon the platform runs MLX's CPU device: tcmalloc, as `vllm serve` preloads.
    assert "tcmalloc" in run(monkeypatch, apple=False, device=None)
    # On Apple silicon (the GPU) and where the GPU is named: nothing to preload.
    assert run(monkeypatch, apple=True, device=None) is None
    assert run(monkeypatch, apple=False, device="gpu") is None
    assert "tcmalloc" in run(monkeypatch, apple=True, device="cpu")
