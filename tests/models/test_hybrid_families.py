"""Every kind of linear-attention layer on state slots (qwen3_next's Gated
DeltaNet; lfm2's short convolutions: a convolution state only;
granitemoehybrid's Mamba-2 mixers: convolution + SSM state), beyond the
parity matrix: a slot still holding an earlier request's state never leaks
into a new request, a continuing request does read its slot, and the pools
are written back in place. The hybrids of mlx-lm not served yet are refused
with what they miss. (Through the engine: tests/engine/test_hybrid.py.)"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import GOLDEN
from families import build

from vllm_metal.models.loader import load_model
from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs

LONG = GOLDEN[-1]["prompt_ids"]
KINDS = ["qwen3_next", "lfm2", "granitemoehybrid"]


@pytest.fixture(scope="module", params=KINDS)
def loaded(request, model_dir, tmp_path_factory):
    return load_model(build(request.param, tmp_path_factory.mktemp("hybrid") / request.param, model_dir),
                      dtype="float32")


def _pools(loaded, kv):
    return [a for i, spec in enumerate(loaded.layer_kv) if spec.layout == "state"
            for a in (kv.keys[i], kv.values[i]) if a is not None]


def test_a_reused_slot_starts_from_zero(loaded):
    layer_group = [0] * loaded.num_layers

    def run(prompt, num_computed, dirty):
        kv = loaded.allocate_kv(8, [16], layer_group)
        if dirty:
            for i, spec in enumerate(loaded.layer_kv):
                if spec.layout == "state":
                    kv.keys[i] = kv.keys[i] + 3.0
                    kv.values[i] = None if kv.values[i] is None else kv.values[i] + 0.5
        inputs = build_step_inputs([ScheduledRow(prompt, num_computed, [[1, 2, 3, 4]])], [16])
        logits = loaded.forward(kv, inputs, np.arange(len(prompt)))
        mx.eval(logits)
        return np.array(logits)

    prompt = LONG[:40]
    np.testing.assert_array_equal(run(prompt, 0, dirty=True), run(prompt, 0, dirty=False))
    assert not np.allclose(run(prompt[:8], 16, dirty=True), run(prompt[:8], 16, dirty=False), atol=1e-3)


def test_state_pools_are_written_in_place(loaded, monkeypatch):
    from vllm_metal.native import ops

    monkeypatch.setenv("VLLM_METAL_STATE_WRITEBACK", "inplace")
    address = ops._ext.buffer_address
    kv = loaded.allocate_kv(64, [16], [0] * loaded.num_layers)
    before = [address(a) for a in _pools(loaded, kv)]
    for done in range(0, 30, 10):
        rows = [ScheduledRow(LONG[done:done + 10], done, [[1, 2, 3]]),
                ScheduledRow(LONG[done:done + 3], done, [[5, 6, 7]])]
        logits = loaded.forward(kv, build_step_inputs(rows, [16]), np.arange(2))
        mx.eval(logits, kv.arrays())
    assert [address(a) for a in _pools(loaded, kv)] == before, "a state pool was copied"


@pytest.mark.parametrize("model_type", ["nemotron_h", "falcon_h1", "kimi_linear"])
def test_other_hybrids_are_refused_with_the_reason(model_type, tmp_path):
    """Refused at load, before anything is built, saying what is missing."""
    import json

    from vllm_metal.models.registry import NOT_YET, SERVED, UnservedModelError

    assert model_type not in SERVED
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(UnservedModelError, match=f"is not served.* For {model_type}: .*Served: "):
        load_model(tmp_path)
    assert NOT_YET[model_type]


def test_uniform_steps_skip_the_mask_and_carry_passes():
    """A decode step (every row one token, every row continuing) has no
    padding and nothing to zero: no mask and no carried flags, so the layers
    skip those passes over the states; a mixed step keeps both."""
    from vllm_metal.models.state_slots import build_linear_inputs

    decode = build_linear_inputs(np.array([0, 1, 2, 3]), np.array([40, 7, 300]))
    assert decode.mask is None and decode.carried is None
    mixed = build_linear_inputs(np.array([0, 1, 5]), np.array([40, 0, 1, 2, 3]))
    assert np.array(mixed.mask).tolist() == [[True, False, False, False], [True, True, True, True]]
    assert np.array(mixed.carried).tolist() == [True, False]
    np.testing.assert_array_equal(np.array(mixed.unpad_index), [0, 4, 5, 6, 7])
