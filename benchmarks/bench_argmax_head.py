"""The greedy head's cost by row count: ops.argmax_head with and without the
head's bfloat16 screen (docs/primitives.md#the-bfloat16-screen), on a
SmolLM2-135M-shaped head (49,152 x 576, float32) and a Llama-3-8B-shaped
one (128,256 x 4,096), random weights and hidden rows; the screen's own
build on this CPU (screen_build: AVX-512 BF16 or AVX2). Without the screen
ops.argmax_head takes MLX's matmul + argmax below 8 rows (OpenBLAS's
matrix-vector product) and the ArgmaxHead kernel from 8; with it, the
screened kernel up to the build's max_rows. Wall clock, the fastest of
interleaved rounds, the load average before and after.

    .venv/bin/python benchmarks/bench_argmax_head.py --json benchmarks/results/argmax_head/<host>.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from datetime import datetime, timezone

from vllm_metal.native import greedy_head, ops  # first: gives MLX the fast BLAS

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

HEADS = {"SmolLM2-135M (49,152 x 576)": (49152, 576), "Llama-3-8B (128,256 x 4,096)": (128256, 4096)}
ROWS = (1, 2, 4, 7, 8, 16)
ROUNDS = 5


def _meta() -> dict:
    def run(*cmd):
        return subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(__file__)).stdout.strip()

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                commit=run("git", "rev-parse", "--short", "HEAD")
                + ("+dirty" if run("git", "status", "--porcelain", "--untracked-files=no") else ""),
                cpu=cpu, cores=os.cpu_count(), variant=ops._ext.cpu_attention_variant(),
                screen=greedy_head.screen_build(), load_before=os.getloadavg()[0])


def measure(reps: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows_out = []
    for name, (vocab, dim) in HEADS.items():
        w = mx.array((rng.standard_normal((vocab, dim)) / np.sqrt(dim)).astype(np.float32))
        screen = ops.argmax_head_screen(w)
        if screen is None:
            raise SystemExit("no screen on this CPU (greedy_head.screen_build() is empty): nothing to compare")
        for rows in ROWS:
            h = mx.array(rng.standard_normal((rows, dim)).astype(np.float32))
            calls = {"exact": lambda: ops.argmax_head(h, w), "screened": lambda: ops.argmax_head(h, w, screen=screen)}
            assert calls["exact"]().tolist() == calls["screened"]().tolist()
            best = dict.fromkeys(calls, float("inf"))
            for _ in range(ROUNDS):  # interleaved: both see the same machine
                for key, fn in calls.items():
                    mx.eval(fn())
                    t = time.perf_counter()
                    for _ in range(reps):
                        mx.eval(fn())
                    best[key] = min(best[key], (time.perf_counter() - t) / reps * 1e3)
            screened = rows <= (screen.max_rows or rows)
            rows_out.append(dict(head=name, rows=rows, exact_ms=best["exact"], screened_ms=best["screened"],
                                 screen_used=screened))
            print(f"{name:30s} rows {rows:3d}: exact {best['exact']:7.2f} ms, with the screen "
                  f"{best['screened']:7.2f} ms{'' if screened else ' (past max_rows: the exact kernel)'}")
    return rows_out


def render(report: dict) -> str:
    """The table of a raw file, in Markdown (benchmarks/summaries.py's `_script`)."""
    m = report["meta"]
    lines = [f"{m['date']}, vllm-metal at `{m['commit']}`, {m['cpu']} ({m['cores']} cores), {m['variant']} kernels, "
             f"the screen's {m['screen']} build; milliseconds per call, wall clock, the fastest of {ROUNDS} "
             f"interleaved rounds (load average {m['load_before']:.1f} before, {m['load_after']:.1f} after).", "",
             "| head | rows | without the screen (ms) | with it (ms) | speed-up |", "|---|---:|---:|---:|---:|"]
    for r in report["rows"]:
        note = "" if r["screen_used"] else " (exact kernel)"
        lines.append(f"| {r['head']} | {r['rows']} | {r['exact_ms']:.2f} | {r['screened_ms']:.2f}{note} | "
                     f"{r['exact_ms'] / r['screened_ms']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write the raw results here")
    args = ap.parse_args()
    meta = _meta()
    rows = measure(args.reps)
    meta["load_after"] = os.getloadavg()[0]
    report = dict(meta=meta, rows=rows)
    print(render(report))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
