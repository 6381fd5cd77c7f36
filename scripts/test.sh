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
# A test that hangs fails after VLLM_METAL_TEST_TIMEOUT s (default 600; the slowest test takes
# ~2.5 min) with every thread's stack printed, and the run goes on: pytest-timeout's signal
# method fails the test in place. (Its thread method ends the worker instead, and xdist's
# --dist loadfile then hands the same file, hung test first, to each replacement worker: measured,
# nine times over.) A worker that crashes (the OOM killer) is replaced at most twice. And the
# whole run stops (SIGINT: pytest prints what was running) after VLLM_METAL_SUITE_LIMIT s
# (default 75 min, under CI's 90), where `timeout` exists (macOS has none by default).
# The test workers run on tcmalloc where scripts/setup.sh installed it (Linux), as a served
# engine's process does (vllm_metal/native/allocator.py): the in-process test engines make the
# same churn of small allocations, and glibc's malloc spent ~20% of an engine-heavy file's CPU in
# its slow paths (measured: the family-parity file's 16-family slice 58.6 -> 39.5 s).
# tests/conftest.py takes it back out of LD_PRELOAD in each worker, so the processes the tests
# start (servers, ranks, scripts) get what a user's would. VLLM_METAL_TEST_TCMALLOC=0: glibc.
tcmalloc=""
if [[ "${VLLM_METAL_TEST_TCMALLOC:-1}" != "0" && "$(uname -s)" == "Linux" && "${LD_PRELOAD:-}" != *malloc* ]]; then
  tcmalloc=$(.venv/bin/python -c "from vllm_metal.native.allocator import find_tcmalloc; print(find_tcmalloc() or '')")
fi
if [[ -n "$tcmalloc" ]]; then
  export LD_PRELOAD="$tcmalloc${LD_PRELOAD:+:$LD_PRELOAD}"
fi
export VLLM_METAL_TEST_TCMALLOC="${tcmalloc:-0}"  # what conftest.py takes out again (0: nothing)
guard=(--timeout="${VLLM_METAL_TEST_TIMEOUT:-600}" --timeout-method=signal)
[[ "$workers" != "0" ]] && guard+=(--max-worker-restart=2)
limit=()
command -v timeout >/dev/null && limit=(timeout --signal=INT --kill-after=120 "${VLLM_METAL_SUITE_LIMIT:-4500}")
# (${a[@]+...}: bash 3.2, macOS's, calls an empty array unbound under set -u.)
exec ${limit[@]+"${limit[@]}"} .venv/bin/python -m pytest tests -q -ra --durations=10 "${guard[@]}" \
  ${parallel[@]+"${parallel[@]}"} "$@"
