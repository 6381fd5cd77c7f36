"""The greedy output head: each row's argmax token over the vocabulary of
hidden @ weight^T, lazy, without the [rows, vocab] logits (ArgmaxHead), and
the bfloat16 screen that lets the CPU find the same tokens with a fraction of
the exact products (docs/primitives.md#argmax_head).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from vllm_metal import envs
from vllm_metal.native.elementwise import _check_array, _device_of
from vllm_metal.native.extension import load_extension

_ext = load_extension()

import mlx.core as mx  # noqa: E402

logger = logging.getLogger(__name__)

# Rows from which the CPU primitive beats MLX's matmul + argmax (measured in
# docs/primitives.md#argmax_head; below it OpenBLAS's few-row product wins);
# with a screen the primitive takes every row count.
ARGMAX_HEAD_MIN_ROWS = 8
# The screen's AVX2 build (two FMAs a bfloat16 pair, as many as the exact
# kernel's a float32 product) pays where the head's bytes bound the call:
# up to this many rows (measured: docs/benchmarks.md#the-greedy-heads-screen);
# from it the exact kernel runs. The AVX-512 BF16 build screens every count.
AVX2_SCREEN_MAX_ROWS = 7


class HeadScreen(NamedTuple):
    """A float32 head's screen (argmax_head_screen): its bfloat16 copy in the
    kernel's layout, its per-token bound factors, and the most rows a call
    screens (more: the exact kernel)."""

    weight: mx.array  # uint16 bfloat16 bit patterns, [tiles][pairs][16][2] flattened
    table: mx.array  # float32 [tiles * 16]
    max_rows: int | None = None  # None: any


def argmax_head(hidden: mx.array, weight: mx.array, *, screen: HeadScreen | None = None,
                stream=None) -> mx.array:
    """Each row's greedy token: int32 [rows], argmax over the vocabulary of
    hidden [rows, dim] @ weight [vocab, dim]^T (the first index on ties), lazy.

    On MLX's CPU device, for float32 rows, this is vllm-metal's ArgmaxHead
    primitive (the logits stay in registers: no [rows, vocab] product
    written and read back): from ARGMAX_HEAD_MIN_ROWS rows, or from one row
    with `screen` (argmax_head_screen(weight)), through which the CPU finds
    the same tokens screening the vocabulary in bfloat16 first. Otherwise
    MLX's own matmul and argmax. Shape or dtype mistakes raise ValueError.
    """
    _check_array(hidden, "hidden")
    _check_array(weight, "weight")
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"[argmax_head] hidden must be [rows, dim] and weight [vocab, dim], got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("[argmax_head] the vocabulary (weight's first axis) is empty")
    if screen is not None and not isinstance(screen, HeadScreen):
        raise TypeError(f"screen must be a HeadScreen (argmax_head_screen), got {type(screen).__name__}")
    if hidden.shape[0] == 0:
        return mx.zeros((0,), dtype=mx.int32)
    if screen is not None and screen.max_rows is not None and hidden.shape[0] > screen.max_rows:
        screen = None
    if (_device_of(stream).type == mx.DeviceType.cpu and hidden.dtype == mx.float32
            and weight.dtype == mx.float32 and (screen is not None or hidden.shape[0] >= ARGMAX_HEAD_MIN_ROWS)):
        if screen is None:
            return _ext.argmax_head(hidden, weight, stream=stream)
        return _ext.argmax_head(hidden, weight, screen_weight=screen.weight, screen_table=screen.table,
                                stream=stream)
    logits = mx.matmul(hidden, weight.T, stream=stream)
    return mx.argmax(logits, axis=-1, stream=stream).astype(mx.int32, stream=stream)


def screen_build() -> str:
    """The screened kernel's build this CPU runs: "avx512bf16" (x86-64 with
    AVX-512 BF16, the kernels running their AVX-512 build), "avx2" (the
    kernels running their AVX2 build: an AVX2-only CPU, or
    VLLM_METAL_CPU_ISA=avx2), or "" (none)."""
    return _ext.argmax_head_screen_build()


def screen_available() -> bool:
    """Whether argmax_head's screen is used here: the CPU runs a build of the
    screened kernel (screen_build) and VLLM_METAL_HEAD_SCREEN is on."""
    return envs.strict_switch("VLLM_METAL_HEAD_SCREEN") and bool(screen_build())


def argmax_head_screen(weight: mx.array) -> HeadScreen | None:
    """The screen of a float32 [vocab, dim] head for argmax_head, built now
    (~half the head's bytes), or None where it would not be used
    (screen_available() is false) or this head cannot be screened (a
    non-finite weight, a row's max |w| outside [2^-40, 2^40]: logged)."""
    _check_array(weight, "weight")
    if weight.ndim != 2 or weight.dtype != mx.float32:
        raise ValueError(f"[argmax_head_screen] the weight must be float32 [vocab, dim], got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if not screen_available():
        return None
    try:
        wb, table = _ext.argmax_head_screen(weight)
    except ValueError as e:
        logger.info("vllm-metal: greedy steps use the exact head: %s", e)
        return None
    build = screen_build()
    logger.info("vllm-metal: greedy steps screen the %d x %d head in bfloat16 (%.1f MiB, the %s kernel; "
                "VLLM_METAL_HEAD_SCREEN=0 turns it off)", weight.shape[0], weight.shape[1],
                (wb.nbytes + table.nbytes) / 2**20, build)
    return HeadScreen(wb, table, AVX2_SCREEN_MAX_ROWS if build == "avx2" else None)


def screen_counters() -> dict[str, int]:
    """The screened kernel's work in this process: calls, rows, exact (the
    candidates' logits computed), declined (calls sent to the exact kernel:
    a row outside the screen's range)."""
    return dict(zip(("calls", "rows", "exact", "declined"), _ext.argmax_head_screen_counters()))
