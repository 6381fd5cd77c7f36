"""Images in, text out, for every family multimodal/registry.py serves:
tiny random-weight checkpoints built by transformers' own classes
(tests/vlm_models.py), served through vLLM's multimodal pipeline on one
engine per family (32-token chunks: an image is split across steps where
the family allows it), against transformers' float32 forward on the same
weights and the same processed inputs.

- one and two images (of different sizes) per prompt: the prompt ids are
  transformers' processor's, prompt log-probabilities within 1e-3, every
  greedy token transformers' argmax by teacher forcing; another image
  changes the answer (the test can fail);
- image prompts batched with a text-only prompt == each alone;
- the same image again is not encoded again (vLLM's encoder cache, counted
  by the runner) and its prompt hits the prefix cache past the image with
  the same tokens; the same text with another image does not hit it there;
- Gemma 3's image tokens attend to their whole image (transformers'
  reference with causal image attention differs, ours does not);
- a tower tensor missing or of the wrong shape refuses the checkpoint,
  naming it; other modalities asked for are refused at start.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import vlm_models as vm
from engine_helpers import engine, runner_of

from vllm import SamplingParams

TOL = 1e-3
FAMILIES = ["qwen2_5_vl", "gemma3", "qwen3_5"]
# (width, height) per family: sizes its processor keeps distinct (Gemma 3 resizes every image to 56x56)
SIZES = {"qwen2_5_vl": [(112, 84), (56, 56)], "gemma3": [(80, 60), (56, 56)], "qwen3_5": [(128, 96), (64, 64)]}


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, model_dir, tmp_path_factory):
    family = request.param
    out = vm.BUILDERS[family](tmp_path_factory.mktemp("vlm") / family, model_dir)
    with engine(str(out), max_model_len=1024, kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=32,
                max_num_seqs=8) as llm:
        yield family, out, llm


def _request(model_dir, n_images: int, images, text: str = "Describe the pictures."):
    return {"prompt": vm.prompt_text(model_dir, vm.messages(text, n_images)), "multi_modal_data": {"image": images}}


def _extended(inputs: dict, tokens: list[int]) -> dict:
    """transformers' inputs with `tokens` appended as text."""
    out = dict(inputs)
    extra = torch.tensor([tokens], dtype=inputs["input_ids"].dtype)
    out["input_ids"] = torch.cat([inputs["input_ids"], extra], 1)
    for key in ("attention_mask", "token_type_ids", "mm_token_type_ids"):
        if key in inputs:
            fill = torch.ones_like(extra) if key == "attention_mask" else torch.zeros_like(extra)
            out[key] = torch.cat([inputs[key], fill.to(inputs[key].dtype)], 1)
    return out


def _check_against_transformers(model_dir, out, inputs):
    ids = inputs["input_ids"][0].tolist()
    assert list(out.prompt_token_ids) == ids  # vLLM's processor == transformers'
    tokens = list(out.outputs[0].token_ids)
    ref = vm.reference_logprobs(model_dir, _extended(inputs, tokens[:-1]))
    got = np.array([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    want = ref[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(got, want, atol=TOL)
    rows = ref[len(ids) - 1:]
    chosen = rows[np.arange(len(tokens)), tokens]
    assert (chosen >= rows.max(axis=1) - TOL).all(), "a greedy token is not transformers' argmax"
    return got


def test_images_match_transformers(served):
    family, model_dir, llm = served
    a, b = SIZES[family]
    one, two = [vm.make_image(1, a)], [vm.make_image(2, a), vm.make_image(3, b)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([_request(model_dir, 1, one), _request(model_dir, 2, two)], params, use_tqdm=False)
    for images, out in zip((one, two), outs):
        inputs = vm.hf_inputs(model_dir, vm.messages("Describe the pictures.", len(images)), images)
        _check_against_transformers(model_dir, out, inputs)
    other = llm.generate(_request(model_dir, 1, [vm.make_image(9, a)]), params, use_tqdm=False)[0]
    mine = [lp[t].logprob for lp, t in zip(outs[0].prompt_logprobs[1:], outs[0].prompt_token_ids[1:])]
    theirs = [lp[t].logprob for lp, t in zip(other.prompt_logprobs[1:], other.prompt_token_ids[1:])]
    assert np.abs(np.array(mine) - np.array(theirs)).max() > 0.05, "the image changes nothing"


def test_gemma3_images_attend_both_ways(served):
    family, model_dir, llm = served
    if family != "gemma3":
        pytest.skip("Gemma 3's prefix-LM images")
    images = [vm.make_image(4, SIZES[family][0])]
    inputs = vm.hf_inputs(model_dir, vm.messages("Describe the pictures.", 1), images)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate(_request(model_dir, 1, images), params, use_tqdm=False)[0]
    got = _check_against_transformers(model_dir, out, inputs)
    causal = dict(inputs, token_type_ids=torch.zeros_like(inputs["token_type_ids"]))
    if "mm_token_type_ids" in causal:
        causal["mm_token_type_ids"] = torch.zeros_like(causal["mm_token_type_ids"])
    ids = inputs["input_ids"][0].tolist()
    one_way = vm.reference_logprobs(model_dir, causal)[np.arange(len(ids) - 1), ids[1:]]
    assert np.abs(one_way - got).max() > 0.01, "causal image attention would pass too"


def test_batched_with_text_equals_solo(served):
    family, model_dir, llm = served
    a, b = SIZES[family]
    requests = [_request(model_dir, 1, [vm.make_image(5, a)]),
                {"prompt": vm.prompt_text(model_dir, [{"role": "user", "content": "Write a short poem."}])},
                _request(model_dir, 2, [vm.make_image(6, b), vm.make_image(7, a)], "Compare them.")]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    batched = llm.generate(requests, params, use_tqdm=False)
    solo = [llm.generate(r, params, use_tqdm=False)[0] for r in requests]
    for x, y in zip(batched, solo):
        assert list(x.outputs[0].token_ids) == list(y.outputs[0].token_ids)
        lx = [lp[t].logprob for lp, t in zip(x.outputs[0].logprobs, x.outputs[0].token_ids)]
        ly = [lp[t].logprob for lp, t in zip(y.outputs[0].logprobs, y.outputs[0].token_ids)]
        np.testing.assert_allclose(lx, ly, atol=1e-4)


def test_same_image_hits_encoder_and_prefix_cache(served):
    family, model_dir, llm = served
    runner = runner_of(llm)
    tower = sum(v.nbytes for v in runner.multimodal.vision.tower.w.values())
    assert tower > 0 and runner.weights_bytes() == runner.mlx_model.weights_bytes + tower  # in the memory budget
    image = vm.make_image(11, SIZES[family][0])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # past a block after the image (hybrids cache whole 64-token blocks)
    text = "What is this? " + "Name every colour you see in it, one by one, and say where it is. " * 8
    before = runner.multimodal.encoded
    first = llm.generate(_request(model_dir, 1, [image], text), params, use_tqdm=False)[0]
    assert runner.multimodal.encoded == before + 1
    again = llm.generate(_request(model_dir, 1, [image], text), params, use_tqdm=False)[0]
    assert runner.multimodal.encoded == before + 1, "the same image was encoded again"
    at = np.nonzero(np.array(first.prompt_token_ids) == vm.image_token_id(model_dir))[0]
    end = int(at[-1]) + 1
    assert again.num_cached_tokens >= end, "the prefix cache stopped before the image's end"
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    other = llm.generate(_request(model_dir, 1, [vm.make_image(12, SIZES[family][0])], text), params,
                         use_tqdm=False)[0]
    assert runner.multimodal.encoded == before + 2
    assert other.num_cached_tokens <= int(at[0]), "another image reused the first image's cached blocks"


def test_a_bad_tower_tensor_is_refused_by_name(model_dir, tmp_path):
    import json

    import mlx.core as mx

    from vllm_metal.multimodal.registry import load_vision

    out = vm.build_qwen2_5_vl(tmp_path / "q", model_dir)
    config = json.loads((out / "config.json").read_text())
    weights = mx.load(str(out / "model.safetensors"))
    name = next(k for k in weights if k.endswith("blocks.1.attn.qkv.weight"))
    mx.save_safetensors(str(out / "model.safetensors"), {**weights, name: weights[name][:-1]})
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.qkv\.weight.*shape"):
        load_vision(out, config, mx.float32)
    del weights[name]
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    with pytest.raises(KeyError, match=r"blocks\.1\.attn\.qkv\.weight.*missing"):
        load_vision(out, config, mx.float32)


def test_other_modalities_are_refused_at_start(model_dir, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    out = vm.build_qwen2_5_vl(tmp_path / "q", model_dir)
    common = dict(model=str(out), dtype="float32", max_model_len=512)
    with pytest.raises(ValueError, match=r"not video.*--limit-mm-per-prompt"):
        EngineArgs(**common, limit_mm_per_prompt={"image": 2, "video": 1}).create_engine_config()
    mm = EngineArgs(**common).create_engine_config().model_config.multimodal_config
    assert mm.get_limit_per_prompt("image") > 0 and mm.get_limit_per_prompt("video") == 0
    config = EngineArgs(**common, language_model_only=True).create_engine_config().model_config
    assert not config.supports_multimodal_inputs  # served text-only, as asked
    # images run with the generate runner on one rank: otherwise the text model, images refused if asked for
    for text_only in (dict(runner="pooling"), dict(tensor_parallel_size=2)):
        assert not EngineArgs(**common, **text_only).create_engine_config().model_config.supports_multimodal_inputs
    with pytest.raises(ValueError, match="one rank.*--language-model-only"):
        EngineArgs(**common, tensor_parallel_size=2, limit_mm_per_prompt={"image": 1}).create_engine_config()


def test_docs_table_is_generated_from_the_registry():
    from pathlib import Path

    from vllm_metal.multimodal.registry import markdown_table

    text = (Path(__file__).parents[2] / "docs" / "models.md").read_text()
    block = text.split("<!-- multimodal-models:begin (generated) -->")[1].split("<!-- multimodal-models:end -->")[0]
    assert block.strip() == markdown_table(), "regenerate: python -m vllm_metal.multimodal.registry"


def test_doctor_reports_the_vision_path(model_dir, tmp_path):
    from vllm_metal.doctor.capabilities import model_check

    out = vm.build_gemma3(tmp_path / "g", model_dir)
    report = model_check(str(out))
    assert report["served"] and "images served" in report["reason"] and "SigLIP" in report["reason"]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_the_published_checkpoints_layout_serves_the_same(family, model_dir, tmp_path):
    """Released checkpoints were saved by transformers 4.4x (Qwen2.5-VL's text
    fields at the top of config.json, `visual.*` / `model.layers.*`; Gemma 3's
    `vision_tower.vision_model.*`): the same weights in that layout answer
    the same."""
    built = vm.BUILDERS[family](tmp_path / family, model_dir)
    published = vm.published_layout(built, tmp_path / f"{family}-published")
    images = [vm.make_image(21, SIZES[family][0])]
    inputs = vm.hf_inputs(built, vm.messages("Describe the pictures.", 1), images)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    with engine(str(published), max_model_len=1024, kv_cache_memory_bytes=32 << 20) as llm:
        out = llm.generate(_request(published, 1, images), params, use_tqdm=False)[0]
    _check_against_transformers(built, out, inputs)
