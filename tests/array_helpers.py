"""Conversions and tolerances shared by the primitive tests."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# Absolute/relative tolerance against float64, per storage dtype: the output
# is rounded once to the dtype (bf16 has 8 significant bits, f16 11) after a
# float32 softmax.
TOLERANCE = {"float32": (2e-5, 1e-4), "float16": (4e-3, 4e-3), "bfloat16": (3e-2, 2e-2)}


def to_mx(x: np.ndarray, dtype: str | None = None) -> mx.array:
    a = mx.array(x)
    return a.astype(MX_DTYPES[dtype]) if dtype else a


def to_np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)) if a.dtype == mx.bfloat16 else np.array(a)
