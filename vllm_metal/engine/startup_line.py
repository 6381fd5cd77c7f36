"""The one line the worker logs at engine start: MLX and its device, the
allocator, the attention path, the CPU kernels' builds, BLAS, and how many
CUDA-only paths are inert (`vllm-metal doctor` says the rest)."""

from __future__ import annotations

from vllm_metal.native.extension import installed_mlx


def cpu_kernels_line(k: dict) -> str:
    """"avx2 builds (host avx512, capped by VLLM_METAL_CPU_ISA=avx2)", and
    "; greedy head screened in bfloat16 (avx2 kernel)" where the CPU runs a build of that kernel."""
    why = f", capped by VLLM_METAL_CPU_ISA={k['cap']}" if k["cap"] and k["isa"] != k["host_isa"] else ""
    screen = f"; greedy head screened in bfloat16 ({k['head_screen']} kernel)" if k.get("head_screen") else ""
    return f"{k['isa']} builds (host {k['host_isa']}{why}){screen}"


def startup_line(device: str) -> str:
    """The one line the worker logs at engine start."""
    from vllm_metal.native import fast_blas, ops
    from vllm_metal.engine.cuda_gate import CUDA_PATHS

    import mlx.core as mx

    name, reason = ops.attention_path(mx.gpu if device == "gpu" else mx.cpu)
    from vllm_metal.native.allocator import engine_allocator

    blas = fast_blas.summary()
    return (f"MLX {installed_mlx()} on {device}; malloc: {engine_allocator()}; attention: {name} ({reason}); "
            f"CPU kernels: {cpu_kernels_line(ops.cpu_kernels())}; "
            f"Metal kernels {'compiled' if ops._ext.HAS_METAL else 'not compiled'}; "
            f"BLAS: {blas}; {sum(p.on_request == 'warn' for p in CUDA_PATHS)} CUDA-only paths inert, "
            f"{sum(p.on_request == 'error' for p in CUDA_PATHS)} refused if asked for "
            "(`vllm-metal doctor` lists them)")
