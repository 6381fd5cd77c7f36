"""Whether a model fits before its weights are read: the weights, the KV cache
one request of --max-model-len needs, and what the device leaves for them.

Pure arithmetic (no MLX, no vLLM). The caller says what each layer caches
(`LayerCache`: doctor/footprint.py derives it from the model built lazily from
its config) and how many bytes the weights take as they will be loaded. The
KV arithmetic is vLLM 0.33's per-layer `max_memory_usage_bytes`:

- full attention and latent attention (MLA): cdiv(max_model_len, block) blocks;
- a sliding window: cdiv(min(window - 1 + in-flight tokens, max_model_len),
  block) + 1 blocks (`SlidingWindowSpec`), but only where vLLM keeps windows:
  with its hybrid KV-cache manager on (the platform leaves it on for hybrid
  linear-attention models, and for sliding-window models on Metal and on
  MLX's CPU device alike, where the runner shares one array pair among a
  layer of each cache group as vLLM plans: unless the attention layers'
  shapes differ, `windows_kept`), or when every attention layer has one.
  Otherwise (the manager off, e.g. by --disable-hybrid-kv-cache-manager,
  full-attention layers beside windowed ones) vLLM plans the windowed
  layers as full attention (`_promote_local_kv_cache_specs`);
- a linear-attention layer: its state, once (twice under prefix caching's
  "align" mode: `MambaSpec`).

This sum is a lower bound of what vLLM's own check after loading asks (its
groups' padding, and the runner's arrays of layers it cannot share, only add
to it), so a refusal here is
one vLLM would make later, after loading the weights; that check still runs.
The available memory is the worker's (engine/worker.py): --gpu-memory-utilization
x the device's memory (Metal's recommended working set, or RAM on MLX's CPU
device, capped there at CPU_DEFAULT_KV_CAP_BYTES for the cache), less the
weights; --kv-cache-memory-bytes replaces it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from vllm_metal.native.memory import CPU_DEFAULT_KV_CAP_BYTES

GiB = 1 << 30
# vLLM's 8-bit --kv-cache-dtype names (native/kv_quant.FORMATS: one byte per
# value; fp8_per_token_head rows end in a float32 scale).
EIGHT_BIT_KV = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head")
ROW_SCALE_BYTES = 4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_row_bytes(cache_dtype: str | None, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one cached row (one token, one KV head, K or V) of `head_dim` values."""
    if cache_dtype == "fp8_per_token_head":
        return head_dim + ROW_SCALE_BYTES
    if cache_dtype in EIGHT_BIT_KV:
        return head_dim
    return head_dim * dtype_bytes  # "auto" (or the model's own dtype named): the model dtype


@dataclass(frozen=True)
class LayerCache:
    """One layer's own cache. Attention: `rows` rows a token per KV head (2:
    K and V; 1: MLA's latent row, `head_dim` = kv_lora_rank + rope dims), in
    a window or not. Linear attention: `state_bytes` per request."""

    kv_heads: int = 0
    head_dim: int = 0
    rows: int = 2
    window: int | None = None
    state_bytes: int = 0

    def token_bytes(self, cache_dtype: str | None, dtype_bytes: int) -> int:
        return self.rows * self.kv_heads * kv_row_bytes(cache_dtype, self.head_dim, dtype_bytes)


@dataclass(frozen=True)
class Plan:
    """How vLLM will size the cache: the flags that matter and its defaults."""

    max_model_len: int
    cache_dtype: str = "auto"
    dtype_bytes: int = 2  # the serving dtype's (bfloat16 / float16: 2; float32: 4)
    block_size: int = 16
    # vLLM's max_in_flight_tokens: concurrent batches (2 under async scheduling) x max_num_batched_tokens
    in_flight_tokens: int = 2 * 2048
    hybrid_manager: bool = False  # vLLM's hybrid KV-cache manager on
    align: bool = False  # linear-attention states under prefix caching (mamba_cache_mode "align")


def windows_kept(layers: list[LayerCache], hybrid_manager: bool, cache_dtype: str = "auto") -> bool:
    """Whether vLLM sizes windowed layers to their window (see the module).
    With the manager on, beside full-attention layers of another shape and
    no linear-attention state, or with an 8-bit cache (no in-place 8-bit
    write: a shared array would be copied by every later writer, every
    step), the runner declares the windows as full attention
    (engine/kv_specs.keeps_windows)."""
    attention = [layer for layer in layers if not layer.state_bytes]
    if all(layer.window for layer in attention):
        return True
    if not hybrid_manager or cache_dtype != "auto":
        return False
    return len(attention) < len(layers) or len({(a.kv_heads, a.head_dim, a.rows) for a in attention}) <= 1


def layer_request_bytes(layer: LayerCache, plan: Plan, keep_windows: bool, max_model_len: int | None = None) -> int:
    """The bytes one request of `max_model_len` (default: the plan's) holds in `layer`."""
    length = plan.max_model_len if max_model_len is None else max_model_len
    if layer.state_bytes:
        return layer.state_bytes * (2 if plan.align else 1)
    if layer.window and keep_windows:
        blocks = cdiv(min(layer.window - 1 + plan.in_flight_tokens, length), plan.block_size) + 1
    else:
        blocks = cdiv(length, plan.block_size)
    return blocks * plan.block_size * layer.token_bytes(plan.cache_dtype, plan.dtype_bytes)


def kv_bytes(layers: list[LayerCache], plan: Plan, max_model_len: int | None = None) -> int:
    """The KV cache one request of `max_model_len` (default: the plan's) needs."""
    keep = windows_kept(layers, plan.hybrid_manager, plan.cache_dtype)
    return sum(layer_request_bytes(layer, plan, keep, max_model_len) for layer in layers)


def block_bytes(layers: list[LayerCache], plan: Plan) -> int:
    """One block id's bytes over every layer: vLLM holds one back (its null block)."""
    return sum(layer.state_bytes or plan.block_size * layer.token_bytes(plan.cache_dtype, plan.dtype_bytes)
               for layer in layers)


@dataclass(frozen=True)
class Device:
    """The memory the engine may use on one rank."""

    name: str  # MLX's device: "gpu" (Metal) or "cpu"
    total: int  # Metal's recommended working set, or RAM, divided among the ranks on the host
    utilization: float = 0.92  # --gpu-memory-utilization (vLLM's default)
    kv_cache_memory_bytes: int | None = None  # --kv-cache-memory-bytes

    @property
    def what(self) -> str:
        return "Metal's recommended working set" if self.name == "gpu" else "RAM"


@dataclass
class Fit:
    fits: bool
    weights: int
    kv_needed: int  # one request of max_model_len, with vLLM's null block
    available: int  # for the KV cache
    fixes: list[str] = field(default_factory=list)
    message: str = ""


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def available_for_kv(device: Device, weights: int) -> int:
    """The worker's budget before loading: what it will compute, less what the
    process holds besides the weights (unknown yet, so the budget is an upper
    bound and the check a lower bound)."""
    if device.kv_cache_memory_bytes:
        return int(device.kv_cache_memory_bytes)
    budget = int(device.utilization * device.total) - weights
    return min(budget, CPU_DEFAULT_KV_CAP_BYTES) if device.name == "cpu" else budget


def longest_fitting(layers: list[LayerCache], plan: Plan, available: int) -> int:
    """The largest max_model_len (a whole number of blocks) whose request fits
    in `available`; 0 when not even one block does."""
    reserve = block_bytes(layers, plan)
    lo, hi = 0, plan.max_model_len // plan.block_size
    while lo < hi:  # in blocks: kv_bytes grows with the length
        mid = (lo + hi + 1) // 2
        if kv_bytes(layers, plan, mid * plan.block_size) + reserve <= available:
            lo = mid
        else:
            hi = mid - 1
    return lo * plan.block_size


def check(weights: int, layers: list[LayerCache], plan: Plan, device: Device, *, share: int = 1,
          label: str = "the model", weights_note: str = "", smaller_weights: int | None = None,
          packed_weights: int | None = None, auto_length: bool = False) -> Fit:
    """Whether one request of plan.max_model_len fits beside the weights.

    weights: the whole model's bytes as they will be resident; share: ranks
    the model is split over (tensor x pipeline parallel: each holds about
    1/share of the weights and of the cache, a lower bound where layers or KV
    heads are replicated); smaller_weights: the weights in a 4-bit build
    (named as the fix when the weights alone do not fit); packed_weights:
    the quantized weights kept packed where `weights` expands them (MLX's CPU
    device: VLLM_METAL_DEQUANTIZE=0 is then a fix); auto_length:
    --max-model-len -1 (vLLM picks the longest that fits: only the weights
    are judged)."""
    weights_rank = weights // share
    needed = (kv_bytes(layers, plan) + block_bytes(layers, plan)) // share if layers else 0
    available = available_for_kv(device, weights_rank)
    fit = Fit(fits=True, weights=weights_rank, kv_needed=needed, available=available)
    explicit = device.kv_cache_memory_bytes
    room = int(device.utilization * device.total)
    how = f" ({weights_note})" if weights_note else ""
    per_rank = f" per rank ({share} ranks)" if share > 1 else ""
    if not explicit and weights_rank >= room:
        fit.fits = False
        packed = packed_weights if packed_weights is not None and packed_weights < weights else None
        if packed is not None and available_for_kv(device, packed // share) >= needed:
            fit.fixes.append(f"VLLM_METAL_DEQUANTIZE=0 (the quantized weights kept packed: {_gib(packed // share)}; "
                             "MLX's CPU quantized matmul is slower than the expanded weights' BLAS)")
        util = math.ceil((weights_rank + needed) / device.total * 100) / 100
        if util <= 1.0:
            fit.fixes.append(f"--gpu-memory-utilization {util:.2f}")
        if smaller_weights is not None and smaller_weights < (packed or weights):
            fit.fixes.append(f"a smaller quantization (a 4-bit build takes about {_gib(smaller_weights // share)})")
        elif not fit.fixes:
            fit.fixes.append("a smaller quantization, or a smaller model")
        fit.message = (f"vllm-metal: {label} does not fit: its weights take {_gib(weights_rank)}{how}{per_rank}, "
                       f"and --gpu-memory-utilization {device.utilization:.2f} x {_gib(device.total)} "
                       f"({device.what}) = {_gib(room)} leaves nothing for the KV cache. To serve it: "
                       + "; or ".join(fit.fixes) + ".")
        return fit
    if auto_length or not layers or needed <= available:
        return fit
    fit.fits = False
    length = plan.max_model_len
    longest = longest_fitting(layers, plan, available * share)
    if longest >= plan.block_size:
        fit.fixes.append(f"--max-model-len {longest} (the longest that fits)")
    if not explicit:
        util = math.ceil((weights_rank + needed) / device.total * 100) / 100
        capped = device.name == "cpu" and needed > CPU_DEFAULT_KV_CAP_BYTES
        if util <= 1.0 and not capped:
            fit.fixes.append(f"--gpu-memory-utilization {util:.2f}")
    eight_bit = all(layer.rows == 2 or layer.state_bytes for layer in layers)  # MLA keeps the model dtype
    if plan.cache_dtype not in EIGHT_BIT_KV and eight_bit and plan.dtype_bytes > 1:
        plan8 = replace(plan, cache_dtype="fp8")
        needed8 = (kv_bytes(layers, plan8) + block_bytes(layers, plan8)) // share
        if needed8 <= available:
            fit.fixes.append(f"--kv-cache-dtype fp8 (8-bit: {_gib(needed8)} for --max-model-len {length})")
    mib = cdiv(needed, 1 << 20) << 20
    if weights_rank + mib <= device.total:  # the device holds it beside the weights
        fit.fixes.append(f"--kv-cache-memory-bytes {mib} ({_gib(mib)})")
    if not fit.fixes:
        fit.fixes.append("a shorter --max-model-len, a smaller quantization, or a smaller model")
    if explicit:
        where = f"--kv-cache-memory-bytes {explicit} gives it {_gib(available)}"
    else:
        cap = " (the CPU device's default cap; --kv-cache-memory-bytes sets any size)" \
            if device.name == "cpu" and available == CPU_DEFAULT_KV_CAP_BYTES else ""
        where = (f"--gpu-memory-utilization {device.utilization:.2f} x {_gib(device.total)} ({device.what}) "
                 f"= {_gib(room)}, less {_gib(weights_rank)} of weights{how}, leaves {_gib(available)}{cap}")
    fit.message = (f"vllm-metal: {label} does not fit: one request of --max-model-len {length} needs "
                   f"{_gib(needed)} of KV cache{per_rank} ({len(layers)} layers, --kv-cache-dtype "
                   f"{plan.cache_dtype}), and {where}. To serve it: " + "; or ".join(fit.fixes) + ".")
    return fit
