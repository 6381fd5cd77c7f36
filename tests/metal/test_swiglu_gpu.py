"""ops.swiglu on an Apple GPU: MLX's own composition (the SwiGLU primitive is
CPU-only), against float64 and the CPU primitive; the primitive itself refuses
a GPU stream with a message naming the op. Skipped where the extension has no
Metal (every Linux machine): scripts/mac_verify.sh runs it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.native import ops

pytestmark = pytest.mark.skipif(
    not (ops._ext.HAS_METAL and mx.metal.is_available()),
    reason="needs the Metal build of vllm_metal on an Apple GPU (run scripts/mac_verify.sh on a Mac)")


def test_gpu_swiglu_matches_float64_and_the_cpu_primitive():
    rng = np.random.default_rng(0)
    g = mx.array((rng.standard_normal((5, 1536)) * 4).astype(np.float32))
    u = mx.array(rng.standard_normal((5, 1536)).astype(np.float32))
    gpu = np.array(ops.swiglu(g, u, stream=mx.gpu))
    G, U = np.array(g, np.float64), np.array(u, np.float64)
    np.testing.assert_allclose(gpu, G / (1 + np.exp(-G)) * U, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(gpu, np.array(ops.swiglu(g, u, stream=mx.cpu)), rtol=2e-6, atol=2e-6)


def test_the_primitive_refuses_a_gpu_stream():
    g = mx.ones((2, 3))
    with pytest.raises(RuntimeError, match="vllm_metal.native.ops.swiglu"):
        mx.eval(ops._ext.swiglu(g, g, stream=mx.gpu))


def test_gpu_gelu_matches_the_cpu_primitive():
    """ops.gelu on the GPU is MLX's own nn.gelu / gelu_approx; the GELU
    primitive is CPU-only and refuses a GPU stream naming the op."""
    rng = np.random.default_rng(1)
    x = mx.array((rng.standard_normal((5, 3072)) * 3).astype(np.float32))
    for approximate in (False, True):
        gpu = np.array(ops.gelu(x, approximate=approximate, stream=mx.gpu))
        np.testing.assert_allclose(gpu, np.array(ops.gelu(x, approximate=approximate, stream=mx.cpu)),
                                   rtol=2e-6, atol=2e-6)
    with pytest.raises(RuntimeError, match="vllm_metal.native.ops.gelu"):
        mx.eval(ops._ext.gelu(x, stream=mx.gpu))


def test_gpu_argmax_head_matches_the_cpu_primitive():
    """ops.argmax_head on the GPU is MLX's own matmul and argmax; the
    ArgmaxHead primitive is CPU-only and refuses a GPU stream naming the op."""
    rng = np.random.default_rng(2)
    h = mx.array(rng.standard_normal((24, 128)).astype(np.float32))
    w = mx.array(rng.standard_normal((5000, 128)).astype(np.float32))
    np.testing.assert_array_equal(np.array(ops.argmax_head(h, w, stream=mx.gpu)),
                                  np.array(ops.argmax_head(h, w, stream=mx.cpu)))
    with pytest.raises(RuntimeError, match="vllm_metal.native.ops.argmax_head"):
        mx.eval(ops._ext.argmax_head(h, w, stream=mx.gpu))
