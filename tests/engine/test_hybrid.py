"""Hybrid linear-attention models (qwen3_next) beyond the parity matrix:
the state slots live in vLLM's hybrid KV-cache manager (a Mamba group beside
the attention group), survive preemption and recompute with prefix caching
on (vLLM's default: its "align" mode, a state block per attention block),
are all freed when the requests end, and are written back in place
(donated, never copied) or, switched, copied with identical results (a
slot's previous owner never leaking into a new request:
test_hybrid_families.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import GOLDEN, engine, greedy, runner_of
from families import build

from vllm_metal.models.loader import load_model
from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs

LONG = GOLDEN[-1]["prompt_ids"]


@pytest.fixture(scope="module")
def hybrid_dir(model_dir, tmp_path_factory):
    return build("qwen3_next", tmp_path_factory.mktemp("hybrid") / "qwen3_next", model_dir)


def test_preemption_recomputes_the_state(hybrid_dir):
    """A tiny cache forces preemptions (vLLM's defaults: prefix caching,
    async scheduling; the prompts overlap, so resumed requests also hit
    blocks cached by others); tokens equal an unconstrained engine whose
    blocks are 16 tokens (--block-size 16) where the platform's own choice
    for this model is 64 (the smallest block size whose attention page holds
    one layer's state, 10.25 KiB), scheduled synchronously and without prefix
    caching (one state slot per request)."""
    prompts = [LONG[20 * i:20 * i + 150 + 10 * i] for i in range(8)]  # 150..220 tokens
    common = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256)
    with engine(hybrid_dir, kv_cache_memory_bytes=16 << 20, block_size=16, enable_prefix_caching=False,
                async_scheduling=False, **common) as llm:
        expected, _ = greedy(llm, prompts, max_tokens=64)
        assert sorted(runner_of(llm).block_sizes) == [16, 512]
        # The budget holds although every layer has arrays of its own (vLLM's
        # plan lets one layer per group share a tensor): the worker scales it.
        assert sum(a.nbytes for a in runner_of(llm).kv.arrays()) <= 16 << 20
    # 30 blocks (vLLM wants room for one max_model_len request: 8 + 1): each
    # request needs 3-5 attention blocks of 64 tokens and 1 state slot, so 8
    # at once cannot all keep theirs.
    with engine(hybrid_dir, num_gpu_blocks_override=30, **common) as llm:
        runner = runner_of(llm)
        tokens, _ = greedy(llm, prompts, max_tokens=64)
        resumed = runner.batch.num_resumed
        state_pool = runner.kv.values[0]
        # Every request has ended: each group's manager holds no blocks for any
        # request, and the pool has all its blocks back (but the null block).
        manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
        held = {type(m).__name__: sum(map(len, m.req_to_blocks.values()))
                for m in manager.coordinator.single_type_managers}
        pool = manager.block_pool
        free = pool.get_num_free_blocks()
    assert "MambaManager" in held and set(held.values()) == {0}, held
    assert free == pool.num_gpu_blocks - 1
    # Two KV-cache groups: attention (64-token blocks) and the states (a
    # 64-token block each: prefix caching's align mode).
    assert sorted(runner.block_sizes) == [64, 64] and runner.align_groups
    assert state_pool.shape[0] == 30 and state_pool.dtype == mx.float32
    assert resumed > 0, "the tiny cache should have forced preemptions"
    assert tokens == expected


def test_attention_block_size_follows_the_state_page():
    """The platform's block size for hybrids: the smallest the primitive
    supports whose attention page reaches one layer's state page (Qwen3.5-0.8B:
    4 KiB of K/V a token against a 1.07 MiB Gated DeltaNet state: the largest,
    128), and the sizes it picks from are the primitive's."""
    from vllm_metal.native import ops
    from vllm_metal.engine.platform import ATTENTION_BLOCK_SIZES, hybrid_attention_block_size

    assert hybrid_attention_block_size(256, 5632) == 32
    assert hybrid_attention_block_size(256, 4096) == 16
    assert hybrid_attention_block_size(4096, 3 * 6144 * 4 + 16 * 128 * 128 * 4) == 128
    assert hybrid_attention_block_size(4096, 200_000) == 64
    for size in (4, 8, 16, 32, 64, 128, 256):
        q = mx.zeros((1, 1, 8))
        cache = mx.zeros((2, size, 1, 8))
        args = (q, cache, cache, mx.array([[0]], dtype=mx.int32), mx.array([1], dtype=mx.int32),
                mx.array([0, 1], dtype=mx.int32))
        if size in ATTENTION_BLOCK_SIZES:
            mx.eval(ops.paged_attention(*args, scale=1.0))
        else:
            with pytest.raises(ValueError, match=f"block_size {size} is not supported"):
                ops.paged_attention(*args, scale=1.0)


def test_hybrid_config_defaults_and_refusals(hybrid_dir, model_dir):
    """vLLM's defaults for a hybrid (prefix caching on: mamba_cache_mode
    "align", a state block per attention block) are served; what cannot be
    honoured is refused with the reason."""
    from vllm.engine.arg_utils import EngineArgs

    default = EngineArgs(model=hybrid_dir, dtype="float32", max_model_len=512).create_engine_config()
    assert default.cache_config.enable_prefix_caching
    assert default.cache_config.mamba_cache_mode == "align"
    assert default.cache_config.mamba_block_size == default.cache_config.block_size
    with pytest.raises(ValueError, match="--mamba-ssm-cache-dtype at auto"):
        EngineArgs(model=hybrid_dir, dtype="float32", max_model_len=512,
                   mamba_ssm_cache_dtype="float16").create_engine_config()
    with pytest.raises(ValueError, match="--mamba-block-size"):
        EngineArgs(model=hybrid_dir, dtype="float32", max_model_len=512, enable_prefix_caching=False,
                   mamba_block_size=64).create_engine_config()
    hybrid = EngineArgs(model=hybrid_dir, dtype="float32", max_model_len=512,
                        enable_prefix_caching=False).create_engine_config()
    assert hybrid.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert hybrid.cache_config.mamba_cache_mode == "none"
    plain = EngineArgs(model=model_dir, dtype="float32", max_model_len=512).create_engine_config()
    assert plain.scheduler_config.disable_hybrid_kv_cache_manager is True  # one KV-cache group, as before


def _run_steps(loaded, kv, states):
    """Four steps of a prefill row and a decode-sized row: the logits of each,
    and the state pools' buffer addresses before and after each step."""
    from vllm_metal.native import ops

    def addresses():
        return [(ops._ext.buffer_address(kv.keys[i]), ops._ext.buffer_address(kv.values[i])) for i in states]

    logits, moves = [], []
    for done in range(0, 40, 10):
        rows = [ScheduledRow(LONG[done:done + 10], done, [[1, 2, 3]]),
                ScheduledRow(LONG[done:done + 3], done, [[5, 6, 7]])]
        before = addresses()
        out = loaded.forward(kv, build_step_inputs(rows, [16]), np.arange(2))
        mx.eval(out, kv.arrays())
        logits.append(np.array(out))
        moves.append([a != b for pair in zip(before, addresses()) for a, b in zip(*pair)])
    return logits, moves


@pytest.mark.parametrize("mode", ["inplace", "copy"])
def test_state_write_back_in_place_or_copied(hybrid_dir, mode, monkeypatch):
    """VLLM_METAL_STATE_WRITEBACK: in place, the functional scatter
    `pool[slots] = new` is donated -- through steps of prefill and decode rows
    every state pool keeps its buffer and the peak grows by less than one pool
    (a copy of any pool would add 8 MiB); copied, every step writes every pool
    into a new buffer. Both give bit-identical logits."""
    loaded = load_model(hybrid_dir, dtype="float32")
    states = [i for i, spec in enumerate(loaded.layer_kv) if spec.layout == "state"]
    kv = loaded.allocate_kv(2048, [16], [0] * loaded.num_layers)
    monkeypatch.setenv("VLLM_METAL_STATE_WRITEBACK", mode)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    logits, moves = _run_steps(loaded, kv, states)
    if mode == "inplace":
        assert not any(any(step) for step in moves), "a state pool was copied"
        assert mx.get_peak_memory() - base < kv.values[states[0]].nbytes
    else:
        assert all(all(step) for step in moves), "a state pool was donated"
    monkeypatch.setenv("VLLM_METAL_STATE_WRITEBACK", "copy" if mode == "inplace" else "inplace")
    other, _ = _run_steps(loaded, loaded.allocate_kv(2048, [16], [0] * loaded.num_layers), states)
    for a, b in zip(logits, other):
        np.testing.assert_array_equal(a, b)


def test_gated_delta_paths_agree(hybrid_dir, monkeypatch):
    """VLLM_METAL_GATED_DELTA: the fused primitive (the default on the CPU)
    and mlx-lm's gated_delta_update give the same greedy tokens and logits
    within float32 rounding, through prefill, chunked and decode rows."""
    logits = {}
    for mode in ("auto", "mlx-lm"):
        monkeypatch.setenv("VLLM_METAL_GATED_DELTA", mode)
        loaded = load_model(hybrid_dir, dtype="float32")
        layers = [m for m in loaded.model.modules() if type(m).__name__ == "GatedDeltaLayer"]
        assert layers and all(m.fused == (mode == "auto") for m in layers)
        states = [i for i, spec in enumerate(loaded.layer_kv) if spec.layout == "state"]
        logits[mode], _ = _run_steps(loaded, loaded.allocate_kv(2048, [16], [0] * loaded.num_layers), states)
    for fused, reference in zip(logits["auto"], logits["mlx-lm"]):
        np.testing.assert_array_equal(fused.argmax(-1), reference.argmax(-1))
        np.testing.assert_allclose(fused, reference, atol=1e-4, rtol=1e-4)
    monkeypatch.setenv("VLLM_METAL_GATED_DELTA", "faster")
    with pytest.raises(ValueError, match="VLLM_METAL_GATED_DELTA='faster'"):
        load_model(hybrid_dir, dtype="float32")


def test_bad_write_back_mode_is_refused(hybrid_dir, monkeypatch):
    monkeypatch.setenv("VLLM_METAL_STATE_WRITEBACK", "sideways")
    with pytest.raises(ValueError, match="VLLM_METAL_STATE_WRITEBACK='sideways'"):
        load_model(hybrid_dir, dtype="float32")


def test_partial_block_hits_copy_the_matched_block(hybrid_dir, model_dir, monkeypatch):
    """--prefix-match-unit 16 under 64-token blocks: vLLM's prefix cache hits
    mid-block (a state checkpoint at the 80-token shared prefix, inside the
    second block) and copies the partially matched block before the request
    writes it (kv_cache_block_copies, applied to every cache array). The hits
    are sub-block, the copies happen, and every prompt's tokens are mlx-lm's
    greedy choices (teacher forcing)."""
    from families import reference_logprobs

    from vllm_metal.models.attention_adapter import PagedKVCache

    copies = []
    copy_blocks = PagedKVCache.copy_blocks
    monkeypatch.setattr(PagedKVCache, "copy_blocks", lambda self, pairs: (copies.append(len(pairs)),
                                                                           copy_blocks(self, pairs))[1])
    ref = reference_logprobs(hybrid_dir)
    prompts = [LONG[300:380] + LONG[start:start + 14] for start in (400, 450, 500)]
    with engine(hybrid_dir, max_model_len=512, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=64,
                prefix_match_unit=16) as llm:
        assert sorted(runner_of(llm).block_sizes) == [64, 64]
        outs = [greedy(llm, [p], max_tokens=8)[1][0] for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [0, 80, 80]
    assert copies, "a partial hit should have made vLLM copy a block"
    for prompt, out in zip(prompts, outs):
        tokens = list(out.outputs[0].token_ids)
        rows = ref(prompt + tokens[:-1])[len(prompt) - 1:]
        assert (rows[np.arange(len(tokens)), tokens] >= rows.max(axis=1) - 1e-3).all()
