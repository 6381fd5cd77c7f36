"""tcmalloc for the engine process on Linux (MLX's CPU device).

A decode step on MLX's CPU device makes thousands of small allocations (MLX
arrays, their descriptors and task closures, Python objects). glibc's malloc
spends ~20% of the graph-building thread's time in its slow paths there
(`_int_malloc`, `malloc_consolidate`, `unlink_chunk`: perf of batch-1 decode
steps, docs/benchmarks.md#allocator), and on two cores busy with the step's
kernels that time comes straight off the step. tcmalloc's per-thread caches do not:
measured with the same code, a batch-8 decode step 71-80 -> 66-68 ms and a
1024-token prefill ~4% faster; served at concurrency 1, TPOT 36.0 -> 33.3 ms.
glibc's own knobs (`mallopt` thresholds) measured no faster.

The allocator cannot be swapped inside a running process, so this works as
vLLM's CPU platform does for its own tcmalloc: `check_and_update_config`
(in the API server's process, before the engine process starts) puts the
library into LD_PRELOAD and has the engine process spawned (a forked child
keeps its parent's malloc). Only where it helps and is safe:

- Linux and MLX's CPU device (macOS: Apple's malloc and Metal; untouched);
- an engine in its own process (VLLM_ENABLE_V1_MULTIPROCESSING on, vLLM's
  default): an in-process engine is already running on its allocator;
- not when LD_PRELOAD already names an allocator (tcmalloc, jemalloc,
  mimalloc: the user's choice stands), nor when the user asked for
  VLLM_WORKER_MULTIPROC_METHOD=fork (kept; the log says tcmalloc is unused).

VLLM_METAL_TCMALLOC: 'auto' (default; also '1', 'on', 'true', 'yes') uses
the first library found in `CANDIDATES` (Debian's libtcmalloc-minimal4,
which scripts/setup.sh installs); '0' ('off', 'false', 'no') never; a path
uses that file (refused if it is not there, like any other value).
`engine_allocator()` says what the current process runs on (doctor, the
worker's start-up line).
"""

from __future__ import annotations

import ctypes.util
import os
import platform
from dataclasses import dataclass

from vllm_metal import envs

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)
# LD_PRELOAD entries that already replace malloc: left as the user set them.
ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


@dataclass(frozen=True)
class PreloadPlan:
    """What to set in the environment the engine process starts with:
    `library` prepended to LD_PRELOAD and VLLM_WORKER_MULTIPROC_METHOD=spawn,
    or nothing (`library` None) for the reason given."""

    library: str | None
    reason: str


def find_tcmalloc() -> str | None:
    for path in CANDIDATES:
        if os.path.exists(path):
            return path
    name = ctypes.util.find_library("tcmalloc_minimal")
    return name if name and os.path.isabs(name) and os.path.exists(name) else None


def plan(environ: dict | os._Environ, system: str, device: str) -> PreloadPlan:
    """The decision, from the environment, the OS name (platform.system())
    and the MLX device ("cpu" or "gpu"); raises ValueError for a
    VLLM_METAL_TCMALLOC it cannot honour."""
    choice = (envs.get("VLLM_METAL_TCMALLOC", environ) or "auto").strip()
    if choice.lower() in ("0", "off", "false", "no"):
        return PreloadPlan(None, "off (VLLM_METAL_TCMALLOC=0)")
    if choice.lower() not in ("auto", "1", "on", "true", "yes"):
        if not os.path.isfile(choice):
            raise ValueError(f"VLLM_METAL_TCMALLOC={choice!r}: no such file; use 'auto', '0' or the path of "
                             "a tcmalloc library (libtcmalloc_minimal.so.4)")
        library = choice
    else:
        library = None
    if system != "Linux":
        return PreloadPlan(None, f"not on {system} (Linux only)")
    if device != "cpu":
        return PreloadPlan(None, "not on MLX's CPU device")
    preload = environ.get("LD_PRELOAD", "")
    present = [a for a in ALLOCATORS if a in preload]
    if present:
        return PreloadPlan(None, f"LD_PRELOAD already names {present[0]} ({preload})")
    if (environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") or "1").strip().lower() in ("0", "false"):
        return PreloadPlan(None, "the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): "
                                 "start it with LD_PRELOAD=<libtcmalloc> to use tcmalloc")
    if (environ.get("VLLM_WORKER_MULTIPROC_METHOD") or "").strip() == "fork":
        return PreloadPlan(None, "VLLM_WORKER_MULTIPROC_METHOD=fork: a forked engine keeps this "
                                 "process's malloc (unset it, or start with LD_PRELOAD=<libtcmalloc>)")
    library = library or find_tcmalloc()
    if library is None:
        return PreloadPlan(None, "no tcmalloc found (Debian: apt install libtcmalloc-minimal4; "
                                 "scripts/setup.sh installs it)")
    return PreloadPlan(library, f"{library} preloaded into the engine process (spawned)")


def preload_into(environ, library: str) -> None:
    """Puts `library` first in environ's LD_PRELOAD (the processes started
    with that environment load it before libc's malloc)."""
    preload = environ.get("LD_PRELOAD", "")
    environ["LD_PRELOAD"] = library + (":" + preload if preload else "")


def configure_engine_process(device: str, environ=None) -> PreloadPlan:
    """Applies `plan` for MLX device `device` to `environ` (os.environ): what
    vllm-metal's platform calls before vLLM starts the engine process.
    Idempotent (a second call finds tcmalloc in LD_PRELOAD)."""
    environ = os.environ if environ is None else environ
    decided = plan(environ, platform.system(), device)
    if decided.library is not None:
        preload_into(environ, decided.library)
        environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    return decided


def engine_allocator() -> str:
    """'tcmalloc (<path>)' when the current process runs on a preloaded
    tcmalloc, else 'glibc malloc' (read from /proc/self/maps on Linux)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libtcmalloc" in line:
                    return f"tcmalloc ({line.split()[-1]})"
    except OSError:
        return "the system's malloc"
    return "glibc malloc"
