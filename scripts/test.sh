#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k paged). The ten slowest
# tests are listed at the end of every run.
#
# Two pytest-xdist workers, each test file on one worker (--dist loadfile:
# module-scoped engines and models stay shared within a file): on a 2-core
# machine the suite's many waits (engine and server start-ups, subprocesses,
# timeouts) overlap with the other worker's compute. VLLM_METAL_TEST_WORKERS=0
# runs it in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Tests that need a tool (clang, cmake) fail rather than skip when it is missing.
export CI=${CI:-1}
workers=${VLLM_METAL_TEST_WORKERS:-2}
parallel=()
# --no-loadscope-reorder: files in collection order (tests/conftest.py puts the longest first)
# instead of xdist's order by test count.
[[ "$workers" != "0" ]] && parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
# (${a[@]+...}: bash 3.2, macOS's, calls an empty array unbound under set -u.)
exec .venv/bin/python -m pytest tests -q -ra --durations=10 ${parallel[@]+"${parallel[@]}"} "$@"
