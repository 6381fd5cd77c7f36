"""Fused projections (vllm_metal/models/fused_projections.py): q/k/v and
gate/up as one matmul each, the model's own code unchanged.

Checked against float64 numpy products of the original weights, and on the
embedded model: the same parameters (bytes) before and after, every layer
fused, and the engine's greedy tokens with fusion on (the CPU default, which
the golden and family-parity tests also run) equal to fusion off.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from engine_helpers import GOLDEN, engine, greedy
from mlx.utils import tree_flatten

from vllm_metal.models import fused_projections as fp


class MLP(nn.Module):
    """mlx-lm's gated MLP, as written there."""

    def __init__(self, dim=24, hidden=40, bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def f64(a):
    return np.array(a).astype(np.float64)


def reference(mlp, originals, x):
    g_w, g_b, u_w, u_b = originals
    x = f64(x)
    g = x @ g_w.T + (g_b if g_b is not None else 0)
    u = x @ u_w.T + (u_b if u_b is not None else 0)
    h = g / (1 + np.exp(-g)) * u
    return h @ f64(mlp.down_proj.weight).T + (f64(mlp.down_proj.bias) if "bias" in mlp.down_proj else 0)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_mlp_equals_the_original_products(bias):
    mx.random.seed(0)
    mlp = MLP(bias=bias)
    mx.eval(mlp.parameters())
    originals = (f64(mlp.gate_proj.weight), f64(mlp.gate_proj.bias) if bias else None,
                 f64(mlp.up_proj.weight), f64(mlp.up_proj.bias) if bias else None)
    nbytes = sum(v.nbytes for _, v in tree_flatten(mlp.parameters()))
    assert fp.fuse_group(mlp, fp.MLP_GROUP, "fused_gate_up_proj")
    assert isinstance(mlp.gate_proj, fp.FusedView) and "gate_proj" not in mlp
    assert sum(v.nbytes for _, v in tree_flatten(mlp.parameters())) == nbytes, "weights counted once"
    np.testing.assert_array_equal(f64(mlp.gate_proj.weight), originals[0])
    np.testing.assert_array_equal(f64(mlp.up_proj.weight), originals[2])
    for rows in (1, 3, 17):
        x = mx.random.normal((1, rows, 24))
        np.testing.assert_allclose(f64(mlp(x)), reference(mlp, originals, x), rtol=1e-4, atol=1e-5)
    assert not mlp.gate_proj._product.separate


def test_members_called_on_different_inputs_still_get_their_own_products():
    mx.random.seed(1)
    mlp = MLP()
    mx.eval(mlp.parameters())
    g_w, u_w = f64(mlp.gate_proj.weight), f64(mlp.up_proj.weight)
    fp.fuse_group(mlp, fp.MLP_GROUP, "fused_gate_up_proj")
    x1, x2 = mx.random.normal((2, 24)), mx.random.normal((2, 24))
    g = mlp.gate_proj(x1)  # computes the fused product for x1, waits for up_proj(x1)
    u = mlp.up_proj(x2)  # another input: the group stops fusing, u is x2's own product
    np.testing.assert_allclose(f64(g), f64(x1) @ g_w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f64(u), f64(x2) @ u_w.T, rtol=1e-5, atol=1e-5)
    assert mlp.gate_proj._product.separate
    np.testing.assert_allclose(f64(mlp.gate_proj(x2)), f64(x2) @ g_w.T, rtol=1e-5, atol=1e-5)


def test_groups_that_cannot_be_fused_are_left_alone():
    mlp = MLP()
    mlp.up_proj = nn.Linear(24, 40, bias=True)  # bias on one member only
    assert not fp.fuse_group(mlp, fp.MLP_GROUP, "fused_gate_up_proj")
    assert isinstance(mlp.gate_proj, nn.Linear) and "fused_gate_up_proj" not in mlp
    q = MLP()
    q.gate_proj = nn.QuantizedLinear(64, 40)
    q.up_proj = nn.QuantizedLinear(64, 40)
    assert not fp.fuse_group(q, fp.MLP_GROUP, "fused_gate_up_proj")
    assert not fp.fuse_group(MLP(), ("gate_proj", "w3"), "x")  # a member missing


def test_swiglu_probe_accepts_silu_and_refuses_other_activations():
    mx.random.seed(2)
    silu = MLP()
    mx.eval(silu.parameters())
    fp.fuse_group(silu, fp.MLP_GROUP, "fused_gate_up_proj")
    assert fp.is_swiglu_mlp(silu)
    x = mx.random.normal((1, 5, 24))
    np.testing.assert_allclose(f64(fp.SwiGLUMLP(silu)(x)), f64(silu(x)), rtol=1e-5, atol=1e-6)

    class GeluMLP(MLP):
        def __call__(self, x):
            return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))

    class ClampedMLP(MLP):  # gpt-oss style limit: equal to SwiGLU for small inputs only
        def __call__(self, x):
            return self.down_proj(nn.silu(mx.clip(self.gate_proj(x), None, 7.0)) * self.up_proj(x))

    for cls in (GeluMLP, ClampedMLP):
        other = cls()
        mx.eval(other.parameters())
        fp.fuse_group(other, fp.MLP_GROUP, "fused_gate_up_proj")
        assert not fp.is_swiglu_mlp(other), cls.__name__


@pytest.mark.parametrize("value, device, expected", [
    ("auto", "cpu", True), ("auto", "gpu", False), ("1", "gpu", True), ("0", "cpu", False)])
def test_setting(monkeypatch, value, device, expected):
    monkeypatch.setenv("VLLM_METAL_FUSE_PROJECTIONS", value)
    assert fp.fuse_projections_enabled(device) is expected


def test_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_METAL_FUSE_PROJECTIONS", "sometimes")
    with pytest.raises(ValueError, match="VLLM_METAL_FUSE_PROJECTIONS='sometimes'"):
        fp.fuse_projections_enabled("cpu")


def test_embedded_model_fuses_every_layer(model_dir):
    from vllm_metal.models.loader import load_model

    plain = load_model(model_dir, dequantize=True)
    fused = load_model(model_dir, dequantize=True, fuse=True)
    assert plain.fused == {} and fused.fused == {"qkv": 30, "gate_up": 30, "swiglu": 30}
    assert isinstance(fused.model.model.layers[0].mlp, fp.SwiGLUMLP)
    size = lambda m: sum(v.nbytes for _, v in tree_flatten(m.model.parameters()))  # noqa: E731
    assert size(fused) == size(plain)
    attn = fused.model.model.layers[0].self_attn.inner
    np.testing.assert_array_equal(np.array(attn.k_proj.weight),
                                  np.array(plain.model.model.layers[0].self_attn.inner.k_proj.weight))


@pytest.mark.slow
def test_engine_without_fusion_gives_the_golden_tokens_too(model_dir, monkeypatch):
    prompts = [g["prompt_ids"] for g in GOLDEN[:3]] + [GOLDEN[-1]["prompt_ids"]]
    monkeypatch.setenv("VLLM_METAL_FUSE_PROJECTIONS", "0")
    with engine(model_dir) as llm:
        off, _ = greedy(llm, prompts, 16)
    assert off == [g["greedy_ids"][:16] for g in GOLDEN[:3] + [GOLDEN[-1]]]
