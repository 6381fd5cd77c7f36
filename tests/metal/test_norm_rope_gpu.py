"""ops.rms_norm, ops.layer_norm and ops.rope on an Apple GPU: MLX's own fused norms and
the MLX-op composition of rope (the RMSNorm and RoPE primitives are
CPU-only), against float64 and the CPU primitives; the primitives refuse a
GPU stream with a message naming what to call. Skipped where the extension
has no Metal (every Linux machine): scripts/mac_verify.sh runs it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.native import ops

pytestmark = pytest.mark.skipif(
    not (ops._ext.HAS_METAL and mx.metal.is_available()),
    reason="needs the Metal build of vllm_metal on an Apple GPU (run scripts/mac_verify.sh on a Mac)")


def test_gpu_rms_norm_matches_float64_and_the_cpu_primitive():
    rng = np.random.default_rng(0)
    x = mx.array((rng.standard_normal((5, 576)) * 3).astype(np.float32))
    w = mx.array(rng.standard_normal(576).astype(np.float32))
    gpu = np.array(ops.rms_norm(x, w, 1e-5, stream=mx.gpu))
    X, W = np.array(x, np.float64), np.array(w, np.float64)
    np.testing.assert_allclose(gpu, X / np.sqrt((X * X).mean(-1, keepdims=True) + 1e-5) * W, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(gpu, np.array(ops.rms_norm(x, w, 1e-5, stream=mx.cpu)), rtol=2e-5, atol=2e-5)


def test_gpu_layer_norm_matches_the_cpu_primitive():
    """ops.layer_norm on the GPU is MLX's fused mx.fast.layer_norm; the norm
    primitive's LayerNorm mode is CPU-only and refuses a GPU stream naming the op."""
    rng = np.random.default_rng(2)
    x = mx.array((rng.standard_normal((5, 768)) * 3 + 2).astype(np.float32))
    w, b = (mx.array(rng.standard_normal(768).astype(np.float32)) for _ in range(2))
    for bias in (b, None):
        gpu = np.array(ops.layer_norm(x, w, bias, 1e-12, stream=mx.gpu))
        np.testing.assert_allclose(gpu, np.array(ops.layer_norm(x, w, bias, 1e-12, stream=mx.cpu)),
                                   rtol=2e-5, atol=2e-5)
    with pytest.raises(RuntimeError, match="layer_norm"):
        mx.eval(ops._ext.layer_norm(x, w, b, 1e-12, stream=mx.gpu))


@pytest.mark.parametrize("traditional", [False, True])
def test_gpu_rope_matches_the_cpu_primitive(traditional):
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((7, 9, 64)).astype(np.float32))
    angle = rng.uniform(0, 2 * np.pi, (7, 16))
    table = mx.array(np.stack([np.cos(angle), np.sin(angle)], -1).astype(np.float32))  # 32 of 64 dims rotated
    gpu = np.array(ops.rope(x, table, traditional=traditional, stream=mx.gpu))
    cpu = np.array(ops.rope(x, table, traditional=traditional, stream=mx.cpu))
    np.testing.assert_allclose(gpu, cpu, rtol=2e-6, atol=2e-6)


def test_the_primitives_refuse_a_gpu_stream():
    x = mx.ones((2, 3, 8))
    with pytest.raises(RuntimeError, match="vllm_metal.native.ops.rms_norm"):
        mx.eval(ops._ext.rms_norm(x, mx.ones((8,)), 1e-5, stream=mx.gpu))
    with pytest.raises(RuntimeError, match="RoPE module"):
        mx.eval(ops._ext.rope(x, mx.ones((2, 4, 2)), False, stream=mx.gpu))


def test_gpu_rope_write_kv_is_rope_then_write_kv():
    """Off the CPU, ops.rope_write_kv is ops.rope + ops.write_kv (MLX's own
    operations); the RopeWriteKV primitive is CPU-only and refuses a GPU
    stream, naming what to call."""
    rng = np.random.default_rng(4)
    q = mx.array(rng.standard_normal((3, 4, 64)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((3, 2, 64)).astype(np.float32)) for _ in range(2))
    table = mx.array(rng.uniform(-1, 1, (3, 32, 2)).astype(np.float32))
    slots = [5, -1, 30]
    got = {}
    for device in (mx.gpu, mx.cpu):
        kc, vc = mx.zeros((4, 8, 2, 64)), mx.zeros((4, 8, 2, 64))
        got[device.type] = [np.array(a) for a in ops.rope_write_kv(q, k, v, table, kc, vc, slots, stream=device)]
    for gpu, cpu in zip(got[mx.gpu.type], got[mx.cpu.type]):
        np.testing.assert_allclose(gpu, cpu, rtol=2e-5, atol=2e-5)
    with pytest.raises(RuntimeError, match="rope_write_kv"):
        mx.eval(ops._ext.rope_write_kv(q, k, v, table, mx.zeros((4, 8, 2, 64)), mx.zeros((4, 8, 2, 64)),
                                       mx.array(np.array(slots, np.int32)), False, stream=mx.gpu))
