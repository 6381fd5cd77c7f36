"""Speculative decoding through vLLM's engine (`--speculative-config`): n-gram on
the embedded model, and a draft model on a tiny random target (3 layers, hidden 64,
the embedded vocabulary): the draft is the target without its last layer, whose
output projections are scaled down so its drafts are both kept and rejected.

For each method: greedy output with speculation is the output without it, token for token
(mlx-lm's greedy tokens: the golden tokens for the embedded model), with 8 concurrent
requests of mixed lengths, an early stop and preemption; the options that
keep a request from drafting (logprobs, penalties, a grammar) and those
that do not (prompt logprobs, n > 1, min_tokens) give their plain outputs;
seeded random sampling keeps the target distribution (chi-square against
the exact top-k distribution of the same weights); the runner's counts are
vLLM's spec-decode metrics; what is not served is refused at start.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import GOLDEN, engine, runner_of
from families import build
from spec_helpers import K, top_k_distribution
from test_rejection import chi_square_p

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
# Copying invites drafts: a passage, then its start again.
COPY = GOLDEN[7]["prompt_ids"] + GOLDEN[7]["prompt_ids"][:40]


def stop_at(greedy_ids: list[int]) -> int:
    """Where request 5 stops: the first token (from the 4th) not seen before in its greedy output."""
    return next(j for j, t in enumerate(greedy_ids) if j >= 3 and t not in greedy_ids[:j])


def truncated_draft(model_dir: str, layers: int, out: Path, vocab_size: int | None = None) -> str:
    """An MLX-format model's first `layers` layers (with its embedding, final norm and head) as a draft model."""
    import mlx.core as mx

    src = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = mx.load(str(src / "model.safetensors"))
    mx.save_safetensors(str(out / "model.safetensors"), {
        k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers})
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    config["vocab_size"] = vocab_size or config["vocab_size"]
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, out / name)
    return str(out)


# The draft model's target: a tiny qwen3 (a step costs the engine's overhead, not its layers, so
# the draft's k passes per step cost little); its last layer's attention and MLP outputs are scaled
# by LAST_LAYER_SCALE: the draft (the first two layers) then agrees with the target's greedy token
# about half the time (measured with mlx-lm: 53% over the greedy workload; in the engine, 98 of the
# greedy workload's 380 drafts kept, and 104 of the 240 sampled requests' first drafts).
TARGET_LAYERS, LAST_LAYER_SCALE = 3, 0.3


@pytest.fixture(scope="module")
def draft_target(model_dir, tmp_path_factory) -> str:
    import mlx.core as mx

    out = build("qwen3", tmp_path_factory.mktemp("target") / "qwen3", model_dir,
                overrides={"num_hidden_layers": TARGET_LAYERS})
    weights = mx.load(f"{out}/model.safetensors")
    last = f"model.layers.{TARGET_LAYERS - 1}."
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        weights[last + name] = weights[last + name] * LAST_LAYER_SCALE
    mx.save_safetensors(f"{out}/model.safetensors", weights)
    return out


@pytest.fixture(scope="module")
def draft_dir(draft_target, tmp_path_factory) -> str:
    return truncated_draft(draft_target, TARGET_LAYERS - 1, tmp_path_factory.mktemp("draft") / "qwen3-draft")


@pytest.fixture(scope="module")
def targets(model_dir, draft_target) -> dict:
    return {"ngram": model_dir, "draft": draft_target}


@pytest.fixture(scope="module")
def references(draft_target) -> dict:
    """Each target's greedy tokens (32) for the first seven golden prompts: mlx-lm's."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(draft_target))
    tiny = [[int(t) for t, _ in generate_step(mx.array(g["prompt_ids"]), model, max_tokens=32,
                                               sampler=lambda x: mx.argmax(x, axis=-1))] for g in GOLDEN[:7]]
    return {"ngram": [g["greedy_ids"] for g in GOLDEN[:7]], "draft": tiny}


def draft_config(draft: str) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 4}


def record_drafts(runner, into: list) -> None:
    """Every proposal of the runner's draft model as (the request's tokens, its drafts)."""
    drafter = runner.speculator.model
    propose = drafter.propose

    def recording(rows, req_ids, positions, tail, want, inputs_for):
        drafts = propose(rows, req_ids, positions, tail, want, inputs_for)
        into.extend((list(tail(r, 0)), d) for r, d in zip(req_ids, drafts))
        return drafts

    drafter.propose = recording


def check_drafts_against_mlx_lm(draft_dir: str, records: list, every: int, most: int = 24) -> int:
    """Every `every`-th recorded proposal (and each request's first: its catch-up) is
    mlx-lm's greedy continuation of the draft model's own weights; returns how many were checked.
    At most `most` are checked (each request's first ones first, then evenly over the rest):
    how many proposals a run records depends on the speculation budget, which follows measured
    step times, and each check is a full prefill of the draft model."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import dequantize_model

    model, _ = load(draft_dir)
    model = dequantize_model(model)  # as the engine serves it on the CPU (MLX's quantized matmul is 7x slower)
    seen, firsts, others = set(), [], []
    for i, (tokens, drafts) in enumerate(records):
        first = tuple(tokens[:8]) not in seen
        seen.add(tuple(tokens[:8]))
        if drafts and (first or i % every == 0):
            (firsts if first else others).append(i)
    room = max(0, most - len(firsts))
    picked = firsts[:most] + (others if len(others) <= room else [others[k * len(others) // room] for k in range(room)])
    checked = 0
    for i in sorted(picked):
        tokens, drafts = records[i]
        cache = make_prompt_cache(model)
        logits = model(mx.array(tokens)[None], cache=cache)
        want = []
        for _ in drafts:
            want.append(int(mx.argmax(logits[0, -1]).item()))
            logits = model(mx.array([[want[-1]]]), cache=cache)
        assert drafts == want, (i, len(tokens), drafts, want)
        checked += 1
    return checked


def greedy_workload(reference):
    """reference: the target's greedy tokens for the first seven golden prompts."""
    prompts = [g["prompt_ids"] for g in GOLDEN[:7]] + [COPY]
    params = [SamplingParams(temperature=0, max_tokens=32 - 3 * i, ignore_eos=True) for i in range(7)]
    params[5] = SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[reference[5][stop_at(reference[5])]])
    params.append(SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    return prompts, params


def options_workload():
    """(prompt, params, drafts): whether the request may draft."""
    json_like = StructuredOutputsParams(regex=r"[a-z]{3,12}( [a-z]{3,12}){2,5}")
    return [
        (COPY, SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True), False),
        (COPY, SamplingParams(temperature=0, max_tokens=24, presence_penalty=0.5, ignore_eos=True), False),
        (COPY, SamplingParams(temperature=0, max_tokens=24, structured_outputs=json_like), False),
        (COPY, SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=1, ignore_eos=True), True),
        # n > 1 samples randomly; top-k 1 makes its target one-hot: the greedy tokens, twice
        (COPY, SamplingParams(temperature=1.0, top_k=1, seed=5, max_tokens=24, n=2, ignore_eos=True), True),
        (COPY, SamplingParams(temperature=0, max_tokens=24, min_tokens=6, ignore_eos=False), True),
    ]


def generate(llm, prompts, params):
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [[(list(c.token_ids), c.finish_reason,
              None if c.logprobs is None else [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
             for c in o.outputs] + [o.prompt_logprobs] for o in outs]


def metrics(llm) -> dict:
    got = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode") and hasattr(m, "value"):
            got[m.name] = m.value
    return got


# K/V bytes per 16-token block and layer: the embedded model's (3 KV heads of 64), the tiny target's (2 of 16)
LAYER_BLOCK_BYTES = {"ngram": 2 * 16 * 3 * 64 * 4, "draft": 2 * 16 * 2 * 16 * 4}
N = 240  # the distribution test's samples, from COPY (whose first draft the target sometimes takes)


def preemption_workload():
    base = GOLDEN[-1]["prompt_ids"][:80]
    prompts = [(base * 3)[:16 * (10 + i % 3) - 1] for i in range(8)]  # repetitive: drafts match
    return prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def runs(targets, references, draft_dir):
    """Every workload on each target's engine without speculation and with it (shared by the tests)."""
    out = {}
    options = options_workload()
    for method, target in targets.items():
        prompts, params = greedy_workload(references[method])
        with engine(target, max_num_seqs=64) as llm:
            out[method, "plain", "copy"] = generate(llm, prompts[-1:], params[-1:])  # the others: mlx-lm's tokens
            out[method, "plain", "options"] = generate(llm, [p for p, _, _ in options], [q for _, q, _ in options])
            out[method, "plain", "preempted"] = generate(llm, *preemption_workload())
            first_ids, p1 = top_k_distribution(llm, COPY)
            out[method, "joint"] = {(a, b): pa * pb for a, pa in zip(first_ids, p1)
                                    for b, pb in zip(*top_k_distribution(llm, COPY + [a]))}
    # Every draft verified (vLLM's behaviour): the budget would rightly drop most drafts of a
    # 64-request batch on two cores, and these tests are about verifying them.
    os.environ["VLLM_METAL_SPEC_BUDGET"] = "0"
    try:
        for method, config in (("ngram", NGRAM), ("draft", draft_config(draft_dir))):
            prompts, params = greedy_workload(references[method])
            with engine(targets[method], speculative_config=config, disable_log_stats=False,
                        max_num_seqs=64) as llm:
                runner = runner_of(llm)
                s = runner.speculator
                # vLLM's V1 engine runs n-gram speculation synchronously (its rule), a draft model
                # with its default async scheduling (the drafts fill the scheduler's placeholders).
                assert s.budget is None and runner.async_scheduling == (method == "draft")
                assert (s.model is not None) == (method == "draft")
                if method == "draft":
                    record_drafts(runner, out.setdefault(("draft", "proposals"), []))
                out[method, "greedy"] = generate(llm, prompts, params)
                if method == "draft":
                    del runner.speculator.model.propose  # recorded only for the greedy workload
                out[method, "counts"] = s.drafted, s.accepted, s.verified_rows
                out[method, "metrics"] = metrics(llm)
                out[method, "options"] = generate(llm, [p for p, _, _ in options], [q for _, q, _ in options])
                out[method, "drafted_by_options"] = s.drafted - out[method, "counts"][0]
                before = s.verified_rows, s.accepted, s.drafted
                samples = llm.generate([TokensPrompt(prompt_token_ids=COPY)] * N,
                                       [SamplingParams(temperature=1.0, top_k=K, seed=i, max_tokens=2,
                                                       ignore_eos=True) for i in range(N)], use_tqdm=False)
                out[method, "samples"] = [tuple(o.outputs[0].token_ids) for o in samples]
                out[method, "sample_counts"] = tuple(now - was for now, was in
                                                     zip((s.verified_rows, s.accepted, s.drafted), before))
    finally:
        del os.environ["VLLM_METAL_SPEC_BUDGET"]
    return out


METHODS = pytest.mark.parametrize("method", ["ngram", "draft"])


@METHODS
def test_greedy_with_speculation_is_mlx_lms_output(runs, references, method):
    spec, plain, reference = runs[method, "greedy"], runs[method, "plain", "copy"], references[method]
    _, params = greedy_workload(reference)
    for i in range(7):
        tokens, reason, _ = spec[i][0]
        want = reference[i][:stop_at(reference[i]) + 1] if i == 5 else reference[i][:params[i].max_tokens]
        assert tokens == want, i
        assert (reason == "stop") == (i == 5)
    assert spec[7][0][0] == plain[0][0][0] and len(spec[7][0][0]) == 48
    drafted, accepted, rows = runs[method, "counts"]
    assert accepted > 10 and drafted - accepted > 10, runs[method, "counts"]  # drafts kept and drafts rejected


def test_the_draft_models_proposals_are_its_own_greedy_continuations(runs, draft_dir):
    """The draft cache is written lazily (a request's whole history the first time it
    drafts, then the tokens since), and shares prefix-cached blocks: each proposal is
    what mlx-lm's greedy decoding of the draft model's weights continues the request's tokens with."""
    assert check_drafts_against_mlx_lm(draft_dir, runs["draft", "proposals"], every=10) >= 8


@METHODS
def test_counts_are_vllms_spec_decode_metrics(runs, method):
    drafted, accepted, rows = runs[method, "counts"]
    m = runs[method, "metrics"]
    assert m["vllm:spec_decode_num_draft_tokens"] == drafted
    assert m["vllm:spec_decode_num_accepted_tokens"] == accepted
    assert m["vllm:spec_decode_num_drafts"] == rows
    assert accepted <= drafted


@METHODS
def test_options_give_their_plain_outputs(runs, method):
    spec, plain = runs[method, "options"], runs[method, "plain", "options"]
    for i, (s, p) in enumerate(zip(spec, plain)):
        for (st, sr, slp), (pt, pr, plp) in zip(s[:-1], p[:-1]):
            assert st == pt and sr == pr, i
            assert (slp is None) == (plp is None)
            for g, w in zip(slp or [], plp or []):
                assert g.keys() == w.keys() and all(abs(g[t] - w[t]) < 1e-4 for t in g)
        if s[-1] is not None:  # prompt logprobs
            for g, w in zip(s[-1][1:], p[-1][1:]):
                assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 for t in g)
    assert runs[method, "drafted_by_options"] > 0  # the requests that may draft did


@METHODS
def test_preemption_and_copies_through_a_tiny_cache(targets, draft_dir, runs, method):
    # A draft model's layers take their share of the cache: 48 blocks for both (its 2 layers besides the target's 3).
    config, layers = (NGRAM, 30) if method == "ngram" else (draft_config(draft_dir), 2 * TARGET_LAYERS - 1)
    with engine(targets[method], speculative_config=config,
                kv_cache_memory_bytes=48 * LAYER_BLOCK_BYTES[method] * layers,
                max_num_seqs=8, max_model_len=512, enable_prefix_caching=False) as llm:
        runner = runner_of(llm)
        proposals = []
        if method == "draft":
            record_drafts(runner, proposals)
        got = generate(llm, *preemption_workload())
        assert runner.batch.num_resumed > 0, "the tiny cache should have forced preemptions"
        assert runner.speculator.accepted > 0 and runner.speculator.budget is not None  # the default: budgeted
    assert got == runs[method, "plain", "preempted"]
    if method == "draft":  # resumed requests catch up again (their blocks were freed)
        assert check_drafts_against_mlx_lm(draft_dir, proposals, every=1) >= 2  # (the budget decides how many)


@METHODS
def test_seeded_random_sampling_keeps_the_target_distribution(runs, method):
    """Two tokens from a copy prompt at temperature 1, top-k 5, 240 seeds:
    the second token comes out of a verified row (drafts from the first);
    the joint counts against N p(t1) p(t2 | t1), the exact top-5
    distributions of the same weights (vLLM's raw logprobs, no speculation)."""
    verified, accepted, drafted = runs[method, "sample_counts"]
    assert verified >= N // 2 and 0 < accepted < drafted, runs[method, "sample_counts"]
    joint = runs[method, "joint"]
    pairs = list(joint)
    counts = np.zeros(len(pairs))
    for t in runs[method, "samples"]:
        counts[pairs.index(t)] += 1
    assert chi_square_p(counts, N * np.array([joint[p] for p in pairs])) > 1e-3


@pytest.mark.parametrize("spec,message", [
    ({"method": "ngram", "num_speculative_tokens": 129, "prompt_lookup_max": 3},
     r"num_speculative_tokens must be between 1 and 128 \(got 129\)"),
    ({"method": "ngram", "num_speculative_tokens": 0, "prompt_lookup_max": 3},
     r"num_speculative_tokens\s+Input should be greater than 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "rejection_sample_method": "fly"},
     r"rejection_sample_method 'fly' is not served by vllm-metal"),
    ({"method": "draft_model", "model": "{other_vocab}", "num_speculative_tokens": 2},
     r"Target and draft model should have the same vocabulary size"),  # vLLM's own check, at start
    ({"method": "eagle", "model": "{model}", "num_speculative_tokens": 2},
     r"method 'eagle' asks for speculative proposers other than host n-gram, a draft model, a checkpoint's MTP"),
])
def test_what_is_not_served_is_refused_at_start(model_dir, mlx_model_dir, tmp_path, spec, message):
    from vllm.engine.arg_utils import EngineArgs

    other = truncated_draft(mlx_model_dir, 2, tmp_path / "other-vocab", vocab_size=32000) \
        if spec.get("model") == "{other_vocab}" else None
    spec = {k: (v.format(model=model_dir, other_vocab=other) if isinstance(v, str) else v) for k, v in spec.items()}
    with pytest.raises(Exception, match=message):
        EngineArgs(model=model_dir, max_model_len=512, speculative_config=spec).create_engine_config()


def test_speculation_across_ranks_hybrids_images_connectors_and_odd_drafts_are_refused():
    from types import SimpleNamespace

    from vllm_metal.speculative.serving_config import refusal

    cfg = SimpleNamespace(speculative_config=SimpleNamespace(method="ngram", num_speculative_tokens=2,
                                                             rejection_sample_method="standard"),
                          parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1),
                          model_config=None, kv_transfer_config=None)
    assert "one rank" in refusal(cfg)
    cfg.parallel_config.tensor_parallel_size = 1
    cfg.model_config = SimpleNamespace(is_hybrid=True)
    assert "recurrent" in refusal(cfg)
    cfg.model_config = SimpleNamespace(is_hybrid=False, is_multimodal_model=True,
                                       multimodal_config=SimpleNamespace(language_model_only=False))
    assert "image requests" in refusal(cfg)
    cfg.model_config.multimodal_config.language_model_only = True  # text only: served
    assert refusal(cfg) is None
    cfg.kv_transfer_config = object()
    assert "--kv-transfer-config" in refusal(cfg)
    cfg.kv_transfer_config = None
    # A draft model: of the target's vocabulary (vLLM checks the sizes too), attention only, text only.
    draft = SimpleNamespace(model="d", get_vocab_size=lambda: 49152, is_hybrid=False, is_multimodal_model=False,
                            get_sliding_window=lambda: None)
    cfg.speculative_config = SimpleNamespace(method="draft_model", num_speculative_tokens=2,
                                             rejection_sample_method="standard", draft_model_config=draft)
    cfg.model_config.get_vocab_size = lambda: 49152
    cfg.cache_config = SimpleNamespace(cache_dtype="auto")
    assert refusal(cfg) is None
    cfg.cache_config.cache_dtype = "fp8"
    assert "--kv-cache-dtype fp8 with a draft model" in refusal(cfg)
    cfg.cache_config.cache_dtype = "auto"
    cfg.lora_config = object()  # either method
    assert "--enable-lora is not verified" in refusal(cfg)
    del cfg.lora_config
    draft.get_sliding_window = lambda: 4096
    assert "sliding-window" in refusal(cfg)
    draft.get_sliding_window = lambda: None
    cfg.speculative_config.use_heterogeneous_vocab = True
    assert "target's tokenizer" in refusal(cfg)
    del cfg.speculative_config.use_heterogeneous_vocab
    draft.is_hybrid = True
    assert "text-only full-attention models" in refusal(cfg)


def test_drafts_are_capped_by_the_schedulers_count():
    """vLLM's scheduler says how many drafts the next step takes
    (num_spec_tokens_to_schedule, e.g. from its per-batch-size schedule): no request gets more."""
    from types import SimpleNamespace

    from vllm_metal.speculative.speculator import Speculator

    spec = Speculator(SimpleNamespace(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                                      prompt_lookup_max=2),
                      512, custom_logitsprocs=False)
    state = SimpleNamespace(req_id="r", prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 1, 2], output_token_ids=[],
                            sampling_params=SamplingParams(temperature=0))
    for k, want in ((4, [3, 4, 5, 6]), (2, [3, 4]), (0, [])):
        spec.propose([state], [[2]], k)
        assert spec.take().draft_token_ids == [want]
