"""Every environment variable vllm-metal reads, with its default and meaning.

Documented in docs/usage.md. Values are read when asked for (not at import),
so tests and forked workers see the current environment.
"""

from __future__ import annotations

import os
from typing import Callable

# name -> (default, one-line meaning)
ENV_VARS: dict[str, tuple[str | None, str]] = {
    "VLLM_METAL_DEVICE": (
        None,
        "MLX device for the plugin: 'gpu' (Metal, default on Apple Silicon) or 'cpu'. "
        "On non-Apple hosts the plugin is active only when this is set to 'cpu'.",
    ),
    "VLLM_METAL_ATTENTION": (
        "auto",
        "Attention path: 'auto' (native primitive where one exists for the device, "
        "else the MLX reference) or 'reference' (always the plain-MLX reference, for diagnosis).",
    ),
    "VLLM_METAL_SYNC_PER_LAYER": (
        "0",
        "1 evaluates the graph after every layer (the old eager behaviour) instead of "
        "once per engine step; for ablation and debugging.",
    ),
    "VLLM_METAL_SPEC_BUDGET": (
        "1",
        "1 verifies only the n-gram drafts expected to pay for the rows they add (each request's "
        "measured acceptance against the step's measured cost per row: speculative/budget.py); 0 "
        "verifies every draft vLLM's proposer makes, as vLLM does. Same tokens either way.",
    ),
    "VLLM_METAL_SAMPLE_IN_GRAPH": (
        "1",
        "1 samples a step whose every row is greedy (nothing editing its logits) inside the "
        "step's graph, only the token ids reaching the host, and under async scheduling lets the "
        "next step's graph read them there (built before the step finishes); 0 samples every "
        "step with vLLM's Sampler on the host (for ablation and diagnosis). Same tokens either way.",
    ),
    "VLLM_METAL_BLAS": (
        "auto",
        "Linux only: 'auto' gives MLX's matmuls numpy's OpenBLAS through vllm-metal's BLAS "
        "shim and loads the system OpenBLAS for the rest (LAPACK), before MLX; 'system' only "
        "the system OpenBLAS; a path loads that library; 'reference' keeps the mlx-cpu "
        "wheel's slow reference BLAS.",
    ),
    "VLLM_METAL_SGEMM": (
        "auto",
        "Linux x86-64, MLX's CPU device: the library for matmuls of 33 rows and more (prefill): "
        "'auto' Intel MKL (the mkl wheel, single-threaded on each slice of the shim's pool) on "
        "Intel CPUs, numpy's OpenBLAS elsewhere; 'mkl' MKL on any x86-64 CPU; 'openblas' never "
        "MKL; a path loads that libmkl_rt (native/mkl_gemm.py).",
    ),
    "VLLM_METAL_TCMALLOC": (
        "auto",
        "Linux, MLX's CPU device: 'auto' preloads tcmalloc (Debian's libtcmalloc-minimal4) into "
        "the engine process, spawned for it (glibc's malloc slows the step's graph building); "
        "'0' never; a path preloads that library (native/allocator.py).",
    ),
    "VLLM_METAL_DEQUANTIZE": (
        "auto",
        "Expand MLX-quantized weights at load: 'auto' on MLX's CPU device (its quantized "
        "matmul is far slower than BLAS) and not on Metal; '1' always; '0' never.",
    ),
    "VLLM_METAL_FUSE_PROJECTIONS": (
        "auto",
        "One matmul for projections that read the same input (attention's q/k/v, a gated MLP's "
        "gate/up; weights concatenated at load): 'auto' on MLX's CPU device (fewer, larger "
        "BLAS calls) and not on Metal; '1' always; '0' never.",
    ),
    "VLLM_METAL_FUSED_KV_WRITE": (
        "1",
        "Where RoPE runs through vllm-metal's primitive (VLLM_METAL_CPU_NORM_ROPE), rotate q and k "
        "and write K/V into the cache as one primitive (RopeWriteKV) instead of five operations: "
        "'1' (default) or '0'.",
    ),
    "VLLM_METAL_FUSED_LAYER": (
        "1",
        "Where the fused projections (VLLM_METAL_FUSE_PROJECTIONS) and the CPU norm/RoPE "
        "primitives (VLLM_METAL_CPU_NORM_ROPE) both apply, run each llama-shaped decoder block "
        "(proven at load) as one DecoderLayer primitive instead of ~36 graph nodes: '1' "
        "(default) or '0'.",
    ),
    "VLLM_METAL_HEAD_SCREEN": (
        "1",
        "Greedy steps on MLX's CPU device find each row's token through a bfloat16 screen of the "
        "float32 output head (the same tokens: exact float32 logits for the few tokens the screen "
        "cannot rule out; built at load, half the head's bytes) where the CPU has AVX-512 BF16: "
        "'1' (default) or '0' (every logit in float32).",
    ),
    "VLLM_METAL_CPU_NORM_ROPE": (
        "auto",
        "RMSNorm and RoPE through vllm-metal's primitives (MLX's CPU rms_norm and rope are "
        "~15- and ~30-operation compositions; RoPE's cos/sin table is then computed once per "
        "step): 'auto' on MLX's CPU device and not on Metal (fused kernels there); '1' always; "
        "'0' never.",
    ),
    "VLLM_METAL_STATE_WRITEBACK": (
        "inplace",
        "Hybrid models' per-request states (linear-attention layers): 'inplace' scatters each "
        "step's new states into the state pools, which MLX donates (no copy); 'copy' copies "
        "each pool first and writes into the copy (the cost of a write-back without donation; "
        "for ablation and diagnosis). Both give identical results.",
    ),
    "VLLM_METAL_GATED_DELTA": (
        "auto",
        "Gated DeltaNet recurrence of hybrid models (qwen3_next, qwen3_5): 'auto' runs "
        "vllm-metal's fused gated-delta primitive on MLX's CPU device and mlx-lm's own Metal "
        "kernel on the GPU; 'fused' always the primitive (its Metal kernel on the GPU); "
        "'mlx-lm' always mlx-lm's gated_delta_update (its per-token ops on the CPU). "
        "All give the same tokens (tested); for ablation and diagnosis.",
    ),
    "VLLM_METAL_CPU_ISA": (
        None,
        "Caps the instruction set of vllm-metal's CPU kernels: 'avx2' runs the AVX2 builds on an "
        "AVX-512 host, 'generic' the portable ones (for profiling what an AVX2-only host runs; "
        "with OPENBLAS_CORETYPE=Haswell numpy's OpenBLAS too; the BLAS shim's one-row AVX-512 path "
        "obeys it as well). Unset: the best the CPU runs; `vllm-metal doctor` shows the builds in use.",
    ),
    "VLLM_METAL_CPU_THREADS": (
        None,
        "Threads used by the CPU paged-attention, gated-delta and SwiGLU kernels and by the BLAS "
        "shim's few-row kernel (default: all cores).",
    ),
    "VLLM_METAL_KV_DISK": (
        None,
        "A directory: turns on the disk KV cache (prefix blocks saved and restored across "
        "restarts, docs/kv_disk.md) with its defaults; same as --kv-transfer-config with "
        "vllm-metal's MetalDiskConnector.",
    ),
    "VLLM_METAL_KV_DISK_MAX_BYTES": (
        None,
        "Size bound of the VLLM_METAL_KV_DISK directory in bytes (least recently used blocks "
        "are evicted; default 16 GiB).",
    ),
    "VLLM_METAL_DISTRIBUTED_BACKEND": (
        "ring",
        "MLX's data plane between ranks under tensor/pipeline parallel: 'ring' (TCP, any Mac or "
        "Linux host) or 'jaccl' (RDMA over Thunderbolt 5 on Macs that have it; MLX's "
        "MLX_IBV_DEVICES names the devices). docs/distributed.md.",
    ),
    "VLLM_METAL_DISTRIBUTED_TIMEOUT": (
        "300",
        "Seconds every rank waits for the others at start-up (vLLM's --distributed-timeout-seconds, "
        "when that is unset): a host that never joins stops start-up after this long.",
    ),
    "VLLM_METAL_RING_PORT": (
        None,
        "Tensor/pipeline parallel: rank r's MLX ring socket listens on this port + r (for "
        "firewalls); any free port by default.",
    ),
    "VLLM_METAL_RING_VIA": (
        None,
        "Tensor/pipeline parallel: 'RANK=HOST:PORT,...', where the other ranks reach a rank "
        "whose ring socket is behind a forwarded port or relay.",
    ),
    "VLLM_METAL_STEP_TIMEOUT": (
        "120",
        "Across hosts: seconds the engine waits for a step's answer from another host before it "
        "fails the requests and stops (sets vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s by "
        "default, unless that is set).",
    ),
    "VLLM_METAL_MODEL_DIR": (
        None,
        "Where the embedded default model (SmolLM2-135M-Instruct) is converted to "
        "(default ~/.cache/vllm-metal/SmolLM2-135M-Instruct).",
    ),
}


def get(name: str) -> str | None:
    default, _ = ENV_VARS[name]
    return os.environ.get(name, default)


def get_bool(name: str) -> bool:
    return (get(name) or "0").strip().lower() in ("1", "true", "yes", "on")


def cpu_auto_switch(name: str, device: str) -> bool:
    """A switch whose 'auto' means "on MLX's CPU device" (`device`: "cpu" or
    "gpu"); '1' always, '0' never; a value it does not know is refused, not ignored."""
    choice = (get(name) or "auto").strip().lower()
    if choice == "auto":
        return device == "cpu"
    return strict_switch(name, choice, "'auto', '1' or '0'")


def strict_switch(name: str, value: str | None = None, allowed: str = "'1' or '0'") -> bool:
    """An on/off variable (`value`, else its setting): '1' (true, yes, on) or
    '0' (false, no, off); anything else is refused, not ignored."""
    choice = ((get(name) if value is None else value) or "").strip().lower()
    if choice in ("1", "true", "yes", "on"):
        return True
    if choice in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={choice!r}: use {allowed}")


CPU_ISAS = ("generic", "avx2", "avx512")


def cpu_isa_cap() -> str | None:
    """VLLM_METAL_CPU_ISA, checked (the kernels read it themselves, once, in
    csrc/cpu/isa.h); a value they do not know is refused, not ignored."""
    value = (get("VLLM_METAL_CPU_ISA") or "").strip()
    if value and value not in CPU_ISAS:
        raise ValueError(f"VLLM_METAL_CPU_ISA={value!r}: use one of {', '.join(CPU_ISAS)} (or leave it unset)")
    return value or None


def environment_variables() -> dict[str, Callable[[], str | None]]:
    """In vLLM's own `environment_variables` shape: name -> getter."""
    return {name: (lambda n=name: get(n)) for name in ENV_VARS}
