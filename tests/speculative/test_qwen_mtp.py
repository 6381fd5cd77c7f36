"""Speculative decoding on a Qwen3.5 hybrid (Gated DeltaNet linear attention
beside gated full attention) with vLLM's defaults for hybrids -- prefix
caching in "align" mode, chunked prefill: its own MTP layer (`mtp.*`,
speculative/qwen_mtp.py) and n-gram drafts, the linear-attention states of
every verify row kept per position and the accepted one written back
(models/draft_states.py).

- The state of rejected drafts never stays: after a verify row whose drafts
  are partly rejected, the running state and the state of a block boundary
  the accepted tokens crossed are bit for bit those of plain decoding of the
  accepted tokens (and they are not without the selection).
- Greedy output with MTP == the output without speculation, token for
  token: 8 requests of mixed lengths sharing a block-aligned prefix (real
  prefix-cache hits), chunked prefill, preemption through a tiny
  cache; drafts both kept and rejected; every recorded proposal (a sample)
  is the MTP layer's own greedy continuation computed by an independent
  reference (mlx-lm's modules, dense attention, the target's hidden states
  from mlx-lm's forward: qwen_mtp_model.py).
- A draft model and n-gram drafts on the hybrid: the plain output, and
  mlx-lm's greedy choices (teacher forcing); drafts kept and rejected.
- What cannot be served is refused at start, with the alternative.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from engine_helpers import GOLDEN, engine, runner_of
from spec_helpers import (assert_counts_are_vllms_metrics, assert_keeps_the_distribution, joint_of_two, metrics,
                          record, sampling_counts, seeded_pairs)
from qwen_mtp_model import Reference, build_draft, build_qwen_mtp, to_hugging_face_layout

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

pytestmark = pytest.mark.slow

MTP = {"method": "mtp", "num_speculative_tokens": 3}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
BLOCK = 16
SHARED = GOLDEN[7]["prompt_ids"][:2 * BLOCK]  # a block-aligned prefix every prompt starts with
PROMPTS = [SHARED + g["prompt_ids"][:3 + 6 * i] for i, g in enumerate(GOLDEN[:8])]
CHUNK = 64  # max_num_batched_tokens: the longest prompts are prefilled in chunks
COMMON = dict(max_model_len=256, block_size=BLOCK, max_num_batched_tokens=CHUNK, max_num_seqs=8)


N_SAMPLES = 240  # the distribution test's samples (top-k: spec_helpers.K)


@pytest.fixture(scope="module")
def models(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-mtp")
    return {"damped": build_qwen_mtp(root / "damped", model_dir, tied=False),
            "raw": build_qwen_mtp(root / "raw", model_dir, damp=1.0)}


def generate(llm, prompts, params):
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("path,align,family", [("fused", True, "qwen3_5"), ("mlx-lm", True, "qwen3_5"),
                                               ("fused", False, "qwen3_5"), ("fused", True, "qwen3_next")])
def test_rejected_drafts_leave_no_state(models, model_dir, tmp_path, path, align, family, monkeypatch):
    """One request, align mode (16-token state blocks 11, 12, ...): a
    14-token prefill, then a verify row of 1 + 3 tokens of which 2 drafts
    are accepted (17 tokens: past the 16-token boundary). Block 11 must hold
    the state after 16 tokens, the running block 12 the state after 17 --
    exactly what plain steps write (2 tokens, then 1). On both recurrence
    paths (VLLM_METAL_GATED_DELTA: the fused primitive, mlx-lm's), and
    without prefix caching (one state slot per request: block 11); on
    qwen3_next's Gated DeltaNet too (its packed projections)."""
    import mlx.core as mx

    from vllm_metal.engine.state_align import AlignedStateIndex
    from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs
    from vllm_metal.models import draft_states
    from vllm_metal.models.loader import load_model

    monkeypatch.setenv("VLLM_METAL_GATED_DELTA", path)
    from families import build

    d = models["raw"] if family == "qwen3_5" else build(family, tmp_path / family, model_dir)
    loaded = load_model(d, dtype="float32")
    states = [i for i, s in enumerate(loaded.layer_kv) if s.layout == "state"]
    groups = [1 if i in states else 0 for i in range(loaded.num_layers)]
    tokens = GOLDEN[-1]["prompt_ids"][:18]
    attention, state = list(range(1, 9)), list(range(11, 19))

    def run(kv, index, steps):
        for done, n, drafts in steps:
            row = ScheduledRow(tokens[done:done + n], done, [attention, state], num_drafts=drafts)
            inputs = build_step_inputs([row], [BLOCK, BLOCK])
            if align:
                (src, dst), = index.plan(["r"], np.array([done]), np.array([n]), [inputs.block_tables[1]])
                inputs.state_slots = {1: (src, dst)}
            mx.eval(loaded.forward(kv, inputs, np.arange(n)), kv.arrays())

    def pools(kv, block):
        return [np.array(a[block]) for i in states for a in (kv.keys[i], kv.values[i])]

    plain = loaded.allocate_kv(32, [BLOCK, BLOCK], groups)
    run(plain, AlignedStateIndex(BLOCK), [(0, 14, 0), (14, 2, 0), (16, 1, 0)])
    spec, index = loaded.allocate_kv(32, [BLOCK, BLOCK], groups), AlignedStateIndex(BLOCK)
    run(spec, index, [(0, 14, 0), (14, 4, 3)])
    assert spec.drafts is not None and len(spec.drafts.candidates) == len(states)
    unselected = pools(spec, 12 if align else 11)
    draft_states.select(spec, np.array([2]), [BLOCK, BLOCK])
    assert spec.drafts is None
    running = 12 if align else 11
    for block in (11, 12) if align else (11,):
        for got, want in zip(pools(spec, block), pools(plain, block)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Without the selection the running block would hold the rejected draft's state.
    assert any(not np.allclose(u, w, atol=1e-4) for u, w in zip(unselected, pools(plain, running)))


def test_a_hugging_face_checkpoints_layer_loads_alike(models, tmp_path):
    """The same weights stored as Hugging Face stores them (norms w for
    x * (1 + w), convolutions [C, 1, K]) give the same MTP layer."""
    from mlx.utils import tree_flatten

    from vllm_metal.models.loader import load_model
    from vllm_metal.speculative.qwen_mtp import load_qwen_mtp

    spec = SimpleNamespace(num_speculative_tokens=2, target_model_config=SimpleNamespace(max_model_len=256))
    layers = []
    for d in (models["damped"], to_hugging_face_layout(models["damped"], tmp_path / "hf")):
        drafter = load_qwen_mtp(load_model(d, dtype="float32"), d, spec, "float32", False, False, False)
        layers.append({**{k: v for k, v in tree_flatten(drafter.model.model.parameters()) if "lm_head" not in k},
                       **{n: getattr(drafter, n).weight for n in ("enorm", "hnorm", "eh_proj", "shared_norm")}})
    assert layers[0].keys() == layers[1].keys() and len(layers[0]) > 10
    for k, v in layers[0].items():
        np.testing.assert_allclose(np.array(layers[1][k]), np.array(v), atol=1e-6, err_msg=k)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_the_layer_drafts_as_the_reference(model_dir, tmp_path, family):
    """The loaded layer (qwen3_5: the tied head; qwen3_5_moe: a MoE block,
    its experts stored one by one; qwen3_next: Hugging Face's layout, the
    only one whose target mlx-lm loads beside `mtp.*`) over a prompt's
    pairs, from mlx-lm's hidden states: every pair's output row is the
    reference's, the draft too."""
    import mlx.core as mx

    from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs
    from vllm_metal.models.loader import load_model
    from vllm_metal.speculative.qwen_mtp import load_qwen_mtp

    moe = family == "qwen3_5_moe"
    ref_dir = build_qwen_mtp(tmp_path / "ref", model_dir, family=family, tied=family == "qwen3_5", damp=1.0)
    if family == "qwen3_next":
        d = to_hugging_face_layout(ref_dir, tmp_path / "served")
        ref = Reference(d, ref_dir)
    else:
        ref = Reference(ref_dir)
        d = build_qwen_mtp(tmp_path / "served", model_dir, family=family, tied=not moe, damp=1.0,
                           experts_one_by_one=moe)
    spec = SimpleNamespace(num_speculative_tokens=1, target_model_config=SimpleNamespace(max_model_len=256))
    drafter = load_qwen_mtp(load_model(d, dtype="float32"), d, spec, "float32", False, False, False)
    drafter.kv = drafter.model.allocate_kv(4, [BLOCK], [0])
    tokens = GOLDEN[-1]["prompt_ids"][:24]
    hidden = ref.owner.model(mx.array(tokens)[None])[0]
    inputs = build_step_inputs([ScheduledRow(tokens[1:], 0, [[1, 2]])], [BLOCK])
    got, normed = drafter.drafts(drafter.run(inputs, mx.array(tokens[1:]), hidden[:-1]))
    want = []
    assert got.tolist()[-1] == ref.drafts(tokens, 1, want)[0]
    np.testing.assert_allclose(np.array(normed), np.array(want[0]), rtol=1e-4, atol=1e-4)


def spec_runs(models, model_dir, params, out) -> None:
    """MTP, a draft model and n-gram drafts on the hybrid."""
    # A tiny cache: preemptions (and prefix hits, and chunked prefill).
    with engine(models["damped"], speculative_config=MTP, disable_log_stats=False, num_gpu_blocks_override=32,
                **COMMON) as llm:
        runner = runner_of(llm)
        out["proposals"] = []
        record(runner, out["proposals"])
        out["spec"] = generate(llm, PROMPTS, params)
        s = runner.speculator
        out["counts"] = s.drafted, s.accepted, s.verified_rows
        out["resumed"] = runner.batch.num_resumed
        out["async"] = runner.async_scheduling
        out["metrics"] = metrics(llm)
        before = sampling_counts(s)
        out["samples"] = seeded_pairs(llm, PROMPTS[1], N_SAMPLES)
        out["sample counts"] = tuple(a - b for a, b in zip(sampling_counts(s), before))
    # A plain draft model (the target's embedding, final norm and head, its block damped).
    draft = build_draft(models["damped"], Path(models["damped"]).parent / "draft", model_dir)
    with engine(models["damped"], speculative_config={"method": "draft_model", "model": draft,
                                                      "num_speculative_tokens": 3}, **COMMON) as llm:
        runner = runner_of(llm)
        out["draft"] = generate(llm, PROMPTS, params)
        s = runner.speculator
        out["draft counts"] = s.drafted, s.accepted, s.verified_rows
    # The damped target's next token depends mostly on its current one: after a prompt that repeats the
    # start of its own continuation, n-gram drafts (the continuation) are kept often, not always.
    copy = [p + g[:16] + g[:3] for p, g in zip(PROMPTS, out["plain"][0])]
    with engine(models["damped"], speculative_config=NGRAM, **COMMON) as llm:
        runner = runner_of(llm)
        out["ngram prompts"] = copy
        out["ngram"] = generate(llm, copy, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        s = runner.speculator
        out["ngram counts"] = s.drafted, s.accepted, s.verified_rows


@pytest.fixture(scope="module")
def runs(models, model_dir):
    out = {}
    params = [SamplingParams(temperature=0, max_tokens=24 - i, ignore_eos=True) for i in range(8)]
    with engine(models["damped"], **COMMON) as llm:
        out["plain"] = generate(llm, PROMPTS, params)
        out["joint"] = joint_of_two(llm, PROMPTS[1])
    os.environ["VLLM_METAL_SPEC_BUDGET"] = "0"  # every draft verified (vLLM's behaviour; no timing in the counts)
    try:
        spec_runs(models, model_dir, params, out)
    finally:
        del os.environ["VLLM_METAL_SPEC_BUDGET"]
    return out


def test_greedy_with_mtp_is_the_plain_output(runs):
    assert runs["async"]  # vLLM's default: the drafts fill the scheduler's placeholders
    assert runs["spec"][0] == runs["plain"][0] and max(map(len, PROMPTS)) > CHUNK
    drafted, accepted, rows = runs["counts"]
    assert accepted > 20 and drafted - accepted > 20, runs["counts"]  # drafts kept and drafts rejected
    assert_counts_are_vllms_metrics(runs["counts"], runs["metrics"])
    assert sum(c >= BLOCK for c in runs["spec"][1]) >= 4, runs["spec"][1]  # the shared prefix hit the cache
    assert runs["resumed"] > 0, "the tiny cache should have forced preemptions"

def test_seeded_random_sampling_keeps_the_target_distribution(runs):
    assert_keeps_the_distribution(runs["samples"], runs["joint"], runs["sample counts"])



def test_greedy_with_a_draft_model_is_the_plain_output(runs):
    assert runs["draft"][0] == runs["plain"][0]
    drafted, accepted, rows = runs["draft counts"]
    assert accepted > 20 and drafted - accepted > 20, runs["draft counts"]


def test_proposals_are_the_mtp_layers_own(models, runs):
    ref = Reference(models["damped"])
    sample = runs["proposals"][::7]
    assert len(sample) >= 8
    for tokens, drafts in sample:
        assert ref.drafts(tokens, len(drafts)) == drafts


def test_ngram_on_a_hybrid_gives_mlx_lms_greedy_tokens(models, runs):
    from families import reference_logprobs

    ref = reference_logprobs(models["damped"])
    for prompt, tokens in zip(runs["ngram prompts"], runs["ngram"][0]):
        rows = ref(prompt + tokens[:-1])[len(prompt) - 1:]
        assert (rows[np.arange(len(tokens)), tokens] >= rows.max(axis=1) - 1e-3).all()
    drafted, accepted, rows = runs["ngram counts"]
    assert accepted > 10 and drafted - accepted > 10, runs["ngram counts"]


def test_what_hybrids_cannot_serve_is_refused(models):
    from vllm_metal.speculative import serving_config
    from vllm_metal.speculative.qwen_mtp import QWEN_MTP_FAMILIES

    assert QWEN_MTP_FAMILIES == serving_config.HYBRID_FAMILIES

    def config(family, method, mtp_layers=1):
        return SimpleNamespace(
            speculative_config=SimpleNamespace(method=method, num_speculative_tokens=2,
                                               rejection_sample_method="standard", draft_model_config=None),
            model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=family), is_hybrid=True,
                                         is_multimodal_model=False,
                                         hf_text_config=SimpleNamespace(mtp_num_hidden_layers=mtp_layers)),
            cache_config=SimpleNamespace(cache_dtype="auto"), lora_config=None, kv_transfer_config=None,
            parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))

    assert serving_config.refusal(config("qwen3_5", "mtp")) is None
    assert serving_config.refusal(config("qwen3_next", "ngram")) is None
    assert "this is a qwen3_5 model with 0: use method 'ngram'" in serving_config.refusal(config("qwen3_5", "mtp", 0))
    assert "this lfm2 model: serve it without --speculative-config" in serving_config.refusal(config("lfm2", "ngram"))
    # A checkpoint whose MTP layer is incomplete: named at load.
    broken = Path(models["raw"]).parent / "no-mtp-mlp"
    broken.mkdir(exist_ok=True)
    for f in Path(models["raw"]).iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    import mlx.core as mx

    w = mx.load(str(broken / "model.safetensors"))
    mx.save_safetensors(str(broken / "model.safetensors"),
                        {k: v for k, v in w.items() if not k.startswith("mtp.layers.0.mlp")})
    with pytest.raises(Exception, match=r"its MTP layer lacks mtp.layers.0.mlp"):
        with engine(str(broken), speculative_config=MTP, **COMMON):
            pass
