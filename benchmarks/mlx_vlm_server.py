"""Runs `mlx_vlm.server` (mlx-vlm 0.7.10, in its own venv: setup_peers.sh) as the
image benchmark's peer with the same BLAS as vllm-metal.

MLX's CPU wheel links a reference BLAS; vllm-metal preloads its BLAS shim and
OpenBLAS before `mlx.core` is imported (vllm_metal.native.fast_blas, stdlib
only until then). The peer gets the same, or the comparison measures BLAS
libraries, not servers (mlx-vlm on the reference BLAS took over ten minutes
for one 448x448 warm-up request of the 3B model). `VLLM_METAL_BLAS_SHIM`
names the shim built for the project venv; a `BLAS_CHECK {...}` line (the
library, a timed 1024^3 float32 matmul) goes to the log before serving.

    <mlx-vlm venv>/bin/python benchmarks/mlx_vlm_server.py --model DIR --host 127.0.0.1 --port 8080
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vllm_metal  # noqa: E402  (stdlib only: no MLX, no vLLM)
from vllm_metal.native import fast_blas  # noqa: E402


def main() -> int:
    shim = os.environ.get("VLLM_METAL_BLAS_SHIM")
    if shim:
        vllm_metal.__path__.append(os.path.dirname(shim))
    library, how = fast_blas.preload()
    import mlx.core as mx

    a = mx.random.normal((1024, 1024), dtype=mx.float32)
    b = mx.random.normal((1024, 1024), dtype=mx.float32)
    mx.eval(a @ b)
    start = time.perf_counter()
    for _ in range(5):
        mx.eval(a @ b)
    seconds = (time.perf_counter() - start) / 5
    print("BLAS_CHECK " + json.dumps({"library": library, "how": how, "gflops_1024": 2 * 1024 ** 3 / seconds / 1e9}),
          flush=True)
    from mlx_vlm.server import main as serve

    sys.argv = ["mlx_vlm.server", *sys.argv[1:]]
    return serve() or 0


if __name__ == "__main__":
    sys.exit(main())
