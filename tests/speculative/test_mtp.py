"""MTP speculation (vLLM's method "mtp") through vLLM's engine, on a tiny
GLM-4.5-style checkpoint with its multi-token-prediction layer
(mtp_model.py): greedy output == the output without speculation (8
concurrent requests of mixed lengths, an early stop, chunked prefill,
preemption through a tiny cache), drafts both kept and rejected, counts ==
vLLM's spec-decode metrics, the options that keep a request from drafting
give their plain outputs (the layer's cache is written for every request
anyway), seeded random sampling keeps the target distribution; every draft
is the MTP layer's own greedy continuation computed by an independent
reference (mlx-lm's modules, dense attention) on an undamped checkpoint
whose drafts depend on all of the layer's arithmetic; what cannot be served
is refused at start.
(Drafts are checked against the reference on a sample: every 9th / 7th recorded proposal.)
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import GOLDEN, engine, runner_of
from mtp_model import Reference, build_glm_mtp
from spec_helpers import K, assert_counts_are_vllms_metrics, metrics, record, top_k_distribution
from test_rejection import chi_square_p

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

MTP = {"method": "mtp", "num_speculative_tokens": 3}
PROMPTS = [g["prompt_ids"][:24 + 9 * i] for i, g in enumerate(GOLDEN[:8])]  # distinct: no shared prefix
N = 240  # the distribution test's samples (its top-k: test_engine_speculation.K)


@pytest.fixture(scope="module")
def models(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {"damped": build_glm_mtp(root / "glm-mtp", model_dir),
            "raw": build_glm_mtp(root / "glm-mtp-raw", model_dir, damp=1.0, noise=0.05, mix=0.3)}


def workload(stop: int):
    """Mixed lengths; request 3 stops early at token `stop`."""
    params = [SamplingParams(temperature=0, max_tokens=30 - 2 * i, ignore_eos=True) for i in range(8)]
    params[3] = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop])
    return PROMPTS, params


def early_stop(llm) -> int:
    """A token request 3 emits once, a few tokens in (greedy, no speculation)."""
    out = generate(llm, PROMPTS[3:4], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0][0][0]
    return next(t for j, t in enumerate(out) if j >= 4 and t not in out[:j])


def options():
    regex = StructuredOutputsParams(regex=r"[a-z]{3,12}( [a-z]{3,12}){2,5}")
    return [SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=16, presence_penalty=0.5, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=16, structured_outputs=regex),
            SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=1, ignore_eos=True),
            SamplingParams(temperature=1.0, top_k=1, seed=5, max_tokens=16, n=2, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=16, min_tokens=6, ignore_eos=False)]


def grammars():
    """Requests with a grammar draft too: a strict one (most drafts refused by the
    grammar's mask at their position) and one any text satisfies (drafts kept as without it)."""
    strict = StructuredOutputsParams(regex=r"[a-z]{3,12}( [a-z]{3,12}){2,5}")
    loose = StructuredOutputsParams(regex=r"(.|\n)*")
    return [SamplingParams(temperature=0, max_tokens=16, structured_outputs=g)
            for g in (strict, loose, strict, loose)]


def generate(llm, prompts, params):
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [[(list(c.token_ids), c.finish_reason,
              None if c.logprobs is None else [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
             for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def runs(models):
    out = {}
    with engine(models["damped"], max_num_seqs=16) as llm:
        prompts, params = workload(early_stop(llm))
        out["plain"] = generate(llm, prompts, params)
        out["stopped"] = out["plain"][3][0][1]
        out["plain", "options"] = generate(llm, [PROMPTS[0]] * 6, options())
        out["plain", "grammar"] = generate(llm, PROMPTS[:4], grammars())
        first_ids, p1 = top_k_distribution(llm, PROMPTS[1])
        out["joint"] = {(a, b): pa * pb for a, pa in zip(first_ids, p1)
                        for b, pb in zip(*top_k_distribution(llm, PROMPTS[1] + [a]))}
    with engine(models["raw"], max_num_seqs=16) as llm:
        raw_params = workload(early_stop(llm))[1]
        out["raw plain"] = generate(llm, prompts, raw_params)
    os.environ["VLLM_METAL_SPEC_BUDGET"] = "0"  # every draft verified (vLLM's behaviour)
    try:
        with engine(models["damped"], speculative_config=MTP, disable_log_stats=False, max_num_seqs=16) as llm:
            runner = runner_of(llm)
            s = runner.speculator
            assert s.budget is None and runner.async_scheduling
            out["spec"] = generate(llm, prompts, params)
            out["counts"] = s.drafted, s.accepted, s.verified_rows
            out["metrics"] = metrics(llm)
            out["spec", "options"] = generate(llm, [PROMPTS[0]] * 6, options())
            before = s.verified_rows, s.accepted
            out["spec", "grammar"] = generate(llm, PROMPTS[:4], grammars())
            out["grammar counts"] = s.verified_rows - before[0], s.accepted - before[1]
            before = s.verified_rows, s.accepted, s.drafted
            samples = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[1])] * N,
                                   [SamplingParams(temperature=1.0, top_k=K, seed=i, max_tokens=2, ignore_eos=True)
                                    for i in range(N)], use_tqdm=False)
            out["samples"] = [tuple(o.outputs[0].token_ids) for o in samples]
            out["sample counts"] = tuple(a - b for a, b in zip((s.verified_rows, s.accepted, s.drafted), before))
        # Chunked prefill (32-token chunks: pairs whose next token is the next chunk's first).
        with engine(models["raw"], speculative_config=MTP, max_num_seqs=16, max_num_batched_tokens=32) as llm:
            out["raw proposals"] = []
            record(runner_of(llm), out["raw proposals"])
            out["raw spec"] = generate(llm, prompts, raw_params)
    finally:
        del os.environ["VLLM_METAL_SPEC_BUDGET"]
    return out


def test_greedy_with_mtp_is_the_plain_output(runs):
    assert runs["spec"] == runs["plain"] and runs["stopped"] == "stop"
    assert runs["raw spec"] == runs["raw plain"]
    drafted, accepted, rows = runs["counts"]
    assert accepted > 20 and drafted - accepted > 20, runs["counts"]  # drafts kept and drafts rejected


def test_counts_are_vllms_spec_decode_metrics(runs):
    assert_counts_are_vllms_metrics(runs["counts"], runs["metrics"])


def test_options_give_their_plain_outputs(runs):
    for s, p in zip(runs["spec", "options"], runs["plain", "options"]):
        for (st, sr, slp), (pt, pr, plp) in zip(s, p):
            assert st == pt and sr == pr
            assert (slp is None) == (plp is None)
            for g, w in zip(slp or [], plp or []):  # (batch shapes differ: float32 rounding)
                assert g.keys() == w.keys() and all(abs(g[t] - w[t]) < 1e-4 for t in g)


def test_requests_with_a_grammar_draft_and_keep_their_plain_output(runs):
    assert runs["spec", "grammar"] == runs["plain", "grammar"]
    verified, accepted = runs["grammar counts"]
    assert verified >= 8 and accepted > 0, runs["grammar counts"]


def test_sampled_drafts_are_the_mtp_layers_own_greedy_continuation(runs, models):
    ref = Reference(models["raw"])
    proposals = runs["raw proposals"]
    assert len(proposals) > 100
    for tokens, drafts in proposals[::9]:
        assert drafts == ref.drafts(tokens, len(drafts)), len(tokens)


def test_seeded_random_sampling_keeps_the_target_distribution(runs):
    verified, accepted, drafted = runs["sample counts"]
    assert verified >= N // 2 and 0 < accepted < drafted, runs["sample counts"]
    pairs = list(runs["joint"])
    counts = np.zeros(len(pairs))
    for t in runs["samples"]:
        counts[pairs.index(t)] += 1
    assert chi_square_p(counts, N * np.array([runs["joint"][p] for p in pairs])) > 1e-3


def test_preemption_through_a_tiny_cache(models, runs):
    per_block = 3 * 2 * 16 * 2 * 16 * 4  # 3 layers (2 + the MTP layer) x K/V x 16 tokens x 2 heads x 16 x fp32
    prompts = [(PROMPTS[7] * 3)[:16 * (6 + i % 3) - 1] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with engine(models["raw"], max_num_seqs=8, enable_prefix_caching=False) as llm:
        plain = generate(llm, prompts, params)
    proposals = []
    with engine(models["raw"], speculative_config=MTP, kv_cache_memory_bytes=40 * per_block, max_num_seqs=8,
                max_model_len=512, enable_prefix_caching=False) as llm:
        runner = runner_of(llm)
        record(runner, proposals)
        got = generate(llm, prompts, params)
        assert runner.batch.num_resumed > 0, "the tiny cache should have forced preemptions"
    assert got == plain
    ref = Reference(models["raw"])
    for tokens, drafts in proposals[::7]:
        assert drafts == ref.drafts(tokens, len(drafts)), len(tokens)


def test_what_mtp_cannot_serve_is_refused(model_dir, models, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_metal.speculative import mtp, serving_config

    assert tuple(mtp.MTP_FAMILIES) == serving_config.MTP_FAMILIES
    with pytest.raises(Exception, match=r"Unsupported speculative method: 'mtp'"):  # a llama: vLLM's own check
        EngineArgs(model=model_dir, max_model_len=512, speculative_config=MTP).create_engine_config()
    broken = Path(models["raw"]).parent / "glm-mtp-no-layer"
    broken.mkdir(exist_ok=True)
    for f in Path(models["raw"]).iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    import mlx.core as mx

    w = mx.load(str(broken / "model.safetensors"))
    mx.save_safetensors(str(broken / "model.safetensors"),
                        {k: v for k, v in w.items() if not k.startswith("model.layers.2.mlp")})
    with pytest.raises(Exception, match=r"the MTP layer 2 lacks"):
        with engine(str(broken), speculative_config=MTP):
            pass
    # A family whose MTP layer vllm-metal does not run (vLLM serves it on CUDA): our refusal, with the alternative.
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(method="mtp", num_speculative_tokens=2, rejection_sample_method="standard"),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="mimo", num_nextn_predict_layers=1)),
        cache_config=SimpleNamespace(cache_dtype="auto"))
    assert "this is a mimo model with 1: use method 'ngram' or 'draft_model'" in serving_config.refusal(cfg)
    cfg.model_config.hf_config.model_type = "glm4_moe"
    cfg.model_config.hf_config.num_nextn_predict_layers = 2
    assert "with 2 multi-token-prediction layers is not served" in serving_config.refusal(cfg)
    cfg.model_config.hf_config.num_nextn_predict_layers = 1
    cfg.cache_config.cache_dtype = "fp8"
    assert "--kv-cache-dtype fp8 with MTP" in serving_config.refusal(cfg)
