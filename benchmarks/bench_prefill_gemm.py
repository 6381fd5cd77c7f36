"""Prefill matmuls on MKL against numpy's OpenBLAS, through MLX and the BLAS
shim (vllm_metal/native/mkl_gemm.py), reported not asserted.

Fresh processes, one per VLLM_METAL_SGEMM setting (`openblas`, `mkl`),
interleaved for `--rounds` rounds: MLX's x @ W.T on each of SmolLM2-135M's
four prefill shapes (its fused q/k/v, o, fused gate/up and down projections)
at 1024 and 2048 rows, and the whole chain of a 1024-token prefill's 120
products with distinct weights (what a prefill's linear layers cost; the LM
head runs on one row and is left out). Best of 3 timed repeats each, on the
malloc a served engine gets (tcmalloc, vllm_metal/native/allocator.py: each
product's output is a fresh buffer). Other processes' CPU use is recorded
per run.

    python benchmarks/bench_prefill_gemm.py [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cpu_usage import cpu_snapshot, foreign_cores  # noqa: E402

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}  # (K, N)
LAYERS = 30
# No server session to credit: the measuring child's CPU comes from os.times (session 0 would
# be the kernel's threads, counted as ours).
NO_SESSION = -1

MEASURE = r"""
import json, sys, time
from vllm_metal.native import ops  # noqa: F401  (the shim before mlx.core)
import mlx.core as mx
from vllm_metal.native import fast_blas
shapes, layers = json.loads(sys.argv[1]), int(sys.argv[2])

def best(fn, reps=3, inner=1):
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner): fn()
        out.append((time.perf_counter() - t) / inner)
    return min(out)

from vllm_metal.native.allocator import engine_allocator
res = {"large": fast_blas.large[0] or "OpenBLAS", "malloc": engine_allocator(), "shapes": {}}
for rows in (1024, 2048):
    for name, (k, n) in shapes.items():
        x, w = mx.random.normal((rows, k)), mx.random.normal((n, k)); mx.eval(x, w)
        s = best(lambda: mx.eval(x @ w.T), inner=5)
        res["shapes"][f"{name} {rows}x{k}x{n}"] = {"ms": 1e3 * s, "gflops": 2 * rows * k * n / s / 1e9}
ws = [mx.random.normal((n, k)) for _ in range(layers) for k, n in shapes.values()]
xs = {k: mx.random.normal((1024, k)) for k, _ in shapes.values()}
mx.eval(ws, list(xs.values()))
flops = sum(2 * 1024 * w.shape[0] * w.shape[1] for w in ws)
s = best(lambda: mx.eval([xs[w.shape[1]] @ w.T for w in ws]))
res["chain"] = {"products": len(ws), "ms": 1e3 * s, "gflops": flops / s / 1e9}
print(json.dumps(res))
"""


def run(setting: str) -> dict:
    from vllm_metal.native.allocator import find_tcmalloc, preload_into

    env = {**os.environ, "VLLM_METAL_SGEMM": setting}
    tcmalloc = find_tcmalloc()
    if tcmalloc:
        preload_into(env, tcmalloc)
    before, t0 = cpu_snapshot(NO_SESSION), time.monotonic()
    out = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(SHAPES), str(LAYERS)], env=env,
                         capture_output=True, text=True, check=True, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["foreign_cores"] = round(foreign_cores(before, cpu_snapshot(NO_SESSION), time.monotonic() - t0), 3)
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "prefill_gemm.json")
    args = ap.parse_args(argv)
    from roofline import cpu_name

    runs = []
    for r in range(args.rounds):
        for setting in ("openblas", "mkl"):
            res = run(setting)
            res.update(round=r, setting=setting)
            runs.append(res)
            c = res["chain"]
            print(f"round {r} {setting:8s} ({res['large']}): chain {c['ms']:.0f} ms ({c['gflops']:.0f} GFLOP/s), "
                  + ", ".join(f"{k} {v['gflops']:.0f}" for k, v in res["shapes"].items())
                  + f"; foreign cores {res['foreign_cores']:.2f}", flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_name(),
              "cores": os.cpu_count(), "runs": runs}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
