"""The mlx_lm.server peer: its keepalive hook still exists upstream, and the wrap drops it."""

from __future__ import annotations

import inspect

import pytest

import mlx_lm_server


class _FakeGenerator:
    def generate(self, request, generation_args, progress_callback=None):
        return progress_callback


class _FakeServerModule:
    ResponseGenerator = _FakeGenerator


def test_quiet_keepalive_replaces_the_progress_callback():
    module = _FakeServerModule()
    module.ResponseGenerator = type("G", (_FakeGenerator,), {})
    mlx_lm_server.quiet_keepalive(module)
    mlx_lm_server.quiet_keepalive(module)  # idempotent: wraps once
    sent = module.ResponseGenerator().generate("req", "args", progress_callback=lambda *a: "keepalive")
    assert sent is mlx_lm_server._log_progress


def test_upstream_hook_is_what_the_wrap_targets():
    """Fails when mlx-lm changes the code the wrap relies on (written for mlx-lm 0.32.2)."""
    server = pytest.importorskip("mlx_lm.server")
    params = inspect.signature(server.ResponseGenerator.generate).parameters
    assert list(params)[:4] == ["self", "request", "generation_args", "progress_callback"]
    source = inspect.getsource(server)
    # Still streams SSE comments from the progress callback (else the wrap is unneeded)...
    assert ": keepalive" in source and "progress_callback=keepalive_callback" in source
    # ...and the entry point the wrapper calls is still there.
    assert callable(server.main)
