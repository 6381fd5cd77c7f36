"""The same request gives the same greedy tokens however the engine runs it:
alone, in a batch of 8 mixed-length requests, after a prefix-cache hit, with
its prompt split into chunks, and after being preempted and resumed; and the
per-layer-eval ablation gives the same tokens as the one-graph default, which
evaluates exactly once per engine step."""

from __future__ import annotations

import mlx.core as mx
import pytest
from engine_helpers import GOLDEN, engine, greedy, runner_of

from vllm_metal.native import greedy_head, ops

TARGET = GOLDEN[-1]  # the longest prompt (571 tokens)
OTHERS = [g["prompt_ids"] for g in GOLDEN[:7]]


@pytest.fixture(scope="module")
def default_llm(model_dir):
    with engine(model_dir, enable_prefix_caching=True) as llm:
        yield llm


def test_alone(default_llm):
    tokens, _ = greedy(default_llm, [TARGET["prompt_ids"]])
    assert tokens[0] == TARGET["greedy_ids"]


def test_in_a_mixed_batch_of_8(default_llm):
    tokens, _ = greedy(default_llm, OTHERS + [TARGET["prompt_ids"]])
    assert tokens[-1] == TARGET["greedy_ids"]
    assert tokens[:7] == [g["greedy_ids"] for g in GOLDEN[:7]]


def test_prefix_cache_hit(default_llm):
    greedy(default_llm, [TARGET["prompt_ids"]])  # fills the cache
    tokens, outs = greedy(default_llm, [TARGET["prompt_ids"]])
    assert outs[0].num_cached_tokens >= 512, "the second run should reuse cached blocks"
    assert tokens[0] == TARGET["greedy_ids"]


def test_chunked_prefill(model_dir):
    with engine(model_dir, enable_chunked_prefill=True, max_num_batched_tokens=64, max_num_seqs=4) as llm:
        before = runner_of(llm).forward_passes
        tokens, _ = greedy(llm, [TARGET["prompt_ids"], OTHERS[0]])
        passes = runner_of(llm).forward_passes - before
    assert passes >= 571 // 64 + 31, "the 571-token prompt must have been prefilled in chunks"
    assert tokens[0] == TARGET["greedy_ids"]
    assert tokens[1] == GOLDEN[0]["greedy_ids"]


def test_preemption_and_resume(model_dir, default_llm):
    # Room for ~2.5 full requests (24 blocks of 16 tokens) while 8 run at once:
    # the scheduler must preempt and later resume some of them.
    prompts = [TARGET["prompt_ids"][:100 + 10 * i] for i in range(8)]  # 100..170 tokens
    expected, _ = greedy(default_llm, prompts, max_tokens=24)
    bytes_per_block = 30 * 2 * 16 * 3 * 64 * 4
    with engine(model_dir, kv_cache_memory_bytes=24 * bytes_per_block, max_num_seqs=8,
                max_model_len=256) as llm:
        tokens, _ = greedy(llm, prompts, max_tokens=24)
        resumed = runner_of(llm).batch.num_resumed
    assert resumed > 0, "the tiny cache should have forced preemptions"
    assert tokens == expected


def test_sync_per_layer_ablation_gives_same_tokens(model_dir, default_llm, monkeypatch):
    prompts = [TARGET["prompt_ids"], OTHERS[1], OTHERS[4]]
    runner = runner_of(default_llm)
    lazy_tokens, _ = greedy(default_llm, prompts)
    assert runner.evaluations == runner.forward_passes  # one evaluation per step (every step since its start)
    monkeypatch.setenv("VLLM_METAL_SYNC_PER_LAYER", "1")
    with engine(model_dir) as llm:
        runner = runner_of(llm)
        eager_tokens, _ = greedy(llm, prompts)
        assert runner.evaluations == runner.forward_passes * (30 + 1)
    assert eager_tokens == lazy_tokens == [TARGET["greedy_ids"], GOLDEN[1]["greedy_ids"], GOLDEN[4]["greedy_ids"]]


def test_default_step_is_one_lazy_graph(default_llm, monkeypatch):
    """Instrumented: when the forward graph is fully built, no layer's cache
    write has run yet, and the step's graph (its caches) is then evaluated by
    exactly one call (mx.eval, or mx.async_eval under async scheduling; a
    greedy step's token feed may wait for the previous step's tokens, which
    evaluates nothing of this step)."""
    llm = default_llm
    runner = runner_of(llm)
    model = runner.mlx_model
    # The greedy head's bfloat16 screen: built before the worker read its memory (worker.py).
    assert (model._head_screen is not None) == greedy_head.screen_available()
    pending_when_built, eval_calls = [], []
    real_hidden, real_eval, real_async = model.hidden_states, mx.eval, mx.async_eval

    def hidden_states(*args, **kwargs):
        out = real_hidden(*args, **kwargs)
        pending_when_built.append(sum(not ops._ext.is_materialized(k) for k in runner.kv.keys))
        return out

    def counting(real):
        def call(*args):
            # A call evaluating the step's caches (the list of the runner's current KV arrays).
            if any(isinstance(a, list) and any(x is runner.kv.keys[0] for x in a) for a in args):
                eval_calls.append(len(args))
            return real(*args)
        return call

    monkeypatch.setattr(model, "hidden_states", hidden_states)
    monkeypatch.setattr(mx, "eval", counting(real_eval))
    monkeypatch.setattr(mx, "async_eval", counting(real_async))
    before = runner.forward_passes
    greedy(llm, [TARGET["prompt_ids"], OTHERS[2]], max_tokens=8)
    steps = runner.forward_passes - before
    assert steps >= 8
    assert pending_when_built == [30] * steps  # all 30 layers' writes still lazy
    assert len(eval_calls) == steps
