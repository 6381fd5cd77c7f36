"""Before/after of the Linux BLAS fix (vllm_metal/native/fast_blas.py), reported not asserted.

Runs the same measurements in fresh processes, one per VLLM_METAL_BLAS
setting: MLX's bundled reference BLAS (`reference`), the system OpenBLAS alone
(`system`) and the default (`auto`: vllm-metal's BLAS shim to numpy's
OpenBLAS, the system OpenBLAS for LAPACK): float32 GEMM throughput, a
one-row product x[1,K] @ W^T (the decode shape), and a prefill (128 tokens)
and a decode step of the embedded SmolLM2-135M (weights expanded to float32,
as served on the CPU).

    python benchmarks/bench_blas.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

MEASURE = r"""
import json, time
from vllm_metal.native import ops  # preloads (or not) the BLAS before mlx
import mlx.core as mx
from vllm_metal.native import fast_blas
from vllm_metal.formats.default_model import ensure_default_model
from vllm_metal.models.loader import load_model
from vllm_metal.models.attention_adapter import PagedKVCache, StepAttentionInputs
import numpy as np

def timeit(fn, reps=3):
    fn(); t = time.perf_counter()
    for _ in range(reps): fn()
    return (time.perf_counter() - t) / reps

a, b = mx.random.normal((512, 576)), mx.random.normal((576, 1536)); mx.eval(a, b)
gemm = timeit(lambda: mx.eval(a @ b))
x, w = mx.random.normal((1, 4096)), mx.random.normal((8192, 4096)); mx.eval(x, w)
gemv = timeit(lambda: mx.eval(x @ w.T), reps=20)
lm = load_model(ensure_default_model(), "float32", dequantize=True)
kv = PagedKVCache([mx.zeros((16, 16, 3, 64)) for _ in range(30)], [mx.zeros((16, 16, 3, 64)) for _ in range(30)], [0] * 30)
def step(n, start):
    pos = np.arange(start, start + n, dtype=np.int32)
    kv.step = StepAttentionInputs(mx.array(pos), mx.array([start + n], mx.int32), mx.array([0, n], mx.int32),
                                  [mx.array(np.arange(16, dtype=np.int32)[None])], [pos.astype(np.int64)])
    h = lm.hidden_states(mx.array(np.ones(n, np.int32)), kv.layer_views())
    mx.eval(lm.logits(h[-1:]), kv.keys, kv.values)
print(json.dumps({"blas": fast_blas.status[0] or fast_blas.status[1],
                  "gemm_gflops": 2 * 512 * 576 * 1536 / gemm / 1e9,
                  "gemv_gbs": 8192 * 4096 * 4 / gemv / 1e9,
                  "prefill128_ms": timeit(lambda: step(128, 0)) * 1e3,
                  "decode_ms": timeit(lambda: step(1, 128), reps=10) * 1e3}))
"""


def run(mode: str) -> dict:
    env = dict(os.environ, VLLM_METAL_BLAS=mode)
    out = subprocess.run([sys.executable, "-c", MEASURE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


MODES = (("reference", "mlx-cpu reference BLAS"), ("system", "system OpenBLAS (preloaded)"),
         ("auto", "BLAS shim to numpy's OpenBLAS (default)"))


def main():
    results = {mode: run(mode) for mode, _ in MODES}
    print("| BLAS | fp32 GEMM 512x576x1536 | x[1,4096] @ W[8192,4096]^T | SmolLM2 prefill 128 tok "
          "| SmolLM2 decode step |")
    print("|---|---:|---:|---:|---:|")
    for mode, name in MODES:
        r = results[mode]
        print(f"| {name} | {r['gemm_gflops']:.1f} GFLOP/s | {r['gemv_gbs']:.1f} GB/s | "
              f"{r['prefill128_ms']:.0f} ms | {r['decode_ms']:.1f} ms |")
    ref = results["reference"]
    for mode, name in MODES[1:]:
        fast = results[mode]
        print(f"\n{name} vs reference: GEMM {fast['gemm_gflops'] / ref['gemm_gflops']:.0f}x, prefill "
              f"{ref['prefill128_ms'] / fast['prefill128_ms']:.0f}x, decode "
              f"{ref['decode_ms'] / fast['decode_ms']:.1f}x")
    print("\nlibraries: " + "; ".join(f"{mode}: {results[mode]['blas']}" for mode, _ in MODES))


if __name__ == "__main__":
    main()
