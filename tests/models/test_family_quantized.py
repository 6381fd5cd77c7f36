"""Every served family, MLX-quantized as mlx_lm.convert writes it, through the
plugin's paged path against mlx-lm's own quantized forward on the same file.

Each family runs one of the formats in `registry.QUANT_FORMATS` (4- and
8-bit, group sizes 32 / 64 / 128, mixed per-layer overrides with 8-bit
embeddings), so the matrix covers every format and every family. The model
is loaded as the CPU device serves it (weights expanded at load) and run by
`LoadedModel.forward`, the step the model runner evaluates: the prompt in
two chunks, then greedy decode steps. Checked in float32: prompt
log-probabilities within 1e-3 of mlx-lm's (float64 log-softmax), and every
greedy token mlx-lm's argmax by teacher forcing. (The engine around this
step is proven per family in float32 by test_family_parity.py.)
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import GOLDEN, paged_run
from families import FAMILIES, build, reference_logprobs

from vllm_metal.models.loader import load_model
from vllm_metal.models.registry import QUANT_FORMATS, SERVED, quant_format

PROMPT = GOLDEN[-1]["prompt_ids"][40:140]  # 100 tokens: two chunks, past every test window
NUM_TOKENS = 4
TOL = 1e-3


def test_matrix_covers_every_format():
    assert {quant_format(t) for t in SERVED} == set(QUANT_FORMATS)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_quantized_family_matches_mlx_lm(model_type, model_dir, tmp_path):
    bits, group_size, mixed = quant_format(model_type)
    variant = build(model_type, tmp_path / model_type, model_dir, bits=bits, group_size=group_size, mixed=mixed)
    loaded = load_model(variant, dtype="float32", dequantize=True)
    got, tokens = paged_run(loaded, PROMPT, NUM_TOKENS)
    ref = reference_logprobs(variant)(PROMPT + tokens[:-1])
    np.testing.assert_allclose(got[: len(PROMPT) - 1][np.arange(len(PROMPT) - 1), PROMPT[1:]],
                               ref[np.arange(len(PROMPT) - 1), PROMPT[1:]], atol=TOL,
                               err_msg=f"{model_type} {bits}-bit g{group_size}: prompt log-probabilities")
    chosen = ref[len(PROMPT) - 1:][np.arange(NUM_TOKENS), tokens]
    assert (chosen >= ref[len(PROMPT) - 1:].max(axis=1) - TOL).all(), f"{model_type}: a token is not mlx-lm's argmax"


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_latent_attention_kept_quantized(model_type, model_dir, tmp_path):
    # As Metal serves it: weights stay MLX-quantized. deepseek_v2's kv_b_proj
    # is a QuantizedLinear that mla.py expands once to absorb it; deepseek_v3's
    # embed_q / unembed_out are mlx-lm's QuantizedMultiLinear, run as they are.
    variant = build(model_type, tmp_path / model_type, model_dir, bits=4, group_size=32)
    loaded = load_model(variant, dtype="float32", dequantize=False)
    assert loaded.quantized
    got, tokens = paged_run(loaded, PROMPT, NUM_TOKENS)
    ref = reference_logprobs(variant)(PROMPT + tokens[:-1])
    rows = np.arange(len(PROMPT) - 1)
    np.testing.assert_allclose(got[rows, PROMPT[1:]], ref[rows, PROMPT[1:]], atol=TOL)
    chosen = ref[len(PROMPT) - 1:][np.arange(NUM_TOKENS), tokens]
    assert (chosen >= ref[len(PROMPT) - 1:].max(axis=1) - TOL).all()
