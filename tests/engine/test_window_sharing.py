"""Sliding-window models under vLLM's hybrid KV-cache manager (the
platform's default for them, on Metal and MLX's CPU device): windowed layers hold only
their window's blocks, and a layer of each cache group shares one pair of
arrays (vLLM lays the groups over one allocation; block ids never overlap
between groups), the later layers of a step writing it as an alias
(in place, never a copy). A tiny Gemma 3 text model (two windowed layers of
24 tokens, one full-attention layer): the allocation is vLLM's plan, more
blocks fit a budget than with the manager off, and greedy tokens and
log-probabilities are mlx-lm's with prompts longer than the window, batched,
alone, after a prefix-cache hit and with n-gram speculation."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import GOLDEN, engine, runner_of
from families import build, reference_logprobs

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from vllm_metal.engine import kv_specs
from vllm_metal.native import ops
from vllm_metal.native.fit import cdiv

LONG = GOLDEN[-1]["prompt_ids"]
PROMPTS = [LONG[:20], LONG[100:190], LONG[200:350]]  # the last two longer than the window (24)
BUDGET = 4 << 20
COMMON = dict(max_model_len=512, kv_cache_memory_bytes=BUDGET, max_num_batched_tokens=64, max_num_seqs=8)
TOL = 1e-3
address = ops._ext.buffer_address


@pytest.fixture(scope="module")
def gemma3_dir(model_dir, tmp_path_factory):
    return build("gemma3_text", tmp_path_factory.mktemp("window") / "gemma3_text", model_dir)


def generate(llm, prompts, num_tokens=12, **kw):
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, **kw)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def kv_config(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config


def test_windows_share_one_allocation_and_match_mlx_lm(gemma3_dir):
    ref = reference_logprobs(gemma3_dir)
    with engine(gemma3_dir, **COMMON) as llm:
        runner, config = runner_of(llm), kv_config(llm)
        kinds = sorted(type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups)
        assert kinds == ["FullAttentionSpec", "SlidingWindowSpec", "SlidingWindowSpec"]
        assert runner.group_windows.count(24) == 2
        # vLLM's plan: every group's tensors from byte 0 of one allocation; here one pair of arrays for all three.
        assert len(set(kv_specs.tensor_starts(config).values())) == 1
        assert len(runner.kv.keys.slots) == 1 and runner.kv.layer_slot == [0, 0, 0]
        allocated = sum(a.nbytes for a in runner.kv.arrays())
        assert allocated == config.kv_cache_tensors[0].size <= BUDGET
        assert runner.kv_bytes_ratio() == 1.0
        shared_blocks = config.num_blocks
        before = [address(a) for a in runner.kv.arrays()]
        batched = generate(llm, PROMPTS, prompt_logprobs=0, logprobs=1)
        solo = [generate(llm, [p])[0] for p in PROMPTS]
        again = generate(llm, [PROMPTS[2]])[0]
        # The later layers' writes were aliases: the arrays never moved (a copying write would have
        # left a fresh buffer).
        assert [address(a) for a in runner.kv.arrays()] == before
    with engine(gemma3_dir, disable_hybrid_kv_cache_manager=True, **COMMON) as llm:
        runner, config = runner_of(llm), kv_config(llm)
        assert len(config.kv_cache_groups) == 1 and runner.kv.layer_slot == [0, 1, 2]
        separate_blocks = config.num_blocks
        unshared = generate(llm, PROMPTS)
    # The same budget: three layers' blocks each vs one shared block id per layer of each group.
    assert shared_blocks == 3 * separate_blocks + 1 or shared_blocks > 2.9 * separate_blocks
    tokens = [list(o.outputs[0].token_ids) for o in batched]
    for prompt, out in zip(PROMPTS, batched):
        got_tokens = list(out.outputs[0].token_ids)
        lp = ref(prompt + got_tokens[:-1])
        rows = lp[len(prompt) - 1:]
        chosen = rows[np.arange(len(got_tokens)), got_tokens]
        assert (chosen >= rows.max(axis=1) - TOL).all()
        np.testing.assert_allclose([d[t].logprob for d, t in zip(out.outputs[0].logprobs, got_tokens)], chosen,
                                   atol=TOL)
        got = np.array([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
        np.testing.assert_allclose(got, lp[np.arange(len(prompt) - 1), prompt[1:]], atol=TOL)
    assert [list(o.outputs[0].token_ids) for o in solo] == tokens
    assert again.num_cached_tokens >= 128, "the repeated prompt should hit the prefix cache"
    assert list(again.outputs[0].token_ids) == tokens[2]
    assert [list(o.outputs[0].token_ids) for o in unshared] == tokens


def test_windowed_blocks_per_request(gemma3_dir):
    """A long request holds cdiv(min(window - 1 + in flight, length), block) + 1
    blocks at most in a windowed group (vLLM frees those behind the window),
    its whole length in the full-attention group."""
    prompt = LONG[:300]
    with engine(gemma3_dir, **COMMON) as llm:
        manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
        held = []
        original = manager.allocate_slots

        def spy(request, *args, **kwargs):
            out = original(request, *args, **kwargs)
            held.append([len(m.req_to_blocks.get(request.request_id, []))
                         - sum(b.is_null for b in m.req_to_blocks.get(request.request_id, []))
                         for m in manager.coordinator.single_type_managers])
            return out

        manager.allocate_slots = spy
        generate(llm, [prompt], num_tokens=4)
        windows = runner_of(llm).group_windows
    assert held
    in_flight = 2 * COMMON["max_num_batched_tokens"]
    for g, window in enumerate(windows):
        most = max(h[g] for h in held)
        if window is None:
            assert most == cdiv(len(prompt) + 4, 16)
        else:
            assert most <= cdiv(min(window - 1 + in_flight, COMMON["max_model_len"]), 16) + 1


def test_ngram_speculation_keeps_the_tokens(gemma3_dir):
    """Verify steps write several tokens a layer through the shared arrays."""
    prompts = [LONG[200:350] + LONG[200:260]]  # repeats: n-gram proposals
    with engine(gemma3_dir, **COMMON) as llm:
        plain = [list(o.outputs[0].token_ids) for o in generate(llm, prompts, num_tokens=24)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    with engine(gemma3_dir, speculative_config=spec, **COMMON) as llm:
        assert len(runner_of(llm).kv.keys.slots) == 1
        assert [list(o.outputs[0].token_ids) for o in generate(llm, prompts, num_tokens=24)] == plain


def test_windows_beside_other_shapes_are_planned_as_full(model_dir, tmp_path):
    """Gemma 4's full-attention layers have wider heads than its windowed
    ones: their groups could not share arrays, so the windows are declared
    as full attention (one group, each layer its own arrays, as with vLLM's
    manager off) and the allocation stays vLLM's plan."""
    d = build("gemma4_text", tmp_path / "gemma4_text", model_dir)
    with engine(d, **COMMON) as llm:
        runner, config = runner_of(llm), kv_config(llm)
        assert [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups] == ["FullAttentionSpec"]
        assert runner.kv_bytes_ratio() == 1.0
        assert sum(a.nbytes for a in runner.kv.arrays()) == config.kv_cache_tensors[0].size <= BUDGET


def test_fit_follows_the_runner():
    from vllm_metal.native.fit import LayerCache, windows_kept

    windowed, full = LayerCache(2, 16, window=24), LayerCache(2, 16)
    assert windows_kept([windowed, full], hybrid_manager=True)
    assert not windows_kept([windowed, full], hybrid_manager=False)
    assert not windows_kept([windowed, LayerCache(2, 32)], hybrid_manager=True)  # shapes differ
    assert windows_kept([windowed, windowed], hybrid_manager=False)  # every layer windowed
    # An 8-bit cache has no in-place write: its windows stay planned as full attention (no sharing).
    assert not windows_kept([windowed, full], hybrid_manager=True, cache_dtype="fp8")
    assert windows_kept([windowed, windowed], hybrid_manager=True, cache_dtype="fp8")


def test_an_8_bit_cache_keeps_one_array_pair_per_layer(gemma3_dir):
    """--kv-cache-dtype fp8: no in-place 8-bit write, so a shared array would be
    copied whole by every later writer, every step: the windows are declared
    as full attention (one group), each layer with its own arrays."""
    with engine(gemma3_dir, kv_cache_dtype="fp8", **COMMON) as llm:
        runner, config = runner_of(llm), kv_config(llm)
        assert [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups] == ["FullAttentionSpec"]
        assert len(runner.kv.keys.slots) == 3
        assert runner.kv_bytes_ratio() == 1.0
        assert generate(llm, PROMPTS[1:2])[0].outputs[0].token_ids
