"""LoRA through the whole engine (vLLM's LoRARequest, its scheduler's
--max-loras, the runner's one graph per step), against independent
references on the same weights: mlx-lm's own load_adapters for mlx-lm
adapters, the merged weights W + scale * B A for PEFT adapters.

Per family: one engine (chunked prefill: 64-token budget; prefix caching on,
vLLM's default) serves the base model and two adapters mixed in one batch:
- greedy tokens by teacher forcing within 1e-3 of the reference's best, and
  prompt log-probabilities within 1e-3 (float64 log-softmax);
- the same tokens solo as mixed; every adapter changes the base's tokens;
- a repeated adapter prompt hits the prefix cache (keyed by adapter) and
  keeps its tokens.
Families: llama, qwen3, gemma3_text (both formats), qwen3_moe (attention and
router adapters), and a 4-bit llama kept quantized under the adapter (QLoRA,
as Metal serves it).
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import GOLDEN, engine, runner_of
from families import build
from lora_adapters import make_mlx_adapter, make_peft_adapter, merged_peft_model, reference_logprobs

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest

LONG = GOLDEN[-1]["prompt_ids"]
PROMPTS = [LONG[:20], LONG[100:190]]  # short; over one 64-token chunk
NUM_TOKENS = 10
TOL = 1e-3
MOE_KEYS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate"]
ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=512, kv_cache_memory_bytes=16 << 20,
              max_num_batched_tokens=64, max_num_seqs=8)


def generate(llm, prompts, loras, prompt_logprobs=None):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=loras,
                        use_tqdm=False)


def check_against(ref, prompt, out, what):
    tokens = list(out.outputs[0].token_ids)
    lp = ref(prompt + tokens[:-1])
    rows = lp[len(prompt) - 1:]
    chosen = rows[np.arange(len(tokens)), tokens]
    assert (chosen >= rows.max(axis=1) - TOL).all(), f"{what}: a token is not the reference's argmax"
    got = np.array([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
    np.testing.assert_allclose(got, lp[np.arange(len(prompt) - 1), prompt[1:]], atol=TOL,
                               err_msg=f"{what}: prompt logprobs")


def adapters_for(model_type, variant, root, formats):
    """{name: (LoRARequest path, reference)}: an mlx-lm adapter, and a PEFT
    one or a second mlx-lm one."""
    keys = MOE_KEYS if model_type == "qwen3_moe" else None
    mlx = make_mlx_adapter(variant, root / "mlx", rank=8, scale=2.0, keys=keys, num_layers=3, seed=11)
    out = {"mlx": (mlx, reference_logprobs(variant, mlx))}
    if "peft" in formats:
        peft = make_peft_adapter(variant, root / "peft", rank=4, alpha=8, seed=12,
                                 target_modules=("q_proj", "k_proj", "o_proj", "up_proj", "down_proj"))
        out["peft"] = (peft, reference_logprobs(merged_peft_model(variant, peft, root / "merged")))
    else:
        second = make_mlx_adapter(variant, root / "mlx2", rank=4, scale=1.5, keys=keys, num_layers=2, seed=13)
        out["mlx2"] = (second, reference_logprobs(variant, second))
    return out


@pytest.mark.parametrize("model_type,bits,formats", [
    ("llama", None, ("mlx", "peft")), ("qwen3", None, ("mlx", "peft")), ("gemma3_text", None, ("mlx", "peft")),
    ("qwen3_moe", None, ("mlx",)), ("llama", 4, ("mlx",))], ids=["llama", "qwen3", "gemma3_text", "qwen3_moe",
                                                                  "llama-4bit"])
def test_adapters_mixed_with_the_base_match_the_references(model_type, bits, formats, model_dir, tmp_path,
                                                           monkeypatch):
    if bits is not None:
        monkeypatch.setenv("VLLM_METAL_DEQUANTIZE", "0")  # the adapter over MLX-quantized weights, as on Metal
    variant = build(model_type, tmp_path / model_type, model_dir, bits=bits, group_size=32)
    adapters = adapters_for(model_type, variant, tmp_path, formats)
    refs = {"base": reference_logprobs(variant), **{k: ref for k, (_, ref) in adapters.items()}}
    requests = {"base": None, **{k: LoRARequest(k, i + 1, path) for i, (k, (path, _)) in enumerate(adapters.items())}}
    jobs = [(k, i) for k in requests for i in range(len(PROMPTS))]
    with engine(variant, **ENGINE) as llm:
        if bits is not None:
            assert runner_of(llm).mlx_model.quantized
        mixed = generate(llm, [PROMPTS[i] for _, i in jobs], [requests[k] for k, _ in jobs], prompt_logprobs=0)
        solo = [generate(llm, [PROMPTS[i]], [requests[k]])[0] for k, i in jobs]
        again = generate(llm, [PROMPTS[1]], [requests["mlx"]])[0]
        pool = runner_of(llm).adapters
        assert pool.list() == {1, 2} and pool.loads == 2
    tokens = {job: list(o.outputs[0].token_ids) for job, o in zip(jobs, mixed)}
    for (k, i), out in zip(jobs, mixed):
        check_against(refs[k], PROMPTS[i], out, f"{model_type} {k}")
    assert [list(o.outputs[0].token_ids) for o in solo] == list(tokens.values()), f"{model_type}: solo != mixed"
    for k in adapters:
        for i in range(len(PROMPTS)):
            assert tokens[(k, i)] != tokens[("base", i)], f"{model_type} {k}: the adapter changed nothing"
    assert again.num_cached_tokens >= 64 and list(again.outputs[0].token_ids) == tokens[("mlx", 1)]


@pytest.fixture(scope="module")
def llama(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-engine")
    variant = build("llama", root / "llama", model_dir)
    paths = [make_mlx_adapter(variant, root / f"a{i}", rank=8, scale=2.0, num_layers=3, seed=20 + i) for i in range(3)]
    paths.append(make_peft_adapter(variant, root / "rs", rank=8, alpha=4, use_rslora=True, seed=30,
                                   target_modules=("v_proj", "gate_proj"), rank_pattern={"gate_proj": 2}))
    refs = [reference_logprobs(variant, p) for p in paths[:3]]
    refs.append(reference_logprobs(merged_peft_model(variant, paths[3], root / "rs-merged")))
    return variant, paths, refs


@pytest.mark.parametrize("max_loras,max_cpu_loras", [(1, 1), (2, 3)])
def test_more_adapters_than_slots_each_output_unchanged(llama, max_loras, max_cpu_loras):
    """Four adapters and the base in one call, over fewer slots (--max-loras)
    and fewer loaded adapters (--max-cpu-loras): vLLM's scheduler admits
    --max-loras adapters per step, the worker swaps slots (repacks), evicts
    and reloads; every output is its reference's and its solo run's."""
    variant, paths, refs = llama
    requests = [None] + [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    prompt = PROMPTS[1]
    with engine(variant, **{**ENGINE, "max_loras": max_loras, "max_cpu_loras": max_cpu_loras}) as llm:
        together = generate(llm, [prompt] * len(requests), requests, prompt_logprobs=0)
        pool = runner_of(llm).adapters
        assert len(pool.list()) <= max_cpu_loras and pool.loads >= 4
        if max_loras > 1:
            assert pool.repacks >= 2  # two adapters shared steps, then others took their slots
        solo = [generate(llm, [prompt], [r])[0] for r in requests]
    for i, (out, ref) in enumerate(zip(together[1:], refs)):
        check_against(ref, prompt, out, f"adapter {i} beside others")  # a3: rsLoRA + rank_pattern
    assert [o.outputs[0].token_ids for o in solo] == [o.outputs[0].token_ids for o in together]
    assert len({tuple(o.outputs[0].token_ids) for o in together}) == len(requests)


def test_runtime_load_unload_pin_and_refusals_keep_serving(llama, tmp_path):
    variant, paths, refs = llama
    with engine(variant, **{**ENGINE, "max_cpu_loras": 3}) as llm:
        core = llm.llm_engine
        first = LoRARequest("first", 1, paths[0])
        assert core.add_lora(first) and core.list_loras() == {1}
        assert core.pin_lora(1)
        big = make_mlx_adapter(variant, tmp_path / "big", rank=16, num_layers=1)
        with pytest.raises(Exception, match="rank 16 is above --max-lora-rank 8"):
            core.add_lora(LoRARequest("big", 2, big))
        bad = tmp_path / "bad"
        bad.mkdir()
        (bad / "adapter_config.json").write_text('{"fine_tune_type": "full"}')
        with pytest.raises(Exception, match="a full fine-tune"):
            core.add_lora(LoRARequest("full", 3, str(bad)))
        assert core.list_loras() == {1}
        out = generate(llm, [PROMPTS[0]], [first], prompt_logprobs=0)[0]
        check_against(refs[0], PROMPTS[0], out, "after a refusal")
        assert core.remove_lora(1) and core.list_loras() == set()
        # A request naming an adapter not loaded loads it (vLLM's worker does the same).
        out = generate(llm, [PROMPTS[0]], [LoRARequest("again", 4, paths[1])], prompt_logprobs=0)[0]
        check_against(refs[1], PROMPTS[0], out, "loaded by its request")
        assert core.list_loras() == {4}
