"""vLLM's CUDA-only paths (and features not served here), as one table, and
the gate that keeps vLLM off them.

Each row names a CUDA-only feature, why it is inert on this platform, what
vllm-metal does instead, how a user can ask for it (config fields, CLI flags,
environment variables) and what happens when they do: "warn" where dropping
it cannot change results (a one-line warning, then it is turned off) or
"error" where it would (a clear error naming the option and the
alternative). Adding a path is one row.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

from vllm_metal.speculative.serving_config import refused_method

# Under vLLM's "vllm" logger (its handlers), without importing vLLM: the
# doctor uses this table on machines without vLLM too.
logger = logging.getLogger("vllm.vllm_metal.engine.cuda_gate")


def _cudagraphs(cfg) -> str | None:
    cc = cfg.compilation_config
    mode = getattr(cc.cudagraph_mode, "name", cc.cudagraph_mode)
    if mode not in (None, "NONE"):
        return f"--compilation-config cudagraph_mode={mode}"
    if cc.cudagraph_capture_sizes:
        return "--compilation-config cudagraph_capture_sizes"
    if getattr(cc, "max_cudagraph_capture_size", None):
        return "--compilation-config max_cudagraph_capture_size"
    return None


def _torch_compile(cfg) -> str | None:
    mode = getattr(cfg.compilation_config.mode, "name", cfg.compilation_config.mode)
    return f"--compilation-config mode={mode}" if mode not in (None, "NONE") else None


def _attention_backend(cfg) -> str | None:
    backend = getattr(getattr(cfg, "attention_config", None), "backend", None)
    return f"--attention-backend {getattr(backend, 'name', backend)}" if backend is not None else None


# vLLM's names for an AutoAWQ / GPTQ checkpoint (the method its config names,
# or the kernel vLLM would pick for it): repacked to MLX affine at load
# (formats/awq_gptq.py), not run by CUDA kernels.
REPACKED_QUANTIZATION = ("awq", "auto_awq", "awq_marlin", "gptq", "auto_gptq", "gptq_marlin")


def _quantization(cfg) -> str | None:
    q = cfg.model_config.quantization if cfg.model_config is not None else None
    if q in REPACKED_QUANTIZATION:
        return None
    return f"--quantization {q} (or the checkpoint's quantization_config)" if q else None


# --kv-cache-dtype values vllm-metal's kernels serve (native/kv_quant.py): 8-bit
# float caches; float16 / bfloat16 where they are the model dtype (= auto).
SERVED_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head")


def _kv_cache_dtype(cfg) -> str | None:
    dtype = cfg.cache_config.cache_dtype
    if dtype in (None, *SERVED_KV_CACHE_DTYPES):
        return None
    model_dtype = str(getattr(cfg.model_config, "dtype", "")).removeprefix("torch.")
    return None if dtype == model_dtype else f"--kv-cache-dtype {dtype}"


def _speculative(cfg) -> str | None:
    method = refused_method(cfg.speculative_config)
    return f"--speculative-config method {method!r}" if method is not None else None


def _expert_parallel(cfg) -> str | None:
    p = cfg.parallel_config
    for flag, on in (("--enable-expert-parallel", p.enable_expert_parallel), ("--enable-eplb", p.enable_eplb),
                     ("--enable-dbo", getattr(p, "enable_dbo", False))):
        if on:
            return flag
    return None


def _kv_transfer(cfg) -> str | None:
    from vllm_metal.kv.connector_config import is_ours

    kt = getattr(cfg, "kv_transfer_config", None)
    if kt is None or is_ours(kt):  # the disk KV cache reads and writes MLX caches
        return None
    return f"--kv-transfer-config (kv_connector={getattr(kt, 'kv_connector', None)})"


def _kv_offloading(cfg) -> str | None:
    # Checked directly: vLLM turns it into a kv_transfer_config only after
    # the platform hooks have run.
    size = getattr(cfg.cache_config, "kv_offloading_size", None)
    return f"--kv-offloading-size {size}" if size else None


def _prompt_embeds(cfg) -> str | None:
    mc = cfg.model_config
    return "--enable-prompt-embeds" if mc is not None and getattr(mc, "enable_prompt_embeds", False) else None


@dataclass(frozen=True)
class CudaPath:
    key: str
    name: str
    reason: str
    instead: str
    on_request: str  # "warn" (inert, dropped) or "error"
    requested: Callable | None = None  # vllm_config -> the option that asked for it, or None
    env_vars: tuple[str, ...] = field(default=())
    env_prefixes: tuple[str, ...] = field(default=())
    # "cuda": a CUDA-only path; "unserved": a vLLM feature vllm-metal does not
    # serve yet (refused rather than silently ignored).
    kind: str = "cuda"


CUDA_PATHS: tuple[CudaPath, ...] = (
    CudaPath("cuda_graphs", "CUDA graphs", "CUDA graph capture/replay needs a CUDA device",
             "the whole step is one lazy MLX graph, evaluated once", "warn", _cudagraphs,
             ("VLLM_USE_BREAKABLE_CUDAGRAPH", "VLLM_ENABLE_CUDAGRAPH_GC", "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS")),
    CudaPath("torch_compile", "torch.compile / Inductor", "the model is MLX, not a torch module",
             "MLX evaluates the step graph; nothing to compile", "warn", _torch_compile,
             ("VLLM_USE_AOT_COMPILE", "VLLM_USE_STANDALONE_COMPILE", "VLLM_ENABLE_INDUCTOR_MAX_AUTOTUNE",
              "VLLM_ENABLE_INDUCTOR_COORDINATE_DESCENT_TUNING", "VLLM_DISABLE_COMPILE_CACHE")),
    CudaPath("custom_all_reduce", "custom all-reduce / NCCL", "NCCL and vLLM's all-reduce kernels need CUDA devices",
             "tensor / pipeline parallel collectives run over MLX's distributed backend (ring or JACCL)", "warn", None,
             ("VLLM_NCCL_SO_PATH", "VLLM_NCCL_INCLUDE_PATH", "VLLM_ALLREDUCE_USE_SYMM_MEM", "VLLM_USE_NCCL_SYMM_MEM",
              "VLLM_ALLREDUCE_USE_FLASHINFER", "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC", "VLLM_SKIP_P2P_CHECK",
              "VLLM_DISABLE_PYNCCL", "VLLM_FLASHINFER_ALLREDUCE_BACKEND")),
    CudaPath("attention_backends", "FlashAttention / FlashInfer / Triton attention backends",
             "their kernels are CUDA/Triton", "vllm-metal's paged-attention primitive (Metal kernel, C++ on CPU)",
             "warn", _attention_backend, ("VLLM_ATTENTION_BACKEND", "VLLM_TRITON_USE_TD",
                                          "VLLM_TRITON_FORCE_FIRST_CONFIG", "VLLM_HAS_FLASHINFER_CUBIN"),
             ("VLLM_FLASHINFER_",)),
    CudaPath("quantized_kernels", "FP8 / NVFP4 / MXFP4 / Marlin / compressed-tensors CUDA kernels",
             "these weight formats run only in CUDA kernels",
             "serve MLX-quantized (4/8-bit, e.g. `mlx_lm.convert -q`), GGUF, AutoAWQ / GPTQ (repacked to MLX at "
             "load) or float16/bfloat16/float32 weights",
             "error", _quantization,
             ("VLLM_USE_TRITON_AWQ", "VLLM_USE_DEEP_GEMM", "VLLM_MOE_USE_DEEP_GEMM", "VLLM_USE_DEEP_GEMM_E8M0",
              "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER", "VLLM_USE_FLASHINFER_MOE_INT4"),
             ("VLLM_MARLIN_", "VLLM_MXFP4_", "VLLM_MXFP8_")),
    CudaPath("fp8_kv_cache", "quantized KV caches other than fp8 (int8/int4 per token-head, TurboQuant, NVFP4, fp8_inc)",
             "their cache kernels are CUDA-only",
             "--kv-cache-dtype fp8 (= fp8_e4m3), fp8_e5m2 or fp8_per_token_head: 8-bit caches read by vllm-metal's "
             "kernels; or auto",
             "error", _kv_cache_dtype),
    CudaPath("cascade_attention", "cascade attention", "a FlashAttention-specific shared-prefix kernel",
             "shared prefixes are reused through prefix caching", "warn"),  # no switch for it in vLLM 0.33
    CudaPath("speculative_decoding", "speculative proposers other than host n-gram, a draft model, a "
             "checkpoint's MTP layers or Gemma 4 assistant, or an EAGLE-3 head (EAGLE-1, Medusa, GPU n-gram, ...)",
             "their proposers run in vLLM's CUDA runner",
             "n-gram speculation (`{\"method\": \"ngram\", ...}`), a draft model of the target's vocabulary "
             "(`{\"method\": \"draft_model\", \"model\": ...}`), the checkpoint's MTP layer "
             "(`{\"method\": \"mtp\", ...}`) or an EAGLE-3 head (`{\"method\": \"eagle3\", \"model\": ...}`): "
             "drafts verified in the step's graph; or plain decoding", "error",
             _speculative, kind="unserved"),
    CudaPath("flashinfer_sampler", "FlashInfer top-k/top-p sampler", "a CUDA kernel",
             "vLLM's torch sampler on CPU tensors", "warn", None, ("VLLM_USE_FLASHINFER_SAMPLER",)),
    CudaPath("expert_parallel", "expert parallel / DeepEP / EPLB / dual-batch overlap",
             "multi-GPU all-to-all kernels", "one device holds every expert", "warn", _expert_parallel,
             (), ("VLLM_DEEPEP_",)),
    CudaPath("rocm_aiter", "ROCm AITER kernels", "AMD-GPU only", "MLX kernels", "warn", None, (), ("VLLM_ROCM_",)),
    CudaPath("cuda_runtime", "CUDA runtime / compatibility libraries", "no CUDA runtime is loaded",
             "MLX (Metal or CPU)", "warn", None,
             ("VLLM_CUDART_SO_PATH", "VLLM_ENABLE_CUDA_COMPATIBILITY", "VLLM_CUDA_COMPATIBILITY_PATH")),
    CudaPath("kv_connector", "KV connectors other than vllm-metal's disk cache (disaggregated prefill, LMCache, "
             "NIXL, ...)",
             "connectors move KV blocks as torch device tensors; the cache here is MLX arrays",
             "serve without --kv-transfer-config; vllm-metal's own MetalDiskConnector (VLLM_METAL_KV_DISK, "
             "docs/kv_disk.md) is the one accepted", "error", _kv_transfer),
    CudaPath("kv_offloading", "KV-cache offloading", "the offloading connectors copy torch device tensors",
             "the KV cache lives in unified memory already; drop --kv-offloading-size (for a cache that "
             "survives restarts: VLLM_METAL_KV_DISK)", "error", _kv_offloading),
    CudaPath("prompt_embeds", "prompt embeddings as input", "the runner takes token ids only",
             "send token ids or text (drop --enable-prompt-embeds)", "error", _prompt_embeds, kind="unserved"),
)


# How a user asks for each path on the command line (the docs' column; the
# environment variables come from the rows themselves).
FLAGS: dict[str, str] = {
    "cuda_graphs": "`--compilation-config` cudagraph_mode / cudagraph_capture_sizes",
    "torch_compile": "`--compilation-config` mode",
    "custom_all_reduce": "",
    "attention_backends": "`--attention-backend`",
    "quantized_kernels": "`--quantization`, a checkpoint `quantization_config`",
    "fp8_kv_cache": "`--kv-cache-dtype`",
    "cascade_attention": "(no switch in vLLM 0.33)",
    "speculative_decoding": "`--speculative-config`",
    "flashinfer_sampler": "",
    "expert_parallel": "`--enable-expert-parallel`, `--enable-eplb`, `--enable-dbo`",
    "rocm_aiter": "",
    "cuda_runtime": "",
    "kv_connector": "`--kv-transfer-config`",
    "kv_offloading": "`--kv-offloading-size`",
    "prompt_embeds": "`--enable-prompt-embeds`",
}


def markdown_table() -> str:
    """The table in docs/capabilities.md (regenerate: python -m vllm_metal.engine.cuda_gate)."""
    lines = ["| path | why it is inert or refused here | what vllm-metal does instead | how a user asks for it | when asked |",
             "|---|---|---|---|---|"]
    for p in CUDA_PATHS:
        env = [f"`{n}`" for n in p.env_vars] + [f"`{x}*`" for x in p.env_prefixes]
        asks = ", ".join(x for x in [FLAGS[p.key], *env] if x)
        name = p.name + (" (not served yet)" if p.kind == "unserved" else "")
        lines.append(f"| {name} | {p.reason} | {p.instead} | {asks} | {p.on_request} |")
    return "\n".join(lines)


def config_request(path: CudaPath, vllm_config) -> str | None:
    """The config option (CLI flag) that asks for `path`, or None."""
    if path.requested is None or vllm_config is None:
        return None
    return path.requested(vllm_config) or None


def env_requests(path: CudaPath, environ=None) -> list[str]:
    """The environment variables that tune `path`, as NAME=value."""
    environ = os.environ if environ is None else environ
    found = [f"{n}={environ[n]}" for n in path.env_vars if n in environ]
    found += [f"{n}={environ[n]}" for n in sorted(environ) for p in path.env_prefixes if n.startswith(p)]
    return found


class CudaOnlyOptionError(ValueError):
    pass


def _refuse(option: str, path: CudaPath) -> CudaOnlyOptionError:
    what = "is CUDA-only and cannot run on vllm-metal" if path.kind == "cuda" else "vllm-metal does not serve"
    return CudaOnlyOptionError(f"{option} asks for {path.name}, which {what} ({path.reason}). "
                               f"Instead: {path.instead}.")


def gate_config(vllm_config, environ=None) -> list[str]:
    """Errors on CUDA-only requests that would change results; warns (one line
    each) about inert ones. Run on the user's config before vLLM fills in
    defaults. Environment variables alone only tune CUDA kernels that never
    run here, so they always just warn. Returns the warnings."""
    warnings = []
    check_repacked_quantization(vllm_config.model_config)
    for path in CUDA_PATHS:
        option = config_request(path, vllm_config)
        if option and path.on_request == "error":
            raise _refuse(option, path)
        options = ([option] if option else []) + env_requests(path, environ)
        if not options:
            continue
        message = f"{', '.join(options)}: {path.name} is inert on vllm-metal ({path.reason}); {path.instead}."
        logger.warning(message)
        warnings.append(message)
    return warnings


def check_repacked_quantization(model_config) -> None:
    """An AWQ / GPTQ method is served only for an AWQ / GPTQ checkpoint this
    repack reads (formats/awq_gptq.py's preflight names what it cannot)."""
    method = getattr(model_config, "quantization", None)
    if method not in REPACKED_QUANTIZATION:
        return
    from pathlib import Path

    from vllm_metal.formats import awq_gptq

    quant = getattr(model_config.hf_config, "quantization_config", None) or {}
    if not isinstance(quant, dict) or quant.get("quant_method") not in ("awq", "gptq"):
        raise ValueError(f"--quantization {method}: vllm-metal serves AWQ / GPTQ only as the checkpoint's own "
                         "quantization_config (repacked to MLX at load); this checkpoint has none. Serve it "
                         "without --quantization")
    awq_gptq.preflight(Path(model_config.model), {"quantization_config": quant})


def reject_quantization(method: str) -> None:
    """vLLM's own quantization methods all need CUDA kernels (checked by vLLM
    before the rest of the config, so the gate's error must come from here),
    except AutoAWQ / GPTQ checkpoints, which vllm-metal repacks to MLX."""
    if method in REPACKED_QUANTIZATION:
        return
    path = next(p for p in CUDA_PATHS if p.key == "quantized_kernels")
    raise _refuse(f"--quantization {method} (or the checkpoint's quantization_config)", path)


def reject_attention_backend(selected_backend) -> None:
    """vLLM asked for a torch attention backend: never on this platform."""
    if selected_backend is not None:
        logger.warning("attention backend %s is inert on vllm-metal; using the paged-attention primitive",
                       getattr(selected_backend, "name", selected_backend))


if __name__ == "__main__":
    print(markdown_table())
