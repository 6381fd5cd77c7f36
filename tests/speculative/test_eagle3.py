"""EAGLE-3 speculation (vLLM's method "eagle3") through vLLM's engine, on
tiny llama and qwen3 targets with tiny EAGLE-3 heads in vLLM's checkpoint
layout (eagle3_model.py: a llama head with a draft vocabulary and d2t, aux
layers from its config; a qwen3 head with per-head q/k norms, no lm_head,
the target's default aux layers): greedy output == the output without
speculation (8 concurrent requests of mixed lengths, an early stop, chunked
prefill, a prefix-cache hit, preemption through a tiny cache), drafts both
kept and rejected, counts == vLLM's spec-decode metrics; every recorded
draft is the head's own greedy continuation computed by an independent
reference (mlx-lm's target forward with its layers hooked for the aux
states, the head in plain MLX ops with dense attention), and the reference
with other aux layers disagrees (the aux states matter); the aux states of
every served target family == mlx-lm's residual streams (the one
family-dependent part); the heads and targets vllm-metal cannot serve are
refused at start. (Drafts are checked on a sample: every 4th / 3rd recorded
proposal; the qwen3 target's plain output is mlx-lm's greedy one.)
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from eagle3_model import Reference, aux_states, build_head, build_target
from engine_helpers import GOLDEN, engine, runner_of
from spec_helpers import (assert_counts_are_vllms_metrics, assert_keeps_the_distribution, joint_of_two, metrics,
                          record, sampling_counts, seeded_pairs)

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

pytestmark = pytest.mark.slow

K = 3
TEXT = GOLDEN[8]["prompt_ids"]  # 571 tokens
PROMPTS = [TEXT[40 * i:40 * i + 20 + 9 * i] for i in range(8)]  # 20 .. 83 tokens, no shared prefix
SHARED = TEXT[400:464]  # a prefix-cache hit: 4 full blocks, then two different tails


def eagle3(head: str, **extra) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": K, **extra}


N_SAMPLES = 240  # the distribution test's samples (top-k: spec_helpers.K)


@pytest.fixture(scope="module")
def models(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    llama = build_target("llama", root / "llama", model_dir, layers=4)
    qwen3 = build_target("qwen3", root / "qwen3", model_dir, layers=8, spread=0.3)
    return {"llama": llama, "llama head": build_head(root / "llama-head", llama, "llama", aux_ids=[0, 2, 4],
                                                     noise=0.2),
            "qwen3": qwen3, "qwen3 head": build_head(root / "qwen3-head", qwen3, "qwen3", noise=0.15)}


def generate(llm, prompts, params):
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


def workload(stop: int):
    """Mixed lengths; request 3 stops early at token `stop`."""
    params = [SamplingParams(temperature=0, max_tokens=24 - 2 * i, ignore_eos=True) for i in range(8)]
    params[3] = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop])
    return params


def tiny_cache():
    """Longer prompts (95 .. 143 tokens, no shared prefix) than the tiny cache holds at once."""
    prompts = [TEXT[13 * i:13 * i + 16 * (6 + i % 3) - 1] for i in range(8)]
    return prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def prefix_hit(llm):
    """Two requests sharing SHARED, one after the other (the second reads the first's cached
    blocks): their outputs, and the second's cached tokens."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = generate(llm, [SHARED + TEXT[500:509]], params)
    second = llm.generate([TokensPrompt(prompt_token_ids=SHARED + TEXT[520:533])], params, use_tqdm=False)[0]
    return first + [(list(second.outputs[0].token_ids), second.outputs[0].finish_reason)], second.num_cached_tokens


QWEN3_TOKENS = [16, 14, 12, 10]


@pytest.fixture(scope="module")
def runs(models):
    out = {}
    with engine(models["llama"], max_num_seqs=16) as llm:
        first = generate(llm, PROMPTS[3:4], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0][0]
        stop = next(t for j, t in enumerate(first) if j >= 4 and t not in first[:j])
        out["plain"] = generate(llm, PROMPTS, workload(stop))
        out["plain prefix"] = prefix_hit(llm)
        out["plain tiny"] = generate(llm, *tiny_cache())
        out["joint"] = joint_of_two(llm, PROMPTS[1])
    ref = Reference(models["qwen3"], models["qwen3 head"])  # mlx-lm's greedy output of the qwen3 target
    out["qwen3 plain"] = [(ref.target_next(p, n), "length") for p, n in zip(PROMPTS[:4], QWEN3_TOKENS)]
    os.environ["VLLM_METAL_SPEC_BUDGET"] = "0"  # every draft verified (vLLM's behaviour)
    try:
        # One engine for the llama head: chunked prefill (48-token chunks: pairs whose next token is the
        # next chunk's first), a cache of 17 blocks (the batches below need more: preemptions), prefix caching.
        with engine(models["llama"], speculative_config=eagle3(models["llama head"]), disable_log_stats=False,
                    max_num_seqs=16, max_num_batched_tokens=48, max_model_len=256,
                    kv_cache_memory_bytes=17 * 5 * 2 * 16 * 2 * 16 * 4) as llm:
            runner = runner_of(llm)
            s = runner.speculator
            assert s.budget is None and runner.async_scheduling
            out["proposals"] = []
            record(runner, out["proposals"])
            out["spec"] = generate(llm, PROMPTS, workload(stop))
            out["spec prefix"] = prefix_hit(llm)
            out["spec tiny"] = generate(llm, *tiny_cache())
            out["resumed"] = runner.batch.num_resumed
            out["counts"] = s.drafted, s.accepted, s.verified_rows
            out["metrics"] = metrics(llm)
            before = sampling_counts(s)
            out["samples"] = seeded_pairs(llm, PROMPTS[1], N_SAMPLES)
            out["sample counts"] = tuple(a - b for a, b in zip(sampling_counts(s), before))
            out["aux layers"] = runner.mlx_model.aux_layers
        with engine(models["qwen3"], speculative_config=eagle3(models["qwen3 head"]), max_num_seqs=8) as llm:
            runner = runner_of(llm)
            out["qwen3 proposals"] = []
            record(runner, out["qwen3 proposals"])
            out["qwen3 spec"] = generate(llm, PROMPTS[:4], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                                            for n in QWEN3_TOKENS])
            out["qwen3 counts"] = runner.speculator.drafted, runner.speculator.accepted
            out["qwen3 aux layers"] = runner.mlx_model.aux_layers
    finally:
        del os.environ["VLLM_METAL_SPEC_BUDGET"]
    return out


def test_greedy_with_eagle3_is_the_plain_output(runs):
    assert runs["spec"] == runs["plain"] and runs["plain"][3][1] == "stop"
    (spec, hit), (plain, _) = runs["spec prefix"], runs["plain prefix"]
    assert spec == plain and hit >= 32, hit  # (EAGLE: vLLM leaves the last matched block out)
    assert runs["qwen3 spec"] == runs["qwen3 plain"]
    drafted, accepted, rows = runs["counts"]
    assert accepted > 20 and drafted - accepted > 20, runs["counts"]  # drafts kept and drafts rejected
    drafted, accepted = runs["qwen3 counts"]
    assert accepted > 5 and drafted - accepted > 5, runs["qwen3 counts"]
    assert runs["aux layers"] == (0, 2, 4) and runs["qwen3 aux layers"] == (2, 4, 5)  # config's; vLLM's default


def test_counts_are_vllms_spec_decode_metrics(runs):
    assert_counts_are_vllms_metrics(runs["counts"], runs["metrics"])

def test_seeded_random_sampling_keeps_the_target_distribution(runs):
    assert_keeps_the_distribution(runs["samples"], runs["joint"], runs["sample counts"])



def test_preemption_through_a_tiny_cache(runs):
    assert runs["resumed"] > 0, "the tiny cache should have forced preemptions"
    assert runs["spec tiny"] == runs["plain tiny"]


def test_drafts_are_the_heads_own_greedy_continuation(runs, models):
    for target, head, proposals, step in (("llama", "llama head", runs["proposals"], 4),
                                          ("qwen3", "qwen3 head", runs["qwen3 proposals"], 3)):
        ref = Reference(models[target], models[head])
        assert len(proposals) > 25, (target, len(proposals))
        for tokens, drafts in proposals[::step]:
            assert drafts == ref.drafts(tokens, len(drafts)), (target, len(tokens))
    # The aux states matter: the reference reading other target layers drafts otherwise.
    other = Reference(models["llama"], models["llama head"], aux_ids=(3, 1, 2))
    sample = runs["proposals"][::4]
    assert sum(d != other.drafts(t, len(d)) for t, d in sample) > len(sample) // 10


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mistral", "qwen3_moe"])
def test_aux_states_are_the_residual_streams_vllm_names(family, model_dir, tmp_path):
    """The one family-dependent part: the target's aux states (LoadedModel.forward's hidden_out with
    aux_layers, paged, fused as served on the CPU, the prompt in two chunks) == the residual streams
    before those layers in mlx-lm's own forward (hooked), for every EAGLE-3 target family."""
    import mlx.core as mx
    import numpy as np
    from families import build
    from mlx_lm.utils import load_model as mlx_load

    from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs
    from vllm_metal.models.loader import load_model
    from vllm_metal.speculative.eagle3_config import TARGET_FAMILIES

    assert family in TARGET_FAMILIES
    path = build(family, tmp_path / family, model_dir)
    loaded = load_model(path, fuse=True, norm_rope=True)
    n = loaded.num_layers
    loaded.aux_layers = (0, 1, n)  # the embeddings, a middle layer's input, the last layer's output
    prompt, block = TEXT[:40], 16
    windows = sorted(set(loaded.sliding_windows), key=lambda w: w or 0)
    kv = loaded.allocate_kv(8, [block] * len(windows), [windows.index(w) for w in loaded.sliding_windows])
    got = []
    for start, end in ((0, 24), (24, 40)):
        inputs = build_step_inputs([ScheduledRow(prompt[start:end], start, [list(range(1, 8))] * len(windows))],
                                   [block] * len(windows))
        hidden = []
        logits = loaded.forward(kv, inputs, np.arange(end - start), hidden_out=hidden)
        mx.eval(logits, hidden, kv.arrays())
        got.append(np.array(hidden[0]))
    target, _ = mlx_load(Path(path))
    target.set_dtype(mx.float32)
    want = np.array(aux_states(target, prompt, loaded.aux_layers))
    np.testing.assert_allclose(np.concatenate(got), want, rtol=1e-4, atol=1e-4)


def _variant(models, tmp_path, name: str, **kwargs) -> str:
    return build_head(tmp_path / name, models["llama"], "llama", aux_ids=[0, 2, 4], noise=0.2, **kwargs)


def test_what_eagle3_cannot_serve_is_refused(models, tmp_path, model_dir):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_metal.models.loader import load_model
    from vllm_metal.speculative import serving_config
    from vllm_metal.speculative.eagle3 import load_eagle3

    def start(head, model=models["llama"], **spec):
        EngineArgs(model=model, max_model_len=512, dtype="float32",
                   speculative_config=eagle3(head, **spec)).create_engine_config()

    refused = {  # config fields -> what the refusal says
        "hidden": ({"hidden_size": 32}, r"hidden size 32 .* the target 64: a head trained for another model"),
        "vocab": ({"vocab_size": 32000}, r"vocabulary \(32000 tokens.* is not the target's \(49152\)"),
        "quantized": ({"quantization": {"group_size": 64, "bits": 4}}, r"head is quantized"),
        "arch": ({"architectures": ["Eagle3DeepseekV2ForCausalLM"]},
                 r"is a Eagle3DeepseekV2ForCausalLM; vllm-metal runs"),
        "variant": ({"norm_before_residual": True}, r"with norm_before_residual are not served"),
        "layers": ({"eagle_aux_hidden_state_layer_ids": [0, 2, 9]}, r"reads target layers \[0, 2, 9\], outside"),
    }
    for name, (fields, message) in refused.items():
        with pytest.raises(ValueError, match=message):
            start(_variant(models, tmp_path, name, config_overrides=fields))
    good = models["llama head"]
    with pytest.raises(ValueError, match=r"EAGLE-3 drafting for a gemma target is not served.*use method 'ngram'"):
        from families import build

        start(good, model=build("gemma", tmp_path / "gemma", model_dir))
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8 with EAGLE-3"):
        EngineArgs(model=models["llama"], max_model_len=512, dtype="float32", kv_cache_dtype="fp8",
                   speculative_config=eagle3(good)).create_engine_config()
    # EAGLE-1 (method "eagle"): refused at start (cuda_gate's row), serving_config naming EAGLE-3 instead.
    with pytest.raises(ValueError, match=r"method 'eagle' asks for speculative proposers other than"):
        start(_variant(models, tmp_path, "eagle1", config_overrides={"architectures": ["LlamaForCausalLM"]}),
              method="eagle")
    eagle1 = SimpleNamespace(speculative_config=SimpleNamespace(method="eagle"))
    assert "or 'eagle3' (an EAGLE-3 head for a llama / mistral / qwen2 / qwen3 / qwen3_moe target)" in \
        serving_config.refusal(eagle1)

    # Tensors, checked at load (the engine's start fails with these).
    target = load_model(models["llama"])
    spec = SimpleNamespace(num_speculative_tokens=K, target_model_config=SimpleNamespace(max_model_len=512))
    tensors = {
        "missing": ({"drop": ("midlayer.mlp.down_proj.weight", "fc.weight")},
                    r"head lacks \['midlayer.mlp.down_proj.weight', 'fc.weight'\]"),
        "no d2t": ({"drop": ("d2t",)}, r"drafts 4096 of the target's 49152 tokens but has no d2t"),
        "fc": ({"config_overrides": {"eagle_aux_hidden_state_layer_ids": [1, 3]}},
               r"fc.weight is \(64, 192\), not \(64, 128\) for the 2 target layers \[1, 3\]"),
    }
    for name, (kwargs, message) in tensors.items():
        spec.draft_model_config = SimpleNamespace(model=_variant(models, tmp_path, name, **kwargs))
        with pytest.raises(ValueError, match=message):
            load_eagle3(target, spec, "float32", False, False, False)
    assert target.aux_layers == ()  # a refused head leaves the target as it was
    spec.draft_model_config = SimpleNamespace(model=good)
    assert load_eagle3(target, spec, "float32", False, False, False).model.num_layers == 1
    assert target.aux_layers == (0, 2, 4)
