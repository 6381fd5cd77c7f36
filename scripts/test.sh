#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k paged).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Tests that need a tool (clang, cmake) fail rather than skip when it is missing.
export CI=${CI:-1}
exec .venv/bin/python -m pytest tests -q -ra "$@"
