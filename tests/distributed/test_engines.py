"""Tensor and pipeline parallel through vLLM's engine on one host: one spawned
worker process per rank (vLLM's multiprocess executor), MLX's ring over
loopback as the data plane.

Against one rank: the golden greedy tokens of the embedded model (bit-exact,
single-host, tests/golden_tokens.json) and the single-rank engine's
prompt and sampled log-probabilities (float tolerance: tensor parallel sums
in another order); batched == solo; three pipeline stages (a middle stage receives and sends); tensor parallel
inside pipeline stages. A rank killed mid-generation fails the request with an error within a bound (never a
hang), and the engine stops.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from engine_helpers import GOLDEN, engine
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

PROMPTS = [g["prompt_ids"] for g in GOLDEN[:4]] + [GOLDEN[-2]["prompt_ids"]]
GREEDY = [g["greedy_ids"][:16] for g in GOLDEN[:4]] + [GOLDEN[-2]["greedy_ids"][:16]]
LOGPROB_TOL = 2e-4


def generate(llm, prompts, max_tokens=16):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    prompt_lp = [np.array([o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]) for o, p in zip(outs, prompts)]
    sampled_lp = [np.array([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                  for o in outs]
    return tokens, prompt_lp, sampled_lp


def compare(got, want, label):
    tokens, prompt_lp, sampled_lp = got
    assert tokens == want[0], f"{label}: greedy tokens differ from one rank's"
    for a, b in zip(prompt_lp, want[1]):
        np.testing.assert_allclose(a, b, rtol=0, atol=LOGPROB_TOL, err_msg=f"{label}: prompt logprobs")
    for a, b in zip(sampled_lp, want[2]):
        np.testing.assert_allclose(a, b, rtol=0, atol=LOGPROB_TOL, err_msg=f"{label}: sampled logprobs")


ARGS = dict(max_model_len=1024, kv_cache_memory_bytes=48 << 20, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def one_rank(model_dir):
    with engine(model_dir, **ARGS) as llm:
        out = generate(llm, PROMPTS)
    assert out[0] == GREEDY
    return out


def workers_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.workers


def kill_mid_generation(llm, rank: int, bound_s: float = 60.0):
    """Kills worker `rank` while a long generation runs; returns the error and
    how long the generation took to fail."""
    result = {}

    def run():
        start = time.monotonic()
        try:
            llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])],
                         SamplingParams(temperature=0, max_tokens=900, ignore_eos=True), use_tqdm=False)
        except Exception as e:  # noqa: BLE001 -- what the test looks at
            result["error"] = e
        result["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(1.5)
    victim = next(w for w in workers_of(llm) if w.rank == rank)
    victim.proc.kill()
    thread.join(bound_s)
    assert not thread.is_alive(), f"generation still running {bound_s:.0f} s after rank {rank} was killed (a hang)"
    return result


# Three stages of ten layers: first, middle (receives and sends) and last. (Two stages: the tiny
# llama's pp=2 x tp=2 and the hybrid below, and test_multi_host.py across hosts.)
@pytest.mark.parametrize("pp,tp", [(3, 1), (1, 3)], ids=["pp3", "tp3"])
def test_default_model_across_ranks_equals_one_rank(pp, tp, model_dir, one_rank):
    with engine(model_dir, pipeline_parallel_size=pp, tensor_parallel_size=tp, **ARGS) as llm:
        assert len(workers_of(llm)) == pp * tp
        compare(generate(llm, PROMPTS), one_rank, f"pp={pp} tp={tp} batched")
        # Alone (8 tokens: the solo runs were two thirds of the decode steps, each a sum over the ranks)
        solo = [generate(llm, [p], max_tokens=8) for p in PROMPTS[:2]]
        assert [s[0][0] for s in solo] == [t[:8] for t in one_rank[0][:2]], f"pp={pp} tp={tp}: solo != batched"
        if pp > 1:  # the decode cadence that keeps micro-batches apart (distributed/scheduler.py)
            assert type(llm.llm_engine.engine_core.engine_core.scheduler).__name__ == "PipelineScheduler"
            # The last stage (the rank that answers the engine) dies mid-generation.
            result = kill_mid_generation(llm, rank=pp - 1)
            assert "error" in result, "the generation finished although a rank died"
            with pytest.raises(Exception):  # the engine is dead: later requests fail at once
                llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[1])], SamplingParams(max_tokens=2),
                             use_tqdm=False)


def test_tensor_parallel_inside_two_stages_on_a_tiny_llama(model_dir, tmp_path):
    from families import build

    path = build("llama", tmp_path / "llama", model_dir)  # 4 heads, 2 KV heads, MLP 128: TP=2 splits
    prompts = [p[:40] for p in PROMPTS]
    args = dict(max_model_len=256, kv_cache_memory_bytes=16 << 20)
    with engine(path, **args) as llm:
        want = generate(llm, prompts, max_tokens=8)
    # (tensor parallel alone: test_default_model_across_ranks_equals_one_rank[tp3]; three stages:
    # its [pp3])
    # 4 ranks: each stage's two TP ranks sum as a chain, stage 0's last rank hands over to stage 1's first.
    with engine(path, tensor_parallel_size=2, pipeline_parallel_size=2, **args) as llm:
        assert len(workers_of(llm)) == 4
        assert type(llm.llm_engine.engine_core.engine_core.scheduler).__name__ == "PipelineScheduler"
        compare(generate(llm, prompts, max_tokens=8), want, "tiny llama pp=2 x tp=2")


def test_hybrid_across_two_pipeline_stages_with_prefix_caching(model_dir, tmp_path):
    """A hybrid (qwen3_next: linear-attention and attention layers on both
    stages) on two pipeline stages with vLLM's defaults: its states move
    block to block on each stage (prefix caching's align mode), so a prompt
    sharing an 80-token prefix with earlier ones resumes from the cached
    state at its last block boundary, and every prompt's tokens are mlx-lm's
    greedy choices (teacher forcing)."""
    from families import build, reference_logprobs

    variant = build("qwen3_next", tmp_path / "qwen3_next", model_dir)
    ref = reference_logprobs(variant)
    long = GOLDEN[-1]["prompt_ids"]
    prompts = [long[300:380] + long[start:start + 14] for start in (400, 450, 500)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with engine(variant, max_model_len=512, kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=64,
                pipeline_parallel_size=2) as llm:
        block = llm.llm_engine.vllm_config.cache_config.block_size
        outs = [llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0] for p in prompts]
    assert outs[0].num_cached_tokens == 0 and outs[2].num_cached_tokens == 80 // block * block > 0
    for prompt, out in zip(prompts, outs):
        tokens = list(out.outputs[0].token_ids)
        rows = ref(prompt + tokens[:-1])[len(prompt) - 1:]
        assert (rows[np.arange(len(tokens)), tokens] >= rows.max(axis=1) - 1e-3).all()


def test_tensor_parallel_that_does_not_divide_the_heads_is_refused(model_dir):
    # The embedded model has 9 query heads and 3 KV heads: TP=2 cannot split them.
    with pytest.raises(Exception, match="divisible by tensor parallel size|does not divide"):
        with engine(model_dir, tensor_parallel_size=2, **ARGS):
            pass


def parallel_config(**kw):
    from types import SimpleNamespace

    base = dict(data_parallel_size=1, prefill_context_parallel_size=1, decode_context_parallel_size=1,
                enable_expert_parallel=False, tensor_parallel_size=1, pipeline_parallel_size=1, nnodes=1,
                distributed_executor_backend=None, distributed_timeout_seconds=None)
    base.update(kw)
    base["world_size"] = base["tensor_parallel_size"] * base["pipeline_parallel_size"]
    return SimpleNamespace(**base)


def test_platform_parallel_settings(monkeypatch):
    from vllm_metal.engine.platform import MetalPlatform

    import os

    # The platform writes os.environ: a copy, restored after the test.
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in ("VLLM_WORKER_MULTIPROC_METHOD",
                                                     "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS")})
    one = parallel_config()
    MetalPlatform._configure_parallel(one)
    assert one.distributed_executor_backend == "uni"
    pp = parallel_config(pipeline_parallel_size=2, distributed_executor_backend="uni")
    MetalPlatform._configure_parallel(pp)
    assert pp.distributed_executor_backend == "mp" and pp.distributed_timeout_seconds == 300

    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"  # never fork after MLX / Metal started
    assert "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS" not in os.environ  # one host: vLLM sees its workers die
    MetalPlatform._configure_parallel(parallel_config(pipeline_parallel_size=2, nnodes=2))
    assert os.environ["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "120"
    for kw, match in [(dict(data_parallel_size=2), "does not run data parallel"),
                      (dict(decode_context_parallel_size=2), "context parallel"),
                      (dict(enable_expert_parallel=True), "expert parallel"),
                      (dict(tensor_parallel_size=2, distributed_executor_backend="external_launcher"), "not 'ext"),
                      (dict(pipeline_parallel_size=2, distributed_executor_backend="ray"), "not 'ray'")]:
        with pytest.raises(ValueError, match=match):
            MetalPlatform._configure_parallel(parallel_config(**kw))
