"""Runs `mlx_lm.server` as a serving-benchmark peer: same BLAS as vllm-metal, no SSE comments.

BLAS: MLX's CPU wheel links a reference BLAS; vllm-metal preloads its BLAS shim
(numpy's OpenBLAS, its own few-row kernel, MKL for large products on Intel CPUs)
and Debian's OpenBLAS before `mlx.core` is imported (vllm_metal.native.fast_blas).
The peer must get the same, or the comparison measures BLAS libraries, not servers. Before
serving, this prints one line, `BLAS_CHECK {...}`, with the library loaded and
a timed 1024^3 float32 matmul, so each benchmark log shows that it took effect.

SSE comments: while a prompt is processed, mlx_lm.server streams `: keepalive
N/M` comment events. They are valid SSE, but vLLM 0.32's benchmark client
strips every network chunk before splitting on the blank line that ends an
event, so after a comment it never sees an event boundary again and the
request's tokens all arrive "at once" (TPOT 0, no ITLs). `quiet_keepalive()`
keeps the progress logging and drops the comments. It wraps
`mlx_lm.server.ResponseGenerator.generate` (mlx-lm 0.32.2);
tests/benchmarks/test_mlx_lm_server.py fails if that hook changes upstream.

    python benchmarks/mlx_lm_server.py --model DIR --host 127.0.0.1 --port 8080 [mlx_lm.server args]
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time

from vllm_metal.native import fast_blas

MLX_LM_VERSION = "0.32.2"  # the mlx-lm whose ResponseGenerator.generate this wraps


def blas_check(n: int = 1024, reps: int = 5) -> dict:
    import mlx.core as mx

    a = mx.random.normal((n, n), dtype=mx.float32)
    b = mx.random.normal((n, n), dtype=mx.float32)
    mx.eval(a @ b)
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(a @ b)
    seconds = (time.perf_counter() - start) / reps
    return {"sgemm_gflops": round(2 * n**3 / seconds / 1e9, 1), "device": str(mx.default_device())}


def _log_progress(processed: int, total: int) -> None:
    logging.info(f"Prompt processing progress: {processed}/{total}")


def quiet_keepalive(server_module) -> None:
    """Make mlx_lm.server log prompt progress instead of streaming keepalive comments."""
    generator_cls = server_module.ResponseGenerator
    original = generator_cls.generate
    if getattr(original, "_quiet_keepalive", False):
        return

    @functools.wraps(original)
    def generate(self, request, generation_args, progress_callback=None):
        return original(self, request, generation_args, progress_callback=_log_progress)

    generate._quiet_keepalive = True
    generator_cls.generate = generate


def main() -> None:
    library, note = fast_blas.preload()
    print("BLAS_CHECK " + json.dumps({"library": library, "note": note, **blas_check()}), flush=True)
    from mlx_lm import server

    quiet_keepalive(server)
    sys.argv = ["mlx_lm.server", *sys.argv[1:]]
    server.main()


if __name__ == "__main__":
    main()
