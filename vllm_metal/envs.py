"""Every environment variable vllm-metal reads, with its default, its group
and its meaning: the one place they are read (`get`) and documented
(`markdown()`, the table in docs/usage.md: `python -m vllm_metal.envs --markdown`).

Values are read when asked for (not at import), so tests and forked workers
see the current environment. Imports nothing of the package (and no MLX), so
any module may read its settings through it, before mlx.core loads too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Mapping, NamedTuple


class EnvVar(NamedTuple):
    default: str | None  # None: unset (the meaning says what that does)
    group: str  # a key of GROUPS
    meaning: str  # one paragraph of Markdown, for docs/usage.md


# group -> its heading in docs/usage.md, in the order shown there
GROUPS: dict[str, str] = {
    "user": "Serving",
    "linux": "Linux and MLX's CPU device",
    "diagnostics": "Diagnostics and ablation",
}

ENV_VARS: dict[str, EnvVar] = {
    # --- user: what someone serving a model sets ---
    "VLLM_METAL_DEVICE": EnvVar(None, "user", (
        "The MLX device: `gpu` (Metal) or `cpu`. Unset: Metal on Apple Silicon; on any other host "
        "MLX's CPU device, where none of vLLM's own platforms (CUDA, ROCm, TPU, XPU, vLLM's CPU "
        "build) claims the host. `cpu` also takes a host such a platform would claim, and runs "
        "on MLX's CPU device on a Mac. `gpu` without Apple Silicon, or any other value, leaves "
        "the plugin inactive. `vllm-metal doctor` says which rule applied.")),
    "VLLM_METAL_SPEC_BUDGET": EnvVar("1", "user", (
        "Speculative decoding: `1` verifies only the drafts expected to pay for the rows they add "
        "(each request's measured acceptance against the step's measured cost per row); `0` "
        "verifies every draft, as vLLM does. Same tokens either way.")),
    "VLLM_METAL_KV_DISK": EnvVar(None, "user", (
        "A directory: turns on the disk KV cache (prefix blocks saved and restored across "
        "restarts, [kv_disk.md](kv_disk.md)); the same as `--kv-transfer-config` with "
        "vllm-metal's `MetalDiskConnector`.")),
    "VLLM_METAL_KV_DISK_MAX_BYTES": EnvVar(None, "user", (
        "Size bound of the `VLLM_METAL_KV_DISK` directory in bytes (least recently used blocks "
        "are removed first); unset: 16 GiB.")),
    "VLLM_METAL_DISTRIBUTED_BACKEND": EnvVar("ring", "user", (
        "MLX's data plane between the ranks of tensor / pipeline parallel: `ring` (TCP, any Mac "
        "or Linux host) or `jaccl` (RDMA over Thunderbolt 5 on Macs that have it; MLX's "
        "`MLX_IBV_DEVICES` names the devices). [distributed.md](distributed.md).")),
    "VLLM_METAL_DISTRIBUTED_TIMEOUT": EnvVar("300", "user", (
        "Seconds every rank waits for the others at start-up (vLLM's "
        "`--distributed-timeout-seconds` wins when set): a host that never joins stops start-up "
        "after this long.")),
    "VLLM_METAL_RING_PORT": EnvVar(None, "user", (
        "Tensor / pipeline parallel: rank r's MLX ring socket listens on this port + r (for "
        "firewalls); unset: any free port.")),
    "VLLM_METAL_RING_VIA": EnvVar(None, "user", (
        "Tensor / pipeline parallel: `RANK=HOST:PORT,...`, where the other ranks reach a rank "
        "whose ring socket is behind a forwarded port or relay.")),
    "VLLM_METAL_STEP_TIMEOUT": EnvVar("120", "user", (
        "Across hosts: seconds the engine waits for a step's answer from another host before it "
        "fails the requests and stops (sets vLLM's `VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`, 300 s "
        "by default, unless that is set).")),
    "VLLM_METAL_CACHE_DIR": EnvVar("~/.cache/vllm-metal", "user", (
        "Where vllm-metal keeps what it builds once and reuses: the tokenizers converted from "
        "GGUF files (`gguf-tokenizers/`).")),
    "VLLM_METAL_MODEL_DIR": EnvVar("~/.cache/vllm-metal/SmolLM2-135M-Instruct", "user", (
        "Where the embedded default model's directory is built "
        "(`python -m vllm_metal.formats.default_model`, `scripts/serve.sh`).")),
    # --- linux: Linux and MLX's CPU device ---
    "VLLM_METAL_BLAS": EnvVar("auto", "linux", (
        "Linux: which BLAS MLX's matmuls use, loaded before MLX. `auto`: vllm-metal's BLAS shim "
        "over numpy's OpenBLAS for matmuls (its idle workers sleep after 2^10 cycles: "
        "`OPENBLAS_THREAD_TIMEOUT=10` unless set) and the system OpenBLAS for the rest (LAPACK); "
        "`system`: the system OpenBLAS only; a path: that library; `reference`: the mlx-cpu "
        "wheel's slow reference BLAS. [Linux BLAS fix](#linux-blas-fix).")),
    "VLLM_METAL_SGEMM": EnvVar("auto", "linux", (
        "Linux x86-64: the library for matmuls of 33 rows and more (prefill, embedding batches). "
        "`auto`: Intel MKL (the `mkl` wheel; its sequential sgemm on each slice of the BLAS "
        "shim's own pool) on Intel CPUs, numpy's OpenBLAS elsewhere; `mkl`: MKL on any x86-64 "
        "CPU; `openblas`: never MKL; a path: that `libmkl_rt`. A missing library is reported by "
        "`vllm-metal doctor` and OpenBLAS does the work; any other value is refused at start. "
        "`VLLM_METAL_CPU_ISA`'s cap reaches MKL as `MKL_ENABLE_INSTRUCTIONS` (unless set).")),
    "VLLM_METAL_TCMALLOC": EnvVar("auto", "linux", (
        "Linux, MLX's CPU device: `auto` preloads tcmalloc (Debian's `libtcmalloc-minimal4`) "
        "into the engine process, which vLLM then spawns instead of forking (glibc's malloc "
        "slows a step's graph building). Left alone when `LD_PRELOAD` already names an "
        "allocator, when the engine runs in the calling process "
        "(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) or under `VLLM_WORKER_MULTIPROC_METHOD=fork`. "
        "`0`: never; a path: that library (refused if missing).")),
    "VLLM_METAL_DEQUANTIZE": EnvVar("auto", "linux", (
        "Expand MLX-quantized weights to the model dtype at load: `auto` on MLX's CPU device "
        "(its quantized matmul is far slower than BLAS) and not on Metal; `1` always; `0` never "
        "(less memory, slower on the CPU device).")),
    "VLLM_METAL_CPU_THREADS": EnvVar(None, "linux", (
        "Threads of vllm-metal's CPU kernels (paged attention, gated delta, SwiGLU) and of the "
        "BLAS shim's few-row kernel; unset: all cores. `OPENBLAS_NUM_THREADS` sizes OpenBLAS's "
        "pool.")),
    "VLLM_METAL_CPU_ISA": EnvVar(None, "linux", (
        "x86-64: caps the instruction set of vllm-metal's CPU kernels: `avx512`, `avx2` or "
        "`generic` (the BLAS shim's AVX-512 paths obey it too; with `OPENBLAS_CORETYPE=Haswell` "
        "numpy's OpenBLAS follows). Unset: the best the CPU runs. Any other value is refused at "
        "start; `vllm-metal doctor` shows the builds in use.")),
    # --- diagnostics: ablation and debugging; the defaults are what serving wants ---
    "VLLM_METAL_ATTENTION": EnvVar("auto", "diagnostics", (
        "`auto`: vllm-metal's paged-attention primitive where one exists for the device, else "
        "the plain-MLX reference; `reference`: always the reference.")),
    "VLLM_METAL_SYNC_PER_LAYER": EnvVar("0", "diagnostics", (
        "`1` evaluates the graph after every layer instead of once per engine step. Same "
        "tokens.")),
    "VLLM_METAL_SAMPLE_IN_GRAPH": EnvVar("1", "diagnostics", (
        "`1` samples a step whose every row is greedy (nothing editing its logits) inside the "
        "step's graph, only the token ids reaching the host, and under async scheduling lets "
        "the next step's graph read them there; `0` samples every step with vLLM's Sampler on "
        "the host. Same tokens.")),
    "VLLM_METAL_FUSE_PROJECTIONS": EnvVar("auto", "diagnostics", (
        "One matmul for the projections that read the same input (attention's q/k/v, a gated "
        "MLP's gate/up; weights concatenated at load): `auto` on MLX's CPU device and not on "
        "Metal; `1` always; `0` never.")),
    "VLLM_METAL_CPU_NORM_ROPE": EnvVar("auto", "diagnostics", (
        "RMSNorm and RoPE through vllm-metal's primitives (RoPE's cos/sin table computed once "
        "per step): `auto` on MLX's CPU device and not on Metal; `1` always; `0` never.")),
    "VLLM_METAL_FUSED_KV_WRITE": EnvVar("1", "diagnostics", (
        "Where RoPE runs through vllm-metal's primitive (`VLLM_METAL_CPU_NORM_ROPE`), rotate q "
        "and k and write K/V into the cache as one primitive: `1` or `0`.")),
    "VLLM_METAL_FUSED_LAYER": EnvVar("1", "diagnostics", (
        "Where the fused projections and the CPU norm/RoPE primitives both apply, run each "
        "llama-shaped decoder block (proven at load) as one primitive: `1` or `0`.")),
    "VLLM_METAL_HEAD_SCREEN": EnvVar("1", "diagnostics", (
        "Greedy steps on MLX's CPU device, on x86-64 CPUs with AVX-512 BF16 or AVX2: find each row's token "
        "through a bfloat16 screen of the float32 output head (exact float32 logits for the "
        "few tokens it cannot rule out; same tokens): `1` or `0` (every logit in float32).")),
    "VLLM_METAL_STATE_WRITEBACK": EnvVar("inplace", "diagnostics", (
        "Hybrid models' per-request states: `inplace` scatters each step's new states into the "
        "state pools, which MLX donates (no copy); `copy` copies each pool first (the cost of a "
        "write-back without donation). Identical results.")),
    "VLLM_METAL_GATED_DELTA": EnvVar("auto", "diagnostics", (
        "The Gated DeltaNet recurrence of hybrid models (qwen3_next, qwen3_5): `auto` runs "
        "vllm-metal's fused primitive on MLX's CPU device and mlx-lm's Metal kernel on the GPU; "
        "`fused` always the primitive; `mlx-lm` always mlx-lm's `gated_delta_update`. Same "
        "tokens.")),
}


def get(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value in `environ` (default: os.environ), else its default."""
    return (os.environ if environ is None else environ).get(name, ENV_VARS[name].default)


def get_bool(name: str) -> bool:
    return (get(name) or "0").strip().lower() in ("1", "true", "yes", "on")


def get_path(name: str) -> Path:
    """A directory setting, `~` expanded; set but empty means the default."""
    return Path(get(name) or ENV_VARS[name].default or "").expanduser()


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


def markdown() -> str:
    """The tables of docs/usage.md's generated block `env-vars`, one per group."""
    parts = []
    for group, heading in GROUPS.items():
        rows = [f"### {heading}", "", "| variable | default | meaning |", "|---|---|---|"]
        for name, var in ENV_VARS.items():
            if var.group == group:
                default = f"`{var.default}`" if var.default is not None else "(unset)"
                rows.append(f"| `{name}` | {default} | {var.meaning} |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m vllm_metal.envs --markdown")
    sys.stdout.write(markdown())
