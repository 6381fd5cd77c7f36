"""The gated-delta Metal kernel on a real Apple GPU, through eval_gpu and
MLX's command stream, against the float64 definition, the CPU primitive and
mlx-lm's own Metal kernel; the state donated in place. Skipped where the
extension has no Metal (every Linux machine): scripts/mac_verify.sh runs it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from numpy_reference import gated_delta_f64, gated_delta_inputs
from vllm_metal.native import ops

pytestmark = pytest.mark.skipif(
    not (ops._ext.HAS_METAL and mx.metal.is_available()),
    reason="needs the Metal build of vllm_metal on an Apple GPU (run scripts/mac_verify.sh on a Mac)")

TOL = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def mx_inputs(arrays, dtype):
    q, k, v, g, beta, state, mask = arrays
    return ([mx.array(a).astype(dtype) for a in (q, k, v)] + [mx.array(g), mx.array(beta), mx.array(state)],
            None if mask is None else mx.array(mask))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("key_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_matches_definition_and_cpu_primitive(rng, dtype, key_dim, masked):
    arrays = gated_delta_inputs(rng, batch=3, steps=9, k_heads=2, v_heads=4, key_dim=key_dim, value_dim=20,
                                masked=masked)
    args, mask = mx_inputs(arrays, dtype)
    y_gpu, s_gpu = ops.gated_delta(*args, mask, stream=mx.gpu)
    y_cpu, s_cpu = ops.gated_delta(*args, mask, stream=mx.cpu)
    as64 = lambda a: np.array(a.astype(mx.float32), np.float64)  # noqa: E731
    y_ref, s_ref = gated_delta_f64(*(as64(a) for a in args[:3]), *arrays[3:6], arrays[6])
    tol = TOL[dtype]
    np.testing.assert_allclose(as64(y_gpu), y_ref, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.array(s_gpu), s_ref, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(as64(y_gpu), as64(y_cpu), atol=tol, rtol=tol)
    np.testing.assert_allclose(np.array(s_gpu), np.array(s_cpu), atol=2e-5, rtol=2e-5)


def test_gpu_agrees_with_mlx_lm_kernel(rng):
    from mlx_lm.models.gated_delta import gated_delta_kernel

    arrays = gated_delta_inputs(rng, batch=2, steps=16, k_heads=16, v_heads=32, key_dim=128, value_dim=128)
    args, _ = mx_inputs(arrays, mx.bfloat16)
    with mx.stream(mx.gpu):
        y_ref, s_ref = gated_delta_kernel(*args)
    y, s = ops.gated_delta(*args, stream=mx.gpu)
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), np.array(y_ref.astype(mx.float32)),
                               atol=1.6e-2, rtol=1.6e-2)
    np.testing.assert_allclose(np.array(s), np.array(s_ref), atol=1e-4, rtol=1e-4)
