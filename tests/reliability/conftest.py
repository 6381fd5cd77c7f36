"""Fixtures for the reliability suite: one shared `vllm serve` for the
bad-input, load, disconnect and soak tests, and the figures they report.

Sizes follow VLLM_METAL_RELIABILITY_SCALE (default 1, the CI size; e.g. 10 by
hand). Figures are printed at the end of the run and written as JSON to
$VLLM_METAL_RELIABILITY_REPORT when that is set (docs/reliability.md).
"""

from __future__ import annotations

import json
import os

import pytest
from reliability_helpers import start_server

FIGURES: dict[str, dict] = {}


@pytest.fixture(scope="session")
def figures():
    """figures[test_name] = {measure: value}; reported at the end of the run."""
    return FIGURES


@pytest.fixture(scope="package")
def server(model_dir, tmp_path_factory):
    """The default server (256 MiB KV cache, max_model_len 2048), shared by
    every test that does not need its own configuration: starting one costs
    ~15 s of the suite's budget."""
    log = tmp_path_factory.mktemp("reliability") / "vllm_serve.log"
    with start_server(model_dir, log) as srv:
        yield srv
        assert srv.alive(), f"the shared server died; log: {log}"


def pytest_terminal_summary(terminalreporter):
    if not FIGURES:
        return
    terminalreporter.section("reliability figures")
    for name, values in FIGURES.items():
        terminalreporter.write_line(f"{name}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    path = os.environ.get("VLLM_METAL_RELIABILITY_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(FIGURES, f, indent=1)
