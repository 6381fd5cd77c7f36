"""Element-wise layer operations (SwiGLU, RMSNorm, RoPE) and the gated delta
recurrence as lazy MLX operations; `vllm_metal.native.ops` re-exports them.

Each builds a graph node and returns at once. On MLX's CPU device they run
this package's native primitives; elsewhere MLX's own operations (or, for
gated_delta, the native Metal kernel where the build has one).
"""

from __future__ import annotations

from vllm_metal import envs
from vllm_metal.native import fast_blas

fast_blas.preload()  # normally done already (see vllm_metal/__init__.py)
fast_blas.warn_if_too_late()

from vllm_metal.native.extension import load_extension  # noqa: E402

envs.cpu_isa_cap()  # a VLLM_METAL_CPU_ISA the kernels would not understand is refused before they run
_ext = load_extension()

import mlx.core as mx  # noqa: E402

def _check_array(value, name: str) -> None:
    if not isinstance(value, mx.array):
        raise TypeError(f"{name} must be an mx.array, got {type(value).__name__}")


def _device_of(stream) -> mx.Device:
    if stream is None:
        return mx.default_device()
    if isinstance(stream, mx.Device):
        return stream
    if isinstance(stream, mx.DeviceType):  # mx.cpu / mx.gpu, as MLX ops accept
        return mx.Device(stream)
    if isinstance(stream, mx.Stream):
        return stream.device
    raise TypeError(f"stream must be an mx.Stream, mx.Device, mx.cpu/mx.gpu or None, got {type(stream).__name__}")


def swiglu(gate: mx.array, up: mx.array, *, stream=None) -> mx.array:
    """silu(gate) * up (a gated MLP's activation), lazy, in gate's dtype.

    On MLX's CPU device this is vllm-metal's SwiGLU primitive (16-lane
    vectors; MLX's own CPU exp/sigmoid run through libm one element at a
    time); on the GPU it is MLX's own (already vectorised) composition.
    gate and up must have the same shape and floating dtype (ValueError).
    """
    _check_array(gate, "gate")
    _check_array(up, "up")
    if _device_of(stream).type != mx.DeviceType.cpu:
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise ValueError(f"[swiglu] gate and up must have the same shape and dtype, got "
                             f"{tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}")
        return mx.multiply(mx.multiply(gate, mx.sigmoid(gate, stream=stream), stream=stream), up, stream=stream)
    return _ext.swiglu(gate, up, stream=stream)


def gelu(x: mx.array, *, approximate: bool = False, stream=None) -> mx.array:
    """GELU, lazy, in x's dtype: 0.5 x (1 + erf(x / sqrt(2))), or with
    approximate the tanh form (transformers' "gelu_pytorch_tanh" / "gelu_new").

    On MLX's CPU device this is vllm-metal's GELU primitive (16-lane vectors;
    MLX's own CPU erf / tanh run through libm one element at a time); on the
    GPU it is MLX's own (already vectorised) nn.gelu / nn.gelu_approx.
    """
    _check_array(x, "x")
    if _device_of(stream).type != mx.DeviceType.cpu:
        import mlx.nn as nn

        with mx.stream(stream if stream is not None else mx.default_device()):
            return nn.gelu_approx(x) if approximate else nn.gelu(x)
    return _ext.gelu(x, approximate=bool(approximate), stream=stream)


def rms_norm(x: mx.array, weight: mx.array, eps: float, *, stream=None) -> mx.array:
    """x / sqrt(mean(x^2, last axis) + eps) * weight, lazy, in x's dtype.

    On MLX's CPU device this is vllm-metal's RMSNorm primitive (one pass per
    row; MLX's CPU mx.fast.rms_norm is its ~15-operation fallback
    composition); elsewhere MLX's own fused mx.fast.rms_norm. weight: [dim]
    of x's dtype (ValueError otherwise).
    """
    _check_array(x, "x")
    _check_array(weight, "weight")
    if weight.ndim != 1 or x.ndim < 1 or weight.shape[0] != x.shape[-1] or weight.dtype != x.dtype:
        raise ValueError(f"[rms_norm] weight must be [{x.shape[-1] if x.ndim else '?'}] of x's dtype {x.dtype}, "
                         f"got {tuple(weight.shape)} {weight.dtype}")
    if _device_of(stream).type != mx.DeviceType.cpu:
        return mx.fast.rms_norm(x, weight, float(eps), stream=stream)
    return _ext.rms_norm(x, weight, float(eps), stream=stream)


def layer_norm(x: mx.array, weight: mx.array, bias: mx.array | None, eps: float, *, stream=None) -> mx.array:
    """(x - mean) / sqrt(var + eps) * weight [+ bias] over the last axis,
    lazy, in x's dtype (encoders' LayerNorm).

    On MLX's CPU device this is vllm-metal's norm primitive in its LayerNorm
    mode (one pass per row over the kernels' threads; MLX's CPU
    mx.fast.layer_norm is a single-threaded fallback composition); elsewhere
    MLX's own fused mx.fast.layer_norm. weight and bias: [dim] of x's dtype
    (ValueError otherwise); bias may be None.
    """
    _check_array(x, "x")
    for name, v in (("weight", weight), ("bias", bias)):
        if v is None and name == "bias":
            continue
        _check_array(v, name)
        if v.ndim != 1 or x.ndim < 1 or v.shape[0] != x.shape[-1] or v.dtype != x.dtype:
            raise ValueError(f"[layer_norm] {name} must be [{x.shape[-1] if x.ndim else '?'}] of x's dtype "
                             f"{x.dtype}, got {tuple(v.shape)} {v.dtype}")
    if _device_of(stream).type != mx.DeviceType.cpu:
        return mx.fast.layer_norm(x, weight, bias, float(eps), stream=stream)
    return _ext.layer_norm(x, weight, bias, float(eps), stream=stream)


def rope(x: mx.array, table: mx.array, *, traditional: bool = False, stream=None) -> mx.array:
    """Rotary embedding of packed tokens from a per-token table, lazy, in x's dtype.

    x: [tokens, heads, dim]; table: float32 [tokens, rotated / 2, 2], the
    (cos, sin) of each rotated pair with any scale folded in (rotated <=
    dim; the dims past it are copied). Pairs are (i, i + rotated / 2), or
    (2i, 2i + 1) when `traditional`: each pair (a, b) becomes
    (a cos - b sin, b cos + a sin). The table is computed once per step and
    shared by every layer (vllm_metal/models/cpu_norm_rope.py). On MLX's CPU device
    this is vllm-metal's RoPE primitive; elsewhere the same formula in MLX
    ops (on Metal the adapter calls the model's own fused RoPE instead).
    """
    _check_array(x, "x")
    _check_array(table, "table")
    if x.ndim != 3 or table.ndim != 3 or table.shape[0] != x.shape[0] or table.shape[2] != 2 \
            or not 1 <= table.shape[1] <= x.shape[2] // 2 or table.dtype != mx.float32:
        raise ValueError(f"[rope] x must be [tokens, heads, dim] and table float32 [tokens, rotated / 2, 2] "
                         f"with rotated <= dim, got x {tuple(x.shape)} and table {tuple(table.shape)} {table.dtype}")
    if _device_of(stream).type == mx.DeviceType.cpu:
        return _ext.rope(x, table, bool(traditional), stream=stream)
    return rope_composed(x, table, traditional=traditional, stream=stream)


def rope_composed(x: mx.array, table: mx.array, *, traditional: bool = False, stream=None) -> mx.array:
    """`rope` built from MLX ops (any device; what `rope` runs off the CPU)."""
    rotated = 2 * table.shape[1]
    cos, sin = table[:, None, :, 0], table[:, None, :, 1]
    xf = x.astype(mx.float32, stream=stream)
    if traditional:
        a, b = xf[..., 0:rotated:2], xf[..., 1:rotated:2]
        turned = mx.stack([a * cos - b * sin, b * cos + a * sin], axis=-1, stream=stream)
        turned = turned.reshape(x.shape[0], x.shape[1], rotated)
    else:
        a, b = xf[..., :rotated // 2], xf[..., rotated // 2:rotated]
        turned = mx.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1, stream=stream)
    return mx.concatenate([turned, xf[..., rotated:]], axis=-1, stream=stream).astype(x.dtype, stream=stream)


GATED_DELTA_PATHS = ("auto", "fused", "mlx-lm")
GATED_DELTA_KEY_DIMS = (32, 64, 128, 256)  # what the primitive supports (csrc/gated_delta.h)
GATED_DELTA_MAX_VALUE_DIM = 256


def cpu_kernels() -> dict:
    """The instruction set of the CPU kernels' builds in use ("avx512", "avx2" or
    "generic"), the best this CPU runs, the VLLM_METAL_CPU_ISA cap if any, and
    the build of the greedy head's bfloat16 screen it runs ("avx512bf16",
    "avx2", or "": none; ops.argmax_head_screen): what `vllm-metal doctor`, the
    worker's start line and every benchmark record."""
    return {"isa": _ext.cpu_attention_variant(), "host_isa": _ext.cpu_host_isa(),
            "cap": envs.cpu_isa_cap(), "head_screen": _ext.argmax_head_screen_build()}


def gated_delta_path(stream=None) -> tuple[str, str]:
    """Which implementation Gated DeltaNet layers use on `stream`: (name,
    reason); name is "fused" (this package's primitive) or "mlx-lm" (mlx-lm's
    gated_delta_update). VLLM_METAL_GATED_DELTA picks; a bad value raises."""
    mode = (envs.get("VLLM_METAL_GATED_DELTA") or "auto").strip().lower()
    if mode not in GATED_DELTA_PATHS:
        raise ValueError(f"VLLM_METAL_GATED_DELTA={mode!r}: expected one of {', '.join(GATED_DELTA_PATHS)}")
    device = _device_of(stream)
    if mode == "mlx-lm":
        return "mlx-lm", "VLLM_METAL_GATED_DELTA=mlx-lm"
    if device.type == mx.DeviceType.cpu:
        return "fused", "native C++ primitive on MLX's CPU device"
    if mode == "fused":
        if _ext.HAS_METAL:
            return "fused", "VLLM_METAL_GATED_DELTA=fused: the primitive's Metal kernel"
        return "mlx-lm", "this build has no Metal kernels; mlx-lm's gated_delta_update instead"
    return "mlx-lm", "mlx-lm's own Metal kernel on MLX's GPU device"


def gated_delta(q, k, v, g, beta, state, mask=None, *, stream=None) -> tuple[mx.array, mx.array]:
    """Lazy gated delta rule recurrence over a right-padded batch (the math of
    mlx-lm's gated_delta_update once g and beta are computed; see
    csrc/gated_delta.h): returns (y [B, T, Hv, Dv] in q's dtype, final state
    [B, Hv, Dv, Dk] float32).

        q, k   [B, T, Hk, Dk]    Dk one of 32, 64, 128, 256
        v      [B, T, Hv, Dv]    Hv a multiple of Hk, 1 <= Dv <= 256
        g      [B, T, Hv]        decay per step (scalar gating)
        beta   [B, T, Hv]
        state  [B, Hv, Dv, Dk]   float32
        mask   bool [B, T] or None: steps where it is False give y = 0 and leave the state

    Runs the native primitive on the CPU and, where this build has Metal, on
    the GPU. Shape or dtype mistakes raise ValueError naming the argument.
    """
    for name, value in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
        _check_array(value, name)
    if mask is not None:
        _check_array(mask, "mask")
    if _device_of(stream).type != mx.DeviceType.cpu and not _ext.HAS_METAL:
        raise ValueError("gated_delta: this build has no Metal kernels; use the CPU stream "
                         "(or mlx-lm's gated_delta_update)")
    y, new_state = _ext.gated_delta(q, k, v, g, beta, state, mask, stream=stream)
    return y, new_state
