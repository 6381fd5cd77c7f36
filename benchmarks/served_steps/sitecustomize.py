"""Stamps every engine step of a served vLLM (bench_serving.py --step-stamps).

On PYTHONPATH of a server started with BENCH_STEP_STAMPS=<file>, Python imports
this module at start-up in each of the server's processes; it wraps vLLM's
`Scheduler.update_from_output` (which receives each step's SchedulerOutput
once the step's output is back) so that the engine process appends one line a
step to the file: "pid wall_time scheduled_tokens rows decode_rows". A step's
time is then the gap since the previous stamp, whether the engine overlaps
steps or not (benchmarks/step_kinds.py). Benchmark instrumentation only: vLLM's
code is unchanged, and without the variable nothing is imported or wrapped.
"""

from __future__ import annotations

import os
import sys
import time


def install(cls, path: str) -> None:
    """Wraps cls.update_from_output (vLLM's Scheduler) to stamp each step into `path`."""
    inner = cls.update_from_output

    def update_from_output(self, scheduler_output, *args, **kwargs):
        out = inner(self, scheduler_output, *args, **kwargs)
        tokens = scheduler_output.num_scheduled_tokens
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {time.time():.6f} {scheduler_output.total_num_scheduled_tokens} "
                    f"{len(tokens)} {sum(1 for n in tokens.values() if n == 1)}\n")
        return out

    update_from_output.__wrapped__ = inner
    cls.update_from_output = update_from_output


if os.environ.get("BENCH_STEP_STAMPS"):
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError as e:  # not a vLLM process: nothing to stamp
        print(f"served_steps: not stamping ({e})", file=sys.stderr)
    else:
        install(Scheduler, os.environ["BENCH_STEP_STAMPS"])
