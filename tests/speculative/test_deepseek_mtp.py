"""DeepSeek-V3 MTP (vLLM's method "mtp", alias "deepseek_mtp") through vLLM's
engine, on a tiny DeepSeek-V3 checkpoint with its multi-token-prediction
layer (deepseek_mtp_model.py): latent attention (MLA) in the target and in
the MTP layer, whose own paged cache is latent too; the MTP block is
DeepSeek's MoE layer (sigmoid group routing with a correction bias).

Proven: greedy output == the output without speculation, token for token
(8 concurrent requests of mixed lengths under chunked prefill, then two
requests hitting the prefix cache), drafts both kept and rejected, counts
== vLLM's spec-decode metrics; every sampled proposal == an independent
reference (mlx-lm's DeepseekV3DecoderLayer with its own KVCache, dense
attention, run as vLLM's DeepSeekMultiTokenPredictorLayer and chained as
its proposer chains DeepSeekMTPModel: the normed rows fed back), on the
damped checkpoint and on an undamped one whose drafts depend on all of the
layer's arithmetic -- there the proposals are checked to differ from GLM's
chaining (m fed back), so the check sees the difference. GLM-4.7-Flash's
(glm4_moe_lite) MTP layer, also an MLA block, chained GLM's way. A quantized
MTP layer is refused, and Kimi K2's by vLLM itself.
"""

from __future__ import annotations

import os

import pytest
from deepseek_mtp_model import Reference, build_deepseek_mtp
from engine_helpers import GOLDEN, engine, runner_of
from spec_helpers import (assert_counts_are_vllms_metrics, assert_keeps_the_distribution, joint_of_two, metrics,
                          record, sampling_counts, seeded_pairs)

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_metal.native import greedy_head

pytestmark = pytest.mark.slow

MTP = {"method": "deepseek_mtp", "num_speculative_tokens": 3}  # vLLM's alias of "mtp"
PROMPTS = [g["prompt_ids"][:20 + 7 * i] for i, g in enumerate(GOLDEN[:8])]  # distinct: no shared prefix
# After the batch: prompts sharing 3 blocks (48 tokens) with request 7's: prefix-cache hits.
AGAIN = [PROMPTS[7][:48] + GOLDEN[0]["prompt_ids"][:5], PROMPTS[7][:50] + GOLDEN[1]["prompt_ids"][:9]]
CHUNKED = dict(max_num_batched_tokens=32, max_num_seqs=16, max_model_len=512)


N_SAMPLES = 240  # the distribution test's samples (top-k: spec_helpers.K)


@pytest.fixture(scope="module")
def models(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-mtp")
    return {"damped": build_deepseek_mtp(root / "ds-mtp", model_dir, damp=0.05, mix=0.2, spread=0.25),
            "raw": build_deepseek_mtp(root / "ds-mtp-raw", model_dir, damp=1.0, noise=0.05, mix=0.3, spread=0.5)}


def params():
    return [SamplingParams(temperature=0, max_tokens=24 - 2 * i, ignore_eos=True) for i in range(8)]


def generate(llm, prompts, sampling):
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


@pytest.fixture(scope="module")
def runs(models):
    out = {}
    again = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with engine(models["damped"], **CHUNKED) as llm:
        out["plain"] = generate(llm, PROMPTS, params())[0]
        out["plain again"] = generate(llm, AGAIN, again)[0]
        out["joint"] = joint_of_two(llm, PROMPTS[1])
    os.environ["VLLM_METAL_SPEC_BUDGET"] = "0"  # every draft verified (vLLM's behaviour)
    try:
        with engine(models["damped"], speculative_config=MTP, disable_log_stats=False, **CHUNKED) as llm:
            runner = runner_of(llm)
            s = runner.speculator
            assert runner.vllm_config.speculative_config.method == "mtp" and s.model.feeds_normed
            out["specs"] = runner.get_kv_cache_spec()
            out["proposals"] = []
            record(runner, out["proposals"])
            out["spec"] = generate(llm, PROMPTS, params())[0]
            out["spec again"], out["cached"] = generate(llm, AGAIN, again)
            out["counts"] = s.drafted, s.accepted, s.verified_rows
            out["screens"] = s.model.model._head_screen, runner.mlx_model._head_screen
            out["metrics"] = metrics(llm)
            before = sampling_counts(s)
            out["samples"] = seeded_pairs(llm, PROMPTS[1], N_SAMPLES)
            out["sample counts"] = tuple(a - b for a, b in zip(sampling_counts(s), before))
        with engine(models["raw"], speculative_config=MTP, **CHUNKED) as llm:
            out["raw proposals"] = []
            record(runner_of(llm), out["raw proposals"])
            generate(llm, PROMPTS[::2], params()[::2])
    finally:
        del os.environ["VLLM_METAL_SPEC_BUDGET"]
    return out


def test_greedy_with_deepseek_mtp_is_the_plain_output(runs):
    assert runs["spec"] == runs["plain"]
    # (vLLM's prefix cache gives a proposer with a cache of its own one block less: 2 of the 3 shared)
    assert runs["spec again"] == runs["plain again"] and min(runs["cached"]) >= 32, runs["cached"]
    drafted, accepted, rows = runs["counts"]
    assert accepted > 20 and drafted - accepted > 20, runs["counts"]  # drafts kept and drafts rejected


def test_the_mtp_layer_screens_through_the_targets_screen(runs):
    """The layer's greedy passes read the target's head through the target's bfloat16 screen
    (where the CPU runs one), not a second copy of it."""
    draft, target = runs["screens"]
    assert draft is target and (target is not None) == greedy_head.screen_available()


def test_counts_are_vllms_spec_decode_metrics(runs):
    assert_counts_are_vllms_metrics(runs["counts"], runs["metrics"])

def test_seeded_random_sampling_keeps_the_target_distribution(runs):
    assert_keeps_the_distribution(runs["samples"], runs["joint"], runs["sample counts"])



def test_the_mtp_layers_cache_is_latent_like_the_targets(runs):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    specs = runs["specs"]
    mtp, target = specs["mtp.layers.0.self_attn"], specs["model.layers.0.self_attn"]
    assert isinstance(mtp, MLAAttentionSpec) and mtp == target
    assert mtp.num_kv_heads == 1 and mtp.head_size == 32 + 16  # kv_lora_rank + qk_rope_head_dim


@pytest.mark.parametrize("which", ["proposals", "raw proposals"])
def test_sampled_drafts_are_the_mtp_layers_own_greedy_continuation(runs, models, which):
    model = models["raw" if which.startswith("raw") else "damped"]
    ref, glm_way = Reference(model), Reference(model, feeds_normed=False)
    proposals = runs[which]
    assert len(proposals) > 40
    differ = 0
    for tokens, drafts in proposals[::5]:
        assert drafts == ref.drafts(tokens, len(drafts)), len(tokens)
        differ += len(drafts) > 1 and drafts != glm_way.drafts(tokens, len(drafts))
    if which.startswith("raw"):  # the chaining is seen: GLM's way gives other drafts
        assert differ >= 3, differ


def test_what_deepseek_mtp_cannot_serve_is_refused(model_dir, tmp_path):
    from types import SimpleNamespace

    from vllm.engine.arg_utils import EngineArgs

    from vllm_metal.speculative import mtp, serving_config
    from vllm_metal.speculative.mtp import load_mtp

    assert tuple(mtp.MTP_FAMILIES) == serving_config.MTP_FAMILIES
    quantized = build_deepseek_mtp(tmp_path / "q", model_dir, bits=4)
    spec = SimpleNamespace(num_speculative_tokens=2, target_model_config=SimpleNamespace(max_model_len=512))
    with pytest.raises(ValueError, match=r"no multi-token-prediction layer vllm-metal can run \(a deepseek_v3 "
                                         r"quantized mlx checkpoint.*unquantized safetensors"):
        load_mtp(None, quantized, spec, "float32", False, False, False)
    # Kimi K2 (DeepSeek-V3's architecture, model_type kimi_k2): vLLM 0.33 itself has no MTP model for it.
    kimi = build_deepseek_mtp(tmp_path / "kimi", model_dir, model_type="kimi_k2")
    with pytest.raises(Exception, match=r"Unsupported speculative method: 'mtp'"):
        EngineArgs(model=kimi, max_model_len=512, speculative_config=MTP).create_engine_config()


def test_glm4_moe_lite_mtp_is_its_own_mla_block_chained_glms_way(model_dir, tmp_path):
    """GLM-4.7-Flash's layout (glm4_moe_lite: vLLM's Glm4MoeLiteMTP, which feeds m itself back): greedy
    == mlx-lm's own greedy of the target, drafts kept and rejected, proposals == the reference."""
    lite = build_deepseek_mtp(tmp_path / "lite", model_dir, model_type="glm4_moe_lite", damp=0.05, mix=0.2,
                              spread=0.25)
    ref, prompts, n = Reference(lite), PROMPTS[:4], 14
    os.environ["VLLM_METAL_SPEC_BUDGET"] = "0"
    try:
        with engine(lite, speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **CHUNKED) as llm:
            runner = runner_of(llm)
            assert not runner.speculator.model.feeds_normed
            proposals = []
            record(runner, proposals)
            got = generate(llm, prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
            drafted, accepted = runner.speculator.drafted, runner.speculator.accepted
    finally:
        del os.environ["VLLM_METAL_SPEC_BUDGET"]
    assert got == [ref.target_greedy(p, n) for p in prompts]
    assert 0 < accepted < drafted, (accepted, drafted)
    assert len(proposals) > 10
    for tokens, drafts in proposals[::3]:
        assert drafts == ref.drafts(tokens, len(drafts)), len(tokens)
