"""How tests/metal treats a missing tool (clang, cmake): a skip with the reason
on a developer's machine, a failure in CI (CI set), where setup installs it."""

from __future__ import annotations

import os

import pytest


def tool_missing(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so this is a setup error, not a skip)")
    pytest.skip(reason)
