"""Qwen3.5 beyond the parity matrix (test_family_parity.py proves its text
architectures, `Qwen3_5ForCausalLM` and `Qwen3_5MoeForCausalLM`):

- vLLM resolves both text architectures (its qwen3_5 module imports its
  vision sibling, which needs the torchvision the set-up installs), its
  layer types agreeing with the layers mlx-lm builds;
- the multimodal architecture Qwen3.5 checkpoints ship
  (`Qwen3_5ForConditionalGeneration`, M-RoPE sections in its rope
  parameters) is refused unless served text-only (vllm-metal runs no vision
  encoder), and text-only it matches mlx-lm's forward, also through
  `vllm serve` with vLLM's defaults (no flags: the doctor names none).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from engine_helpers import GOLDEN, engine
from families import build, reference_logprobs

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

LONG = GOLDEN[-1]["prompt_ids"]
TOL = 1e-3


@pytest.mark.parametrize("model_type,arch", [("qwen3_5", "Qwen3_5ForCausalLM"),
                                             ("qwen3_5_moe", "Qwen3_5MoeForCausalLM")])
def test_text_architectures_resolve(model_type, arch, model_dir, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_metal.models.loader import load_model

    variant = build(model_type, tmp_path / model_type, model_dir)
    config = EngineArgs(model=variant, dtype="float32", max_model_len=512).create_engine_config().model_config
    assert config.architecture == arch and config.is_hybrid and not config.is_multimodal_model
    assert config.get_vocab_size() == json.loads((tmp_path / model_type / "config.json").read_text())[
        "text_config"]["vocab_size"]
    loaded = load_model(variant, materialize=False)
    kinds = ["linear_attention" if kv.layout == "state" else "full_attention" for kv in loaded.layer_kv]
    assert config.hf_text_config.layer_types == kinds


@pytest.fixture(scope="module")
def multimodal_dir(model_dir, tmp_path_factory):
    """The dense parity model as Qwen3.5 checkpoints declare it: the
    multimodal architecture, interleaved M-RoPE sections (text-only, every
    section sees the same position: plain RoPE, as mlx-lm computes it)."""
    out = tmp_path_factory.mktemp("qwen3_5_vl") / "qwen3_5"
    build("qwen3_5", out, model_dir)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = ["Qwen3_5ForConditionalGeneration"]
    config["text_config"]["rope_parameters"].update(mrope_section=[1, 1, 0], mrope_interleaved=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return str(out)


def test_multimodal_architecture_serves_its_text_model_unless_media_are_asked_for(multimodal_dir):
    from vllm.engine.arg_utils import EngineArgs

    common = dict(model=multimodal_dir, dtype="float32", max_model_len=512)
    with pytest.raises(ValueError, match=r"Qwen3_5ForConditionalGeneration.*--language-model-only"):
        EngineArgs(**common, limit_mm_per_prompt={"image": 2}).create_engine_config()  # media asked for
    with pytest.raises(ValueError, match="runs no vision or audio encoder"):  # a video asked for
        EngineArgs(**common, limit_mm_per_prompt={"image": 0, "video": 1}).create_engine_config()
    # vLLM's defaults (no choice made) or no media asked for: the text model, media refused per request.
    for text_only in (dict(), dict(language_model_only=True), dict(limit_mm_per_prompt={"image": 0, "video": 0}),
                      dict(limit_mm_per_prompt={"image": 0})):
        config = EngineArgs(**common, **text_only).create_engine_config().model_config
        assert config.is_hybrid and not config.supports_multimodal_inputs


def test_doctor_says_a_qwen3_5_checkpoint_is_served_without_flags(multimodal_dir):
    from vllm_metal.doctor.capabilities import model_check

    report = model_check(multimodal_dir)
    assert report["served"] and report["flags"] == []
    assert "multimodal checkpoint" in report["reason"]


def test_multimodal_architecture_served_text_only_matches_mlx_lm(multimodal_dir):
    prompts = [LONG[:20], LONG[100:190]]
    ref = reference_logprobs(multimodal_dir)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    with engine(multimodal_dir, max_model_len=512, kv_cache_memory_bytes=16 << 20,
                max_num_batched_tokens=64) as llm:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens = list(out.outputs[0].token_ids)
        lp = ref(prompt + tokens[:-1])
        rows = lp[len(prompt) - 1:]
        assert (rows[np.arange(len(tokens)), tokens] >= rows.max(axis=1) - TOL).all()
        got = np.array([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
        np.testing.assert_allclose(got, lp[np.arange(len(prompt) - 1), prompt[1:]], atol=TOL)


@pytest.mark.slow
def test_vllm_serve_qwen3_5_checkpoint_with_defaults(multimodal_dir, tmp_path):
    """`vllm serve` on a Qwen3.5 checkpoint with vLLM's defaults (prefix
    caching on, multimodal inputs not limited: its text model is served):
    two concurrent completions over HTTP (continuous batching of a hybrid
    through the OpenAI server) give mlx-lm's greedy tokens, judged by teacher
    forcing, with the fused gated-delta recurrence; the second prompt asked
    again resumes from its cached state (the usage reports the cached tokens:
    128, two of the 64-token blocks the platform picks for this model) with
    the same tokens; a chat message with an image is refused (400), and the
    server goes on."""
    import base64
    import io
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from PIL import Image
    from server_helpers import SERVED_NAME, vllm_server

    from vllm_metal.doctor.capabilities import model_check

    assert model_check(multimodal_dir)["flags"] == []
    prompts = [LONG[:30], LONG[200:340]]
    ref = reference_logprobs(multimodal_dir)
    png = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(png, format="PNG")
    image_url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    with vllm_server(multimodal_dir, "--enable-prompt-tokens-details", log_path=tmp_path / "serve.log") as (base, _):
        def complete(prompt):
            r = httpx.post(base + "/v1/completions", timeout=120, json=dict(
                model=SERVED_NAME, prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True, logprobs=0,
                return_tokens_as_token_ids=True))
            r.raise_for_status()
            return r.json()

        refused = httpx.post(base + "/v1/chat/completions", timeout=120, json=dict(
            model=SERVED_NAME, max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": image_url}}]}]))
        assert refused.status_code == 400 and "At most 0 image(s)" in refused.text, refused.text
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(complete, prompts))
        again = complete(prompts[1])
    choices = [a["choices"][0] for a in answers]
    assert (answers[1]["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 128
    assert again["choices"][0]["logprobs"]["tokens"] == choices[1]["logprobs"]["tokens"]
    for prompt, choice in zip(prompts, choices):
        tokens = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
        assert len(tokens) == 8
        rows = ref(prompt + tokens[:-1])[len(prompt) - 1:]
        assert (rows[np.arange(len(tokens)), tokens] >= rows.max(axis=1) - TOL).all()
