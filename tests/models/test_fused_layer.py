"""models/fused_layer.py: llama-shaped decoder blocks run as one DecoderLayer
primitive on MLX's CPU device. The embedded model gives the same logits and
caches, to the bit, with and without it (prefill and decode in one step);
the steps and blocks it does not do fall back to the block's own call (still
the same bits); a block whose call is not the formula is refused by the
load-time probe. The golden and family parity tests (against mlx-lm's own
forward) run with it on, the CPU default."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama

from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs
from vllm_metal.models import fused_layer
from vllm_metal.models.loader import load_model
from vllm_metal.native import ops

ROWS = [ScheduledRow(list(range(200, 290)), 0, [list(range(1, 7))]),  # a 90-token prefill
        ScheduledRow([77], 40, [list(range(10, 14))])]  # a decode at position 40


@pytest.fixture
def primitive_calls(monkeypatch):
    calls = []
    real = fused_layer.decoder_layer
    monkeypatch.setattr(fused_layer, "decoder_layer", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def run_step(lm, kv_cache_dtype="auto", after_layer=None):
    kv = lm.allocate_kv(64, [16], [0] * lm.num_layers, kv_cache_dtype=kv_cache_dtype)
    kv.after_layer = after_layer
    out = lm.forward(kv, build_step_inputs(ROWS, [16]), np.arange(91))
    mx.eval(out, kv.arrays())
    return np.array(out), [np.array(a) for a in kv.arrays()]


def load(model_dir, monkeypatch, on: str):
    monkeypatch.setenv("VLLM_METAL_FUSED_LAYER", on)
    return load_model(model_dir, dequantize=True, fuse=True, norm_rope=True)


def test_the_caches_are_written_in_place(model_dir, monkeypatch):
    lm = load(model_dir, monkeypatch, "1")
    kv = lm.allocate_kv(64, [16], [0] * lm.num_layers)
    mx.eval(kv.arrays())
    before = [ops._ext.buffer_address(a) for a in kv.arrays()]
    for _ in range(2):
        mx.eval(lm.forward(kv, build_step_inputs(ROWS, [16]), np.arange(91)), kv.arrays())
    assert [ops._ext.buffer_address(a) for a in kv.arrays()] == before


def same(a, b) -> bool:
    return np.array_equal(a[0], b[0]) and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


def test_every_layer_of_the_embedded_model_is_one_primitive_with_the_same_bits(model_dir, monkeypatch,
                                                                                primitive_calls):
    plain, fused = load(model_dir, monkeypatch, "0"), load(model_dir, monkeypatch, "1")
    assert len(primitive_calls) == 4  # the load-time probe: two scales, a prefill and a decode each
    primitive_calls.clear()
    assert plain.fused_layers == {} and fused.fused_layers == {"layers": 30}
    assert "decoder layers as one primitive: 30 of 30" in fused.load_notes(None)
    block = fused.model.model.layers[0]
    assert type(block).__name__ == "FusedTransformerBlock" and isinstance(block, llama.TransformerBlock)
    # The module tree (parameter names, weights) is the block's own.
    assert sorted(k for k, _ in nn.utils.tree_flatten(block.parameters())) == \
        sorted(k for k, _ in nn.utils.tree_flatten(plain.model.model.layers[0].parameters()))
    want = run_step(plain)
    assert primitive_calls == []
    got = run_step(fused)
    assert len(primitive_calls) == 30
    assert same(got, want)


def test_steps_it_does_not_do_run_the_blocks_own_call(model_dir, monkeypatch, primitive_calls):
    plain, fused = load(model_dir, monkeypatch, "0"), load(model_dir, monkeypatch, "1")
    primitive_calls.clear()
    # An 8-bit KV cache.
    assert same(run_step(fused, "fp8"), run_step(plain, "fp8")) and primitive_calls == []
    # A per-layer hook (VLLM_METAL_SYNC_PER_LAYER): it sees every layer's attention output.
    seen = {"plain": [], "fused": []}
    want = run_step(plain, after_layer=lambda out, kc, vc: seen["plain"].append(out.shape))
    got = run_step(fused, after_layer=lambda out, kc, vc: seen["fused"].append(out.shape))
    assert same(got, want) and primitive_calls == [] and len(seen["fused"]) == 30 == len(seen["plain"])


class Shifted(nn.Module):
    """Stands where a projection was, as a LoRA wrapper does: its output changes."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def __call__(self, x):
        return self.inner(x) + 0.25


def test_a_projection_replaced_after_load_is_honoured(model_dir, monkeypatch, primitive_calls):
    plain, fused = load(model_dir, monkeypatch, "0"), load(model_dir, monkeypatch, "1")
    before = run_step(fused)
    primitive_calls.clear()
    for lm in (plain, fused):
        attn = lm.model.model.layers[4].self_attn.inner
        attn.o_proj = Shifted(attn.o_proj)
        mlp = lm.model.model.layers[9].mlp.inner
        mlp.down_proj = Shifted(mlp.down_proj)
    got = run_step(fused)
    assert len(primitive_calls) == 28  # layers 4 and 9 ran their own call
    assert same(got, run_step(plain)) and not np.array_equal(got[0], before[0])


class HalfResidual(llama.TransformerBlock):
    """Not the formula: the MLP's output enters the residual halved."""

    def __call__(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + 0.5 * self.mlp(self.post_attention_layernorm(h))


def test_the_probe_refuses_a_block_that_is_not_the_formula(model_dir, monkeypatch):
    lm = load(model_dir, monkeypatch, "0")
    layers = lm.model.model.layers
    layers[3].__class__ = HalfResidual
    assert fused_layer.fuse_decoder_layers(layers) == {"layers": 29}
    assert type(layers[3]) is HalfResidual and type(layers[2]).__name__ == "FusedTransformerBlock"
    assert fused_layer.static_plan(layers[3]) is not None  # its pieces are fusable: the probe said no
    # Pieces the primitive does not do are refused before any probe.
    layers[5].self_attn.softcap = 30.0
    assert fused_layer.static_plan(layers[5]) is None


def test_the_setting(monkeypatch, model_dir):
    for value, expected in (("1", True), ("on", True), ("0", False), ("false", False)):
        monkeypatch.setenv("VLLM_METAL_FUSED_LAYER", value)
        assert fused_layer.fused_layers_enabled() is expected
    monkeypatch.setenv("VLLM_METAL_FUSED_LAYER", "sometimes")
    with pytest.raises(ValueError, match="VLLM_METAL_FUSED_LAYER='sometimes'"):
        load_model(model_dir, dequantize=True, fuse=True, norm_rope=True, materialize=False)
