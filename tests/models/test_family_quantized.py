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
from engine_helpers import GOLDEN
from families import FAMILIES, build, reference_logprobs

from vllm_metal.models.loader import load_model
from vllm_metal.models.registry import QUANT_FORMATS, SERVED, quant_format
from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs

PROMPT = GOLDEN[-1]["prompt_ids"][40:140]  # 100 tokens: two chunks, past every test window
CHUNK = 64
BLOCK = 16
NUM_TOKENS = 4
TOL = 1e-3


def paged_run(loaded, prompt: list[int], num_tokens: int) -> tuple[np.ndarray, list[int]]:
    """Log-softmax rows (float64) for prompt[1:] and each greedy token, and the tokens."""
    windows = sorted(set(loaded.sliding_windows), key=lambda w: w or 0)
    layer_group = [windows.index(w) for w in loaded.sliding_windows]
    block_sizes = [BLOCK] * len(windows)
    kv = loaded.allocate_kv(1 + (len(prompt) + num_tokens) // BLOCK + 1, block_sizes, layer_group)
    blocks = list(range(1, kv.keys[0].shape[0]))  # block 0 stays the null block
    rows, tokens, done = [], [], 0
    sequence = list(prompt)
    while len(tokens) < num_tokens:
        new = sequence[done:done + CHUNK]
        inputs = build_step_inputs([ScheduledRow(new, done, [blocks] * len(windows))], block_sizes)
        logits = loaded.forward(kv, inputs, np.arange(len(new)))
        mx.eval(logits, kv.keys, kv.values)
        lp = np.array(logits).astype(np.float64)
        lp -= lp.max(axis=-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(axis=-1, keepdims=True))
        done += len(new)
        if done < len(sequence):  # a chunk of the prompt: every row predicts the next prompt token
            rows.append(lp)
            continue
        rows.append(lp if len(new) > 1 else lp[-1:])
        tokens.append(int(np.argmax(lp[-1])))
        sequence.append(tokens[-1])
    return np.concatenate(rows)[: len(prompt) - 1 + num_tokens], tokens


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
