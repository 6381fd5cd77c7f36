"""native/decoder_layer.py on an Apple GPU: `decoder_layer` there is the
composition of MLX's and vllm-metal's own kernels (the DecoderLayer primitive
is CPU-only), against the CPU primitive; the primitive refuses a GPU stream
naming what to call. Skipped where the extension has no Metal (every Linux
machine): scripts/mac_verify.sh runs it."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "native"))  # the CPU tests' batch builder and float64 layer
from test_decoder_layer import layer_f64, random_layer  # noqa: E402

from vllm_metal.native import ops  # noqa: E402
from vllm_metal.native.decoder_layer import decoder_layer  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (ops._ext.HAS_METAL and mx.metal.is_available()),
    reason="needs the Metal build of vllm_metal on an Apple GPU (run scripts/mac_verify.sh on a Mac)")


@pytest.mark.parametrize("case", [dict(tokens_per_seq=[1, 1], context_lens=[9, 70]),
                                  dict(tokens_per_seq=[12, 1], context_lens=[30, 40], traditional=True)])
def test_gpu_layer_matches_float64_and_the_cpu_primitive(case):
    rng = np.random.default_rng(5)
    args, params = random_layer(rng, **case)
    want = layer_f64(args, params)[0]
    cpu = decoder_layer(**{**args, "key_cache": mx.array(args["key_cache"]),
                           "value_cache": mx.array(args["value_cache"])}, **params, stream=mx.cpu)
    gpu = decoder_layer(**args, **params, stream=mx.gpu)
    mx.eval(*cpu, *gpu)
    np.testing.assert_allclose(np.array(gpu[0]), want, rtol=1e-3, atol=1e-3)
    for a, b in zip(gpu, cpu):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-3, atol=1e-3)


def test_the_primitive_refuses_a_gpu_stream():
    rng = np.random.default_rng(6)
    args, params = random_layer(rng, tokens_per_seq=[1], context_lens=[3])
    slots = mx.array(np.asarray(args.pop("slot_mapping"), np.int32))
    params["sliding_window"] = 0
    out = ops._ext.decoder_layer(*[args[k] for k in ("x", "input_norm", "qkv_weight", "table", "key_cache",
                                                     "value_cache")], slots,
                                 *[args[k] for k in ("block_tables", "seq_lens", "cu_seqlens_q", "o_weight",
                                                     "post_norm", "gate_up_weight", "down_weight")],
                                 **params, stream=mx.gpu)
    with pytest.raises(RuntimeError, match="decoder_layer_composed"):
        mx.eval(out)
