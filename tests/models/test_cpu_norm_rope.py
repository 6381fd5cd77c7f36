"""models/cpu_norm_rope.py: RMSNorm and RoPE through vllm-metal's primitives
on MLX's CPU device. Each RoPE variant mlx-lm builds is reproduced by a table
the module itself produces (or refused: then the module keeps being called),
and a whole model gives the same logits with and without the swap. The
golden and family parity tests run with it on (the CPU default)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import initialize_rope

from vllm_metal.native import ops
from vllm_metal.models.cpu_norm_rope import (PrimitiveRMSNorm, cpu_norm_rope_enabled, plan_rope,
                                             use_cpu_norm_rope)
from vllm_metal.models.loader import load_model
from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs

LONGROPE = {"type": "longrope", "original_max_position_embeddings": 4096,
            "short_factor": [1.0 + 0.05 * i for i in range(32)], "long_factor": [1.5 + 0.1 * i for i in range(32)]}
VARIANTS = {
    "default": (64, False, None),
    "traditional": (64, True, None),
    "partial": (32, False, None),  # 32 of 64 dims rotated, the rest passed through
    "linear": (64, False, {"type": "linear", "factor": 4.0}),
    "llama3": (64, False, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}),
    "yarn": (64, False, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5}),
    "longrope": (64, False, LONGROPE),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_mlx_lm_rope_variant_is_reproduced_by_its_table(rng, name):
    dims, traditional, scaling = VARIANTS[name]
    rope = initialize_rope(dims, 10000.0, traditional, scaling, max_position_embeddings=131072)
    plan = plan_rope(rope, 64)
    assert plan is not None and plan.rotated == dims and plan.traditional == traditional
    # A step's positions: a long prompt's chunk and a few decodes, past the proof's positions.
    positions = mx.array(np.concatenate([np.arange(8000, 8040), [3, 9000, 131000]]).astype(np.int32))
    x = mx.array(rng.standard_normal((positions.shape[0], 5, 64)).astype(np.float32))
    want = rope(x[:, :, None, :], offset=positions)[:, :, 0, :]
    got = ops.rope(x, plan.table(rope, positions), traditional=plan.traditional)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-4, rtol=2e-4)


def test_a_module_that_is_not_a_rotation_gets_no_plan():
    class Shifted(nn.Module):
        dims = 64

        def __call__(self, x, offset=0):
            return mx.fast.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=offset) + 0.5

    class Refuses(nn.Module):
        def __call__(self, x, offset=0):
            raise TypeError("no per-token offsets")

    assert plan_rope(Shifted(), 64) is None
    assert plan_rope(Refuses(), 64) is None


def test_equal_modules_share_a_table_and_different_ones_do_not():
    a, b = nn.RoPE(64, base=10000.0), nn.RoPE(64, base=10000.0)
    c = nn.RoPE(64, base=500000.0)
    assert plan_rope(a, 64).key == plan_rope(b, 64).key != plan_rope(c, 64).key
    assert plan_rope(nn.RoPE(64, traditional=True), 64).key != plan_rope(a, 64).key


def test_the_switch(monkeypatch):
    monkeypatch.delenv("VLLM_METAL_CPU_NORM_ROPE", raising=False)
    assert cpu_norm_rope_enabled("cpu") and not cpu_norm_rope_enabled("gpu")
    monkeypatch.setenv("VLLM_METAL_CPU_NORM_ROPE", "0")
    assert not cpu_norm_rope_enabled("cpu")
    monkeypatch.setenv("VLLM_METAL_CPU_NORM_ROPE", "sometimes")
    with pytest.raises(ValueError, match="VLLM_METAL_CPU_NORM_ROPE='sometimes'"):
        cpu_norm_rope_enabled("cpu")


def test_the_model_gives_the_same_logits_with_the_primitives(model_dir):
    logits, loaded = {}, {}
    for on in (False, True):
        lm = load_model(model_dir, fuse=True, norm_rope=on)
        kv = lm.allocate_kv(64, [16], [0] * lm.num_layers)
        # A prefill chunk and a decode row in one step.
        rows = [ScheduledRow(list(range(200, 290)), 0, [list(range(1, 7))]),
                ScheduledRow([77], 40, [list(range(10, 14))])]
        inputs = build_step_inputs(rows, [16])
        out = lm.forward(kv, inputs, np.arange(91))
        mx.eval(out, kv.arrays())
        logits[on], loaded[on] = np.array(out), lm
    assert loaded[False].norm_rope == {}
    # SmolLM2: 30 layers x 2 norms + the final norm; one RoPE table shared by all 30 layers.
    assert loaded[True].norm_rope == {"rms_norm": 61, "rope": 30, "rope_tables": 1}
    norms = [m for _, m in loaded[True].model.named_modules() if isinstance(m, (nn.RMSNorm, PrimitiveRMSNorm))]
    assert len(norms) == 61 and all(type(m) is PrimitiveRMSNorm for m in norms)
    # float32 rounding through 30 layers: logits of ~20 agree to ~1e-4 relative (measured
    # 2026-11-26, attention kernel with 64-key softmax steps: largest difference 2.8e-3,
    # on 39 of 4.5M logits; 1.9e-3 before that kernel change).
    np.testing.assert_allclose(logits[True], logits[False], atol=4e-3, rtol=1e-4)
    assert (logits[True].argmax(-1) == logits[False].argmax(-1)).all()


def test_swap_reaches_norms_in_lists_and_nested_modules():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(8)
            self.other = nn.LayerNorm(8)  # not an RMSNorm: kept

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Block(), Block()]
            self.final = nn.RMSNorm(8, eps=1e-3)

    m = Model()
    counts = use_cpu_norm_rope(m, [], object)
    assert counts == {"rms_norm": 3, "rope": 0, "rope_tables": 0}
    assert type(m.final) is PrimitiveRMSNorm and m.final.eps == 1e-3
    assert all(type(b.norm) is PrimitiveRMSNorm and type(b.other) is nn.LayerNorm for b in m.layers)


def test_a_norm_called_on_another_dtype_keeps_mlx_promotion(rng):
    norm = PrimitiveRMSNorm(nn.RMSNorm(16))
    x = mx.array(rng.standard_normal((3, 16)).astype(np.float32)).astype(mx.bfloat16)
    out = norm(x)  # float32 weight, bfloat16 input: what mx.fast.rms_norm gives
    assert out.dtype == mx.fast.rms_norm(x, norm.weight, norm.eps).dtype
    np.testing.assert_array_equal(np.array(out.astype(mx.float32)),
                                  np.array(mx.fast.rms_norm(x, norm.weight, norm.eps).astype(mx.float32)))


def test_rope_and_cache_write_as_one_primitive_change_nothing(model_dir, monkeypatch):
    """VLLM_METAL_FUSED_KV_WRITE: each layer's RoPE and K/V write as one
    RopeWriteKV operation gives the same logits and caches, to the bit, as
    the separate RoPE and scatter; an 8-bit cache keeps the separate path."""
    calls = []
    fused = ops.rope_write_kv
    monkeypatch.setattr(ops, "rope_write_kv", lambda *a, **k: calls.append(1) or fused(*a, **k))
    results = {}
    for on, cache_dtype in (("0", "auto"), ("1", "auto"), ("1", "fp8")):
        monkeypatch.setenv("VLLM_METAL_FUSED_KV_WRITE", on)
        lm = load_model(model_dir, fuse=True, norm_rope=True)
        kv = lm.allocate_kv(64, [16], [0] * lm.num_layers, kv_cache_dtype=cache_dtype)
        rows = [ScheduledRow(list(range(200, 290)), 0, [list(range(1, 7))]),
                ScheduledRow([77], 40, [list(range(10, 14))])]
        calls.clear()
        out = lm.forward(kv, build_step_inputs(rows, [16]), np.arange(91))
        mx.eval(out, kv.arrays())
        results[on, cache_dtype] = (np.array(out), [np.array(a) for a in kv.arrays()], len(calls))
    plain, one, fp8 = results["0", "auto"], results["1", "auto"], results["1", "fp8"]
    assert (plain[2], one[2], fp8[2]) == (0, 30, 0)
    assert np.array_equal(plain[0], one[0])
    assert all(np.array_equal(a, b) for a, b in zip(plain[1], one[1]))
