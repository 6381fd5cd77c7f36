"""Hybrid linear-attention models (qwen3_next) beyond the parity matrix:
the state slots live in vLLM's hybrid KV-cache manager (a Mamba group beside
the attention group), survive preemption and recompute, never leak from a
slot's previous owner into a new request, and are written back in place
(donated, never copied); prefix caching -- which would need per-block state
checkpoints -- is refused when turned on."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import GOLDEN, engine, greedy, runner_of
from families import build

from vllm_metal.models.loader import load_model
from vllm_metal.step_inputs import ScheduledRow, build_step_inputs

LONG = GOLDEN[-1]["prompt_ids"]


@pytest.fixture(scope="module")
def hybrid_dir(model_dir, tmp_path_factory):
    return build("qwen3_next", tmp_path_factory.mktemp("hybrid") / "qwen3_next", model_dir)


def test_preemption_recomputes_the_state(hybrid_dir):
    prompts = [LONG[20 * i:20 * i + 150 + 10 * i] for i in range(8)]  # 150..220 tokens
    common = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256, enable_prefix_caching=False)
    with engine(hybrid_dir, kv_cache_memory_bytes=16 << 20, **common) as llm:
        expected, _ = greedy(llm, prompts, max_tokens=64)
        # The budget holds although every layer has arrays of its own (vLLM's
        # plan lets one layer per group share a tensor): the worker scales it.
        assert sum(a.nbytes for a in runner_of(llm).kv.arrays()) <= 16 << 20
    # 40 blocks (vLLM wants room for one max_model_len request: 32 + 1): each
    # request needs 14-18 attention blocks and 1 state slot, so 8 at once
    # cannot all keep theirs.
    with engine(hybrid_dir, num_gpu_blocks_override=40, **common) as llm:
        runner = runner_of(llm)
        tokens, _ = greedy(llm, prompts, max_tokens=64)
        resumed = runner.batch.num_resumed
        state_pool = runner.kv.values[0]
    # Two KV-cache groups: attention (16-token blocks) and the state slots
    # (one per request: block size = max_model_len).
    assert sorted(runner.block_sizes) == [16, 512]
    assert state_pool.shape[0] == 40 and state_pool.dtype == mx.float32
    assert resumed > 0, "the tiny cache should have forced preemptions"
    assert tokens == expected


def test_a_reused_slot_starts_from_zero(hybrid_dir):
    """A slot still holding an earlier request's state (vLLM does not clear
    freed blocks) gives a new request (num_computed 0) exactly what a zeroed
    slot gives; a request continuing from that slot does read it."""
    loaded = load_model(hybrid_dir, dtype="float32")
    layer_group = [0] * loaded.num_layers

    def run(prompt, num_computed, dirty):
        kv = loaded.allocate_kv(8, [16], layer_group)
        if dirty:
            for i, spec in enumerate(loaded.layer_kv):
                if spec.layout == "state":
                    kv.keys[i] = kv.keys[i] + 3.0
                    kv.values[i] = kv.values[i] + 0.5
        inputs = build_step_inputs([ScheduledRow(prompt, num_computed, [[1, 2, 3, 4]])], [16])
        logits = loaded.forward(kv, inputs, np.arange(len(prompt)))
        mx.eval(logits)
        return np.array(logits)

    prompt = LONG[:40]
    np.testing.assert_array_equal(run(prompt, 0, dirty=True), run(prompt, 0, dirty=False))
    assert not np.allclose(run(prompt[:8], 16, dirty=True), run(prompt[:8], 16, dirty=False), atol=1e-3)


def test_prefix_caching_is_refused_for_hybrids_only(hybrid_dir, model_dir):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="--no-enable-prefix-caching"):
        EngineArgs(model=hybrid_dir, dtype="float32", max_model_len=512,
                   enable_prefix_caching=True).create_engine_config()
    with pytest.raises(ValueError, match="--mamba-block-size"):
        EngineArgs(model=hybrid_dir, dtype="float32", max_model_len=512, enable_prefix_caching=False,
                   mamba_block_size=64).create_engine_config()
    hybrid = EngineArgs(model=hybrid_dir, dtype="float32", max_model_len=512,
                        enable_prefix_caching=False).create_engine_config()
    assert hybrid.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert hybrid.cache_config.mamba_cache_mode == "none"
    plain = EngineArgs(model=model_dir, dtype="float32", max_model_len=512).create_engine_config()
    assert plain.scheduler_config.disable_hybrid_kv_cache_manager is True  # one KV-cache group, as before


def test_state_pools_are_updated_in_place(hybrid_dir):
    """The functional scatter `pool[slots] = new` is donated: after steps of
    prefill and decode rows the state pools keep their buffers, and the peak
    grows by less than one pool (a copy of any pool would add 8 MiB)."""
    from vllm_metal import ops

    address = ops._ext.buffer_address
    loaded = load_model(hybrid_dir, dtype="float32")
    kv = loaded.allocate_kv(2048, [16], [0] * loaded.num_layers)
    states = [i for i, spec in enumerate(loaded.layer_kv) if spec.layout == "state"]
    before = [(address(kv.keys[i]), address(kv.values[i])) for i in states]
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for done in range(0, 40, 10):
        rows = [ScheduledRow(LONG[done:done + 10], done, [[1, 2, 3]]),
                ScheduledRow(LONG[done:done + 3], done, [[5, 6, 7]])]
        logits = loaded.forward(kv, build_step_inputs(rows, [16]), np.arange(2))
        mx.eval(logits, kv.arrays())
    assert [(address(kv.keys[i]), address(kv.values[i])) for i in states] == before, "a state pool was copied"
    assert mx.get_peak_memory() - base < kv.values[states[0]].nbytes
