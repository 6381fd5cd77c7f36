"""Smoke test of tests/vlm_models.py: each builder writes a checkpoint and a
processor that load offline, the chat template renders the model's image
placeholders, one image expands to the documented number of tokens, and the
image changes transformers' output (the reference the VLM tests compare
against) from the image's first token on, never before it."""

from __future__ import annotations

import json

import numpy as np
import pytest

import vlm_models as vm

# model_type -> (architecture, image size (w, h), image tokens for it, placeholder text in the chat prompt)
CASES = {
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", (112, 84), 12,
                   "<|vision_start|><|image_pad|><|vision_end|>"),
    "gemma3": ("Gemma3ForConditionalGeneration", (80, 60), 4, "<start_of_image>"),
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", (128, 96), 12, "<|vision_start|><|image_pad|><|vision_end|>"),
}


def test_make_image_is_deterministic():
    a, b, c = vm.make_image(3, (40, 30)), vm.make_image(3, (40, 30)), vm.make_image(4, (40, 30))
    assert a.mode == "RGB" and a.size == (40, 30)
    assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize("model_type", list(CASES))
def test_builder(model_type, model_dir, tmp_path):
    arch, size, n_tokens, placeholder = CASES[model_type]
    out = vm.BUILDERS[model_type](tmp_path / model_type, model_dir, seed=0)
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (model_type, [arch])

    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(out))
    assert config["text_config"]["vocab_size"] == len(proc.tokenizer)
    assert proc.tokenizer.convert_ids_to_tokens(vm.image_token_id(out)) in ("<|image_pad|>", "<image_soft_token>")

    msgs = vm.messages("What is in the picture?", 2)
    assert vm.prompt_text(out, msgs).count(placeholder) == 2
    a, b, c = (vm.make_image(seed, size) for seed in (1, 2, 3))
    x, y = vm.hf_inputs(out, msgs, [a, b]), vm.hf_inputs(out, msgs, [a, c])
    ids = x["input_ids"][0].numpy()
    assert vm.placeholder_count(out, ids) == 2 * n_tokens
    assert np.array_equal(ids, y["input_ids"][0].numpy())

    lx, ly = vm.reference_logprobs(out, x), vm.reference_logprobs(out, y)
    assert lx.shape == (len(ids), len(proc.tokenizer)) and lx.dtype == np.float64
    assert np.allclose(np.exp(lx).sum(-1), 1.0)
    assert lx[-1].max() > np.log(1e-3)  # peaked, far from uniform (log 1/49k = -10.8)
    image = np.flatnonzero(ids == vm.image_token_id(out))
    second = image[n_tokens]  # the second image's first token: images differ from here on
    assert np.abs(lx[:second] - ly[:second]).max() < 1e-6
    assert np.abs(lx[-1] - ly[-1]).max() > 0.1

    # bare token ids (text only) give the same rows as the processor's input_ids alone
    text_ids = proc.tokenizer.encode("The quick brown fox")
    assert np.allclose(vm.reference_logprobs(out, text_ids),
                       vm.reference_logprobs(out, vm.hf_inputs(out, "The quick brown fox")), atol=1e-6)
