"""The Metal kernels on a real Apple GPU, through eval_gpu and MLX's command
stream, against the CPU primitive: the same batches as the executor tests,
plus what only the real path has (MLX views, laziness inside a larger graph).
Skipped where the extension has no Metal (every Linux machine)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from paged_attention_cases import (BAD_INPUTS, DTYPES, KINDS, MX_DTYPES, assert_close,
                                   break_case, cpu_reference, make_case, mx_inputs,
                                   numpy_reference)
from vllm_metal.native import ops

pytestmark = pytest.mark.skipif(
    not (ops._ext.HAS_METAL and mx.metal.is_available()),
    reason="needs the Metal build of vllm_metal on an Apple GPU (run scripts/mac_verify.sh on a Mac)")


def gpu(case, inputs=None):
    out = ops.paged_attention(*(inputs or mx_inputs(case)), **case.kwargs(), stream=mx.gpu)
    return np.array(out.astype(mx.float32))


def test_gpu_uses_the_metal_kernel(monkeypatch):
    monkeypatch.delenv("VLLM_METAL_ATTENTION", raising=False)
    ops.reload_settings()
    assert ops.attention_path(mx.gpu)[0] == "metal"


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_matches_cpu_primitive(rng, dtype, head_dim, group, block_size, kind):
    case = make_case(rng, dtype=dtype, head_dim=head_dim, group=group,
                     block_size=block_size, kind=kind)
    assert_close(gpu(case), cpu_reference(case), dtype, kind)


@pytest.mark.parametrize("sliding_window,softcap", [(16, None), (None, 30.0), (5, 20.0)])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_sliding_window_and_softcap(rng, dtype, kind, sliding_window, softcap):
    case = make_case(rng, dtype=dtype, head_dim=128, group=4, block_size=16, kind=kind,
                     sliding_window=sliding_window, softcap=softcap)
    assert_close(gpu(case), cpu_reference(case), dtype, kind)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_sinks(rng, dtype, kind):
    case = make_case(rng, dtype=dtype, head_dim=128, group=4, block_size=16, kind=kind,
                     sliding_window=(None, 16)[len(kind) % 2], sinks=True)
    assert_close(gpu(case), cpu_reference(case), dtype, kind)


# Latent attention (one cache: K = the whole row, V = its first entries) on the
# large tier, and 192-dim heads with separate 128-dim values.
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("head_dim,v_head_dim,shared", [(576, 512, True), (288, 256, True),
                                                        (192, 128, False)])
def test_gpu_head_sizes(rng, head_dim, v_head_dim, shared, kind):
    dtype = DTYPES[len(kind) % 3]
    case = make_case(rng, dtype=dtype, head_dim=head_dim, group=4, block_size=16, kind=kind,
                     num_kv_heads=1 if shared else 2, v_head_dim=v_head_dim, shared_kv=shared,
                     sinks=kind == "mixed")
    assert_close(gpu(case), cpu_reference(case), dtype, kind)


# Groups past the grouped decode kernel's width at each tier (8 at d <= 128,
# 4 at d256, 2 on the large tier): the group is split over threadgroups.
@pytest.mark.parametrize("kind", ["decode", "multi_token_decode", "long_decode"])
@pytest.mark.parametrize("head_dim,v_head_dim,shared,group", [(128, None, False, 12),
                                                              (256, None, False, 6),
                                                              (576, 512, True, 5)])
def test_gpu_grouped_decode_in_chunks(rng, head_dim, v_head_dim, shared, group, kind):
    dtype = DTYPES[(group + len(kind)) % 3]
    case = make_case(rng, dtype=dtype, head_dim=head_dim, group=group, block_size=16, kind=kind,
                     num_kv_heads=1 if shared else 2, v_head_dim=v_head_dim, shared_kv=shared,
                     sinks=True, sliding_window=(None, 300)[len(kind) % 2])
    assert_close(gpu(case), numpy_reference(case), dtype, kind)


@pytest.mark.parametrize("head_dim", [1, 33, 96, 255])
@pytest.mark.parametrize("block_size", [64, 128])
def test_gpu_other_supported_shapes(rng, head_dim, block_size):
    case = make_case(rng, dtype="float16", head_dim=head_dim, group=3, block_size=block_size,
                     kind="mixed")
    assert_close(gpu(case), cpu_reference(case), "float16")


@pytest.mark.parametrize("kind", ["decode", "prefill", "long_decode"])
def test_gpu_reads_mlx_views_through_strides(rng, kind):
    """Sliced, transposed and strided MLX arrays go to the kernels as they are."""
    case = make_case(rng, dtype="bfloat16", head_dim=64, group=2, block_size=16, kind=kind)
    q, k, v, bt, sl, cu = mx_inputs(case)
    dt = MX_DTYPES[case.dtype]
    q_view = mx.concatenate([q, mx.zeros(q.shape[:2] + (5,), dt)], axis=2)[:, :, :q.shape[2]]
    k_view = mx.swapaxes(mx.array(np.ascontiguousarray(case.key_cache.swapaxes(1, 2))).astype(dt),
                         1, 2)
    v_view = mx.repeat(v, 2, axis=3)[..., ::2]
    bt_view = mx.repeat(bt, 2, axis=1)[:, ::2]
    sl_view = mx.array(case.seq_lens[::-1].copy())[::-1]
    out = gpu(case, [q_view, k_view, v_view, bt_view, sl_view, cu])
    assert_close(out, cpu_reference(case), case.dtype, kind)


def test_gpu_result_feeds_a_lazy_graph(rng):
    """The output (with the partition scratch behind it) is consumed by later
    ops in the same evaluation, and repeated calls agree."""
    case = make_case(rng, dtype="float16", head_dim=128, group=4, block_size=16,
                     kind="long_decode")
    inputs = mx_inputs(case)
    first = ops.paged_attention(*inputs, **case.kwargs(), stream=mx.gpu)
    second = ops.paged_attention(*inputs, **case.kwargs(), stream=mx.gpu)
    combined = (first.astype(mx.float32) * 2.0 - second.astype(mx.float32)).sum(axis=-1)
    mx.eval(combined)
    ref = cpu_reference(case)
    np.testing.assert_allclose(np.array(combined), ref.sum(axis=-1), atol=0.05, rtol=0.01)


@pytest.mark.parametrize("how", BAD_INPUTS)
@pytest.mark.parametrize("kind", ["multi_token_decode", "prefill", "mixed", "long_decode"])
def test_gpu_bad_metadata_gives_nan_rows(rng, kind, how):
    case = make_case(rng, dtype="float16", head_dim=64, group=2, block_size=16, kind=kind)
    reference = cpu_reference(case)
    nan_tokens, exact_tokens = break_case(case, how)
    out = gpu(case)  # must not raise or fault; the CPU backend would raise
    assert np.isnan(out[nan_tokens]).all()
    assert_close(out[exact_tokens], reference[exact_tokens], "float16", how)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_8bit_caches(rng, dtype, kind, fmt):
    """--kv-cache-dtype fp8: uint8 caches written by write_kv's encoding, read
    by the Metal kernels as by the CPU kernel (scales included)."""
    from vllm_metal.native import kv_quant

    case = make_case(rng, dtype=dtype, head_dim=128, group=4, block_size=16, kind=kind)
    q, kc, vc, *index = mx_inputs(case)
    kc, vc = kv_quant.encode(kc, fmt, 0.5), kv_quant.encode(vc, fmt, 2.0)
    kwargs = dict(case.kwargs(), kv_cache_dtype=fmt, k_scale=0.5, v_scale=2.0)
    out = ops.paged_attention(q, kc, vc, *index, **kwargs, stream=mx.gpu)
    ref = ops.paged_attention(q, kc, vc, *index, **kwargs, stream=mx.cpu)
    assert_close(np.array(out.astype(mx.float32)), np.array(ref.astype(mx.float32)), dtype, f"{kind} {fmt}")
