"""Measures this machine's roofline for the serving benchmark: memory bandwidth and float32 GEMM peak.

Decode streams every weight once per engine step, so its ceiling is
bandwidth / bytes read per step; prefill is matmul-bound, so its ceiling is
peak sgemm FLOP/s / (2 * layer params * tokens) (the LM head only runs for the
last prompt token). This measures both ceilings four ways:
MLX with the OpenBLAS that vllm-metal preloads (what the plugin and mlx_lm.server
run on), numpy in this environment, numpy with OPENBLAS_CORETYPE /
OPENBLAS_L2_SIZE unset (OpenBLAS picks its own kernels, AVX-512 where it has them),
and torch (what vLLM's CPU backend runs on), and takes the best as the machine's
peak: a bound no system can beat, not the one each system's library reaches. It also times the model's own
linear layers alone (no attention, norms or sampling) for one decode step and a
1024-token prefill: the most any server could do with this BLAS.

    python benchmarks/roofline.py --model DIR [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

mx = None  # mlx.core, imported by _mlx() after the BLAS preload

_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "U8": 1, "I32": 4, "U32": 4}


def _mlx():
    """mlx.core, imported after vllm-metal's OpenBLAS preload (as the plugin does)."""
    global mx
    if mx is None:
        from vllm_metal.native import fast_blas

        fast_blas.preload()
        import mlx.core

        mx = mlx.core
    return mx


def timeit(fn, min_time: float = 0.5, min_reps: int = 3) -> float:
    fn()  # warm-up
    reps, start = 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - start < min_time:
        fn()
        reps += 1
    return (time.perf_counter() - start) / reps


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return sorted(f for f in flags if f.startswith(("avx", "fma", "amx")))
    except OSError:
        pass
    return []


# -- machine ---------------------------------------------------------------

def numpy_copy_bandwidth(nbytes: int, min_time: float) -> float:
    """STREAM-copy-like: read + write bytes per second of a large numpy copy."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return 2 * nbytes / timeit(lambda: np.copyto(dst, src), min_time)


def numpy_gemv_bandwidth(rows: int, cols: int, min_time: float) -> float:
    """Matrix bytes read per second by a float32 matrix-vector product (what decode does)."""
    w = np.random.default_rng(0).standard_normal((rows, cols), np.float32)
    x = np.ones(cols, np.float32)
    return w.nbytes / timeit(lambda: w @ x, min_time)


def numpy_sgemm_gflops(n: int, min_time: float) -> float:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), np.float32)
    b = rng.standard_normal((n, n), np.float32)
    return 2 * n**3 / timeit(lambda: a @ b, min_time) / 1e9


def mlx_gemv_bandwidth(rows: int, cols: int, min_time: float) -> float:
    _mlx()
    w = mx.random.normal((rows, cols), dtype=mx.float32)
    x = mx.ones((1, cols), dtype=mx.float32)
    mx.eval(w, x)
    return rows * cols * 4 / timeit(lambda: mx.eval(x @ w.T), min_time)


def mlx_sgemm_gflops(n: int, min_time: float) -> float:
    _mlx()
    a = mx.random.normal((n, n), dtype=mx.float32)
    b = mx.random.normal((n, n), dtype=mx.float32)
    mx.eval(a, b)
    return 2 * n**3 / timeit(lambda: mx.eval(a @ b), min_time) / 1e9


def numpy_measurements(quick: bool) -> dict:
    t = 0.3 if quick else 1.0
    rows, cols = (4096, 8192) if quick else (8192, 8192)
    return {
        "numpy_copy_gbs": numpy_copy_bandwidth((128 if quick else 512) << 20, t) / 1e9,
        "numpy_gemv_gbs": numpy_gemv_bandwidth(rows, cols, t) / 1e9,
        "numpy_sgemm_gflops": numpy_sgemm_gflops(1024 if quick else 2048, t),
    }


def torch_measurements(quick: bool) -> dict:
    """torch's own CPU BLAS (what vLLM's CPU backend runs its linear layers on)."""
    import torch

    t = 0.3 if quick else 1.0
    rows, cols, n = (4096, 8192, 1024) if quick else (8192, 8192, 2048)
    torch.set_num_threads(os.cpu_count() or 1)
    with torch.no_grad():
        w, x = torch.randn(rows, cols), torch.randn(cols)
        a, b = torch.randn(n, n), torch.randn(n, n)
        return {"torch_gemv_gbs": w.numel() * 4 / timeit(lambda: torch.mv(w, x), t) / 1e9,
                "torch_sgemm_gflops": 2 * n**3 / timeit(lambda: a @ b, t) / 1e9}


def _child(flag: str, quick: bool, drop_env: tuple[str, ...] = ()) -> dict:
    """Run one measurement group in a fresh process (its own BLAS, its own environment)."""
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    cmd = [sys.executable, __file__, flag] + (["--quick"] if quick else [])
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as e:
        return {f"error{flag}": str(e)}


def numpy_autodetect_measurements(quick: bool) -> dict:
    """numpy's OpenBLAS with its kernel choice left to it (AVX-512 where it has kernels)."""
    measured = _child("--numpy-only", quick, ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"))
    return {k.replace("numpy_", "numpy_autodetect_"): v for k, v in measured.items()}


# -- model -----------------------------------------------------------------

def safetensors_params(model_dir: Path) -> tuple[int, int]:
    """(parameter count, bytes) of all tensors in the directory's safetensors files."""
    params = nbytes = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = int(np.prod(info["shape"])) if info["shape"] else 1
            params += count
            nbytes += count * _DTYPE_BYTES.get(info["dtype"], 4)
    return params, nbytes


def linear_shapes(config: dict, lm_head: bool = True) -> list[tuple[int, int]]:
    """(out_features, in_features) of every matmul one token goes through (llama layout).

    The LM head (tied to the embedding or not) runs only for the rows that are
    sampled: every row in decode, the last one of a prompt in prefill.
    """
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads", heads)
    inter = config["intermediate_size"]
    layer = [(heads * head_dim, hidden), (kv_heads * head_dim, hidden), (kv_heads * head_dim, hidden),
             (hidden, heads * head_dim), (inter, hidden), (inter, hidden), (hidden, inter)]
    return layer * config["num_hidden_layers"] + ([(config["vocab_size"], hidden)] if lm_head else [])


def kv_bytes_per_token(config: dict, dtype_bytes: int = 4) -> int:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def mlx_model_matmuls(config: dict, tokens: int, min_time: float, lm_head: bool = True) -> float:
    """Seconds for the model's linear layers alone on `tokens` rows, one MLX graph."""
    _mlx()
    shapes = linear_shapes(config, lm_head)
    weights = [mx.random.normal(s, dtype=mx.float32) * 0.02 for s in shapes]
    mx.eval(weights)
    inputs = {}
    for _, cols in shapes:
        if cols not in inputs:
            inputs[cols] = mx.random.normal((tokens, cols), dtype=mx.float32)
    mx.eval(list(inputs.values()))

    def step():
        # Independent products (no chaining), each weight read once, one eval.
        mx.eval([inputs[w.shape[1]] @ w.T for w in weights])

    return timeit(step, min_time)


def measure(model_dir: Path, quick: bool = False, prefill_tokens: int = 1024,
            decode_batches: tuple[int, ...] = (1, 8)) -> dict:
    t = 0.3 if quick else 1.0
    rows, cols = (4096, 8192) if quick else (8192, 8192)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    params, weight_bytes = safetensors_params(model_dir)
    matmul_params = sum(o * i for o, i in linear_shapes(config))
    layer_params = sum(o * i for o, i in linear_shapes(config, lm_head=False))

    result = {
        "cpu": cpu_name(), "cores": os.cpu_count(), "cpu_flags": cpu_flags(),
        "mlx_gemv_gbs": mlx_gemv_bandwidth(rows, cols, t) / 1e9,
        "mlx_sgemm_gflops": mlx_sgemm_gflops(1024 if quick else 2048, t),
        **numpy_measurements(quick),
        **numpy_autodetect_measurements(quick),
        **_child("--torch-only", quick),
    }
    from vllm_metal.native import fast_blas

    result["blas"] = {"mlx": fast_blas.status[0], "note": fast_blas.status[1],
                      "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE")}
    bandwidths = [v for k, v in result.items() if k.endswith("_gbs") and isinstance(v, float)]
    peaks = [v for k, v in result.items() if k.endswith("_sgemm_gflops") and isinstance(v, float)]
    result["peak_bandwidth_gbs"] = max(bandwidths)
    result["peak_sgemm_gflops"] = max(peaks)

    decode = {}
    for batch in decode_batches:
        seconds = mlx_model_matmuls(config, batch, t)
        decode[str(batch)] = {"step_ms": seconds * 1e3, "tok_s": batch / seconds,
                              "weight_gbs": matmul_params * 4 / seconds / 1e9}
    prefill_s = mlx_model_matmuls(config, prefill_tokens, t, lm_head=False)
    result["model"] = {
        "dir": str(model_dir), "params": params, "weight_bytes": weight_bytes,
        "matmul_params": matmul_params, "layer_params": layer_params,
        "kv_bytes_per_token": kv_bytes_per_token(config),
        "mlx_matmul_only_decode": decode,
        "mlx_matmul_only_prefill": {"tokens": prefill_tokens, "seconds": prefill_s, "lm_head": False,
                                    "gflops": 2 * layer_params * prefill_tokens / prefill_s / 1e9},
    }
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="model directory (config.json + safetensors)")
    ap.add_argument("--json", type=Path, help="write the measurements here")
    ap.add_argument("--quick", action="store_true", help="smaller sizes and shorter timings")
    ap.add_argument("--numpy-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.numpy_only or args.torch_only:
        measure_group = numpy_measurements if args.numpy_only else torch_measurements
        print(json.dumps(measure_group(args.quick)))
        return
    if args.model is None:
        ap.error("--model is required")
    result = measure(args.model, quick=args.quick)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
