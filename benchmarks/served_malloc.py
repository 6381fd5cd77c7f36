"""Run a benchmark process on the malloc a served vllm-metal engine runs on.

`vllm serve` on Linux's CPU device preloads tcmalloc into its engine process
(vllm_metal/native/allocator.py); a benchmark that runs the runner or the
engine in its own process re-executes itself once with the same LD_PRELOAD,
so it measures what a server would (the tiny llama in-process at concurrency
64: 5,150 tok/s on glibc's malloc, 6,300-7,000 on tcmalloc; docs/benchmarks.md).
VLLM_METAL_TCMALLOC=0: glibc's malloc. Where vllm_metal is not installed (vLLM
CPU's venv, whose caller preloads what vLLM's CPU docs ask) nothing happens.
"""

from __future__ import annotations

import os
import sys


def reexec() -> None:
    """Re-executes this process with the served engine's LD_PRELOAD when it lacks it; returns otherwise."""
    try:
        from vllm_metal import activation
        from vllm_metal.native import allocator
    except ImportError:
        return
    # An in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) is planned for as a spawned
    # engine would be; the device as the platform decides it, without importing vLLM.
    environ = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    device = (os.environ.get("VLLM_METAL_DEVICE") or "").strip().lower()
    if device not in ("gpu", "cpu"):  # as the platform decides (engine/platform.py's mlx_device_name)
        device = "gpu" if activation.is_apple_silicon() else "cpu"
    plan = allocator.plan(environ, os.uname().sysname, device)
    if plan.library is not None:
        env = dict(os.environ)
        allocator.preload_into(env, plan.library)
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
