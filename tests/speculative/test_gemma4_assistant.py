"""Gemma 4's assistant (vLLM's Gemma4MTP drafter: a `gemma4_assistant`
checkpoint as the speculative "model") through vLLM's engine, on a tiny
Gemma 4 target and tiny assistants built with transformers' own classes
(gemma4_assistant_model.py): greedy output == the output without
speculation (8 concurrent requests of mixed lengths under chunked prefill,
a prefix-cache hit, preemption through a tiny cache), drafts both kept and
rejected, counts == vLLM's spec-decode metrics; the drafts of about 30
recorded proposals spread over each run are the assistant's own greedy
continuation computed by an independent reference (plain mlx ops over the
K/V of mlx-lm's own gemma4_text forward, itself checked against
transformers' own Gemma4AssistantForCausalLM), with the full head and with
centroid-masked logits; what cannot be served is refused at start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from engine_helpers import GOLDEN, engine, runner_of
from spec_helpers import (assert_counts_are_vllms_metrics, assert_keeps_the_distribution, joint_of_two, metrics,
                          record, sampling_counts, seeded_pairs)
from gemma4_assistant_model import Reference, build_assistant, build_target

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

pytestmark = pytest.mark.slow

K = 3
PROMPTS = [g["prompt_ids"][:24 + 9 * i] for i, g in enumerate(GOLDEN[:8])]  # distinct, longer than the window (24)
HITS = [PROMPTS[7][:64] + PROMPTS[1][:12], PROMPTS[6][:48] + PROMPTS[2][:20]]  # whole cached blocks, then new
PREEMPT = [(PROMPTS[7] * 3)[:16 * (6 + i % 3) - 1] for i in range(8)]
PARAMS = [SamplingParams(temperature=0, max_tokens=30 - 2 * i, ignore_eos=True) for i in range(8)]
SHORT = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


N_SAMPLES = 240  # the distribution test's samples (top-k: spec_helpers.K)


@pytest.fixture(scope="module")
def models(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4-assistant")
    target = build_target(root / "target", model_dir)
    # Both narrower than the target (hidden 48 of 64); "raw": blocks less damped, centroid-masked logits.
    return {"target": target, "damped": build_assistant(root / "damped", target, hidden=48),
            "raw": build_assistant(root / "raw", target, hidden=48, damp=0.5, mix=0.2, masked=(16, 8))}


def spec(assistant: str) -> dict:
    return {"model": assistant, "num_speculative_tokens": K}  # vLLM detects the method ("mtp")


def generate(llm, prompts, params):
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def runs(models):
    out = {}
    with engine(models["target"], max_num_seqs=16) as llm:
        out["plain"] = generate(llm, PROMPTS, PARAMS)
        out["plain hits"] = generate(llm, HITS, SHORT)
        out["plain preempt"] = generate(llm, PREEMPT, SHORT)
        out["joint"] = joint_of_two(llm, PROMPTS[1])
    os.environ["VLLM_METAL_SPEC_BUDGET"] = "0"  # every draft verified (vLLM's behaviour)
    try:
        # Chunked prefill (32-token chunks) in a mixed batch of 8.
        with engine(models["target"], speculative_config=spec(models["damped"]), disable_log_stats=False,
                    max_num_seqs=16, max_num_batched_tokens=32) as llm:
            runner = runner_of(llm)
            s = runner.speculator
            assert s.budget is None and runner.async_scheduling and not runner.get_kv_cache_spec().keys() - {
                f"model.layers.{i}.self_attn" for i in range(2)}  # the assistant declares no cache of its own
            out["proposals"] = []
            record(runner, out["proposals"])
            out["spec"] = generate(llm, PROMPTS, PARAMS)
            out["counts"] = s.drafted, s.accepted, s.verified_rows
            out["metrics"] = metrics(llm, "vllm:spec_decode")
            before = sampling_counts(s)
            out["samples"] = seeded_pairs(llm, PROMPTS[1], N_SAMPLES)
            out["sample counts"] = tuple(a - b for a, b in zip(sampling_counts(s), before))
            out["spec hits"] = generate(llm, HITS, SHORT)
            out["prefix hits"] = metrics(llm, "vllm:prefix_cache_hits")
        # The masked-logits assistant, preempted requests (a tiny cache), 1 to K drafts a request.
        per_block = 16 * 2 * 2 * (16 + 32) * 4  # 16 tokens x K/V x 2 KV heads x (sliding 16 + full 32) x fp32
        with engine(models["target"], speculative_config=spec(models["raw"]), kv_cache_memory_bytes=40 * per_block,
                    max_num_seqs=8, max_model_len=512, enable_prefix_caching=False) as llm:
            runner = runner_of(llm)
            out["raw proposals"] = []
            record(runner, out["raw proposals"], vary_up_to=K)
            out["spec preempt"] = generate(llm, PREEMPT, SHORT)
            out["resumed"] = runner.batch.num_resumed
            out["raw counts"] = runner.speculator.drafted, runner.speculator.accepted
    finally:
        del os.environ["VLLM_METAL_SPEC_BUDGET"]
    return out


def test_greedy_with_the_assistant_is_the_plain_output(runs):
    assert runs["spec"] == runs["plain"]
    drafted, accepted, rows = runs["counts"]
    assert accepted > 20 and drafted - accepted > 20, runs["counts"]  # drafts kept and drafts rejected

def test_seeded_random_sampling_keeps_the_target_distribution(runs):
    assert_keeps_the_distribution(runs["samples"], runs["joint"], runs["sample counts"])



def test_counts_are_vllms_spec_decode_metrics(runs):
    assert_counts_are_vllms_metrics(runs["counts"], runs["metrics"])


def test_a_prefix_cache_hit(runs):
    assert runs["prefix hits"]["vllm:prefix_cache_hits"] >= 16  # a whole block or more read from the cache
    assert runs["spec hits"] == runs["plain hits"]


def test_preemption_with_the_masked_assistant(runs):
    assert runs["resumed"] > 0, "the tiny cache should have forced preemptions"
    assert runs["spec preempt"] == runs["plain preempt"]
    drafted, accepted = runs["raw counts"]
    assert 0 < accepted < drafted, runs["raw counts"]


@pytest.mark.parametrize("kind", ["damped", "raw"])
def test_sampled_drafts_are_the_assistants_own_greedy_continuation(runs, models, kind):
    ref = Reference(models["target"], models[kind])
    proposals = runs["proposals" if kind == "damped" else "raw proposals"]
    assert len(proposals) > 40
    for tokens, drafts in proposals[::max(1, len(proposals) // 30)]:  # about 30, spread over the run
        assert drafts == ref.drafts(tokens, len(drafts)), len(tokens)


@pytest.mark.parametrize("kind", ["damped", "raw"])
def test_the_reference_is_transformers_own_assistant(models, kind):
    """One pass of the reference == transformers' Gemma4AssistantForCausalLM on the same checkpoint
    (its shared_kv_states: the same K/V of mlx-lm's forward; the query at vLLM's position P - 1,
    past the sliding window): the reference's arithmetic is the published model's."""
    import mlx.core as mx
    import numpy as np
    import torch
    from transformers import Gemma4AssistantForCausalLM

    ref = Reference(models["target"], models[kind])
    model = Gemma4AssistantForCausalLM.from_pretrained(models[kind], dtype=torch.float32).eval()
    for tokens in (PROMPTS[3], PROMPTS[6][:30]):
        h, kv = ref.target_states(tokens[:-1])
        position = len(tokens) - 2
        d, back = ref.one_pass(tokens[-1], h[position], position, kv)
        shared = {t: tuple(torch.tensor(np.array(a))[None] for a in kv[ref.source[i]])
                  for i, t in enumerate(ref.config["layer_types"])}
        with torch.no_grad():
            out = model(inputs_embeds=torch.tensor(np.array(ref.inputs(tokens[-1], h[position])))[None, None],
                        position_ids=torch.tensor([[position]]), shared_kv_states=shared)
        assert np.abs(out.last_hidden_state[0, 0].numpy() - np.array(back)).max() < 1e-4 * float(mx.abs(back).max())
        assert int(out.logits[0, 0].argmax()) == ref.draft(d)


def variant(src: str, out: Path, edit) -> str:
    """A copy of the assistant at `src` (its tensors linked) with its config.json edited by `edit`."""
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((Path(src) / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def test_what_the_assistant_cannot_serve_is_refused(models, model_dir, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    def refusal(assistant: str, target: str = models["target"], **kwargs) -> str:
        with pytest.raises(Exception) as e:
            EngineArgs(model=target, max_model_len=512, dtype="float32", speculative_config=spec(assistant),
                       **kwargs).create_engine_config()
        return str(e.value)

    damped = models["damped"]
    assert "it drafts for Gemma 4 models only, this is a llama model" in refusal(damped, model_dir)
    other = variant(damped, tmp_path / "backbone", lambda c: c.update(backbone_hidden_size=32))
    assert "its backbone_hidden_size is 32, the target's hidden size 64" in refusal(other)
    other = variant(damped, tmp_path / "heads", lambda c: c["text_config"]["per_layer_config"]["1"].update(head_dim=16))
    assert "its layer 1 (full_attention) has 4 query heads of 16 over 2 KV heads, the target's layer 1 caches 2 " \
           "KV heads of 32" in refusal(other)
    other = variant(damped, tmp_path / "quantized", lambda c: c.update(quantization={"group_size": 32, "bits": 4}))
    assert "a quantized Gemma 4 assistant is not served" in refusal(other)
    assert "--kv-cache-dtype fp8 with a Gemma 4 assistant" in refusal(damped, kv_cache_dtype="fp8")
    other = variant(damped, tmp_path / "window", lambda c: c["text_config"].update(sliding_window=16))
    assert "its sliding window is 16 tokens, the target's 24" in refusal(other)
    other = variant(models["raw"], tmp_path / "centroids", lambda c: c.update(num_centroids=10))
    assert "centroid-masked logits with 10 centroids (top 8) over a vocabulary of 49152" in refusal(other)
    # A checkpoint missing a tensor: refused when the assistant loads, naming it.
    missing = tmp_path / "missing"
    missing.mkdir()
    import mlx.core as mx

    w = mx.load(str(Path(models["raw"]) / "model.safetensors"))
    mx.save_safetensors(str(missing / "model.safetensors"),
                        {k: v for k, v in w.items() if k != "masked_embedding.centroids.weight"})
    (missing / "config.json").write_text((Path(models["raw"]) / "config.json").read_text())
    with pytest.raises(Exception, match=r"the assistant checkpoint lacks masked_embedding.centroids.weight"):
        with engine(models["target"], speculative_config=spec(str(missing)), max_model_len=512):
            pass
