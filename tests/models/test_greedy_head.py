"""LoadedModel.greedy_tokens: a greedy step's tokens in the graph. Where the
family's logits are exactly hidden @ W^T (a tied embedding or a bias-free
lm_head) they come from the ArgmaxHead primitive; where the family scales or
softcaps its logits (gemma2's final softcap, cohere's logit_scale) or the
head is MLX-quantized, from argmax of the family's own logits. Either way:
the argmax of mlx-lm's own logits for the same hidden rows."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from families import build

from vllm_metal.models.loader import load_model
from vllm_metal.native import greedy_head

# family -> whether its head is a plain matrix
CASES = {"llama": True, "mistral": True, "gemma2": False, "cohere": False}


@pytest.mark.parametrize("family", sorted(CASES))
def test_greedy_tokens_are_the_argmax_of_the_familys_logits(tmp_path, model_dir, family):
    loaded = load_model(build(family, tmp_path / family, model_dir), dtype="float32", dequantize=True)
    w = loaded.greedy_head()
    assert (w is not None) is CASES[family], family
    # A plain head gets its bfloat16 screen where the CPU runs that kernel (native/greedy_head.py).
    assert (loaded._head_screen is not None) == (CASES[family] and greedy_head.screen_available())
    before = greedy_head.screen_counters()["rows"]
    rng = np.random.default_rng(0)
    for rows in (3, 8, 40):  # below and above the primitive's row threshold
        hidden = mx.array(rng.standard_normal((rows, int(loaded.config.get("hidden_size", 64)))).astype(np.float32))
        want = np.argmax(np.array(loaded.logits(hidden), np.float64), axis=1)
        np.testing.assert_array_equal(np.array(loaded.greedy_tokens(hidden)), want)
        np.testing.assert_array_equal(np.array(loaded.greedy_tokens(hidden, fused_head=False)), want)
    screen = loaded._head_screen
    limit = screen.max_rows if screen is not None and screen.max_rows is not None else 40
    assert greedy_head.screen_counters()["rows"] - before == \
        (sum(r for r in (3, 8, 40) if r <= limit) if screen is not None else 0)


def test_a_quantized_head_is_not_plain(tmp_path, model_dir):
    loaded = load_model(build("llama", tmp_path / "q", model_dir, bits=4), dtype="float32", dequantize=False)
    assert loaded.quantized and loaded.greedy_head() is None
    hidden = mx.array(np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32))
    want = np.argmax(np.array(loaded.logits(hidden), np.float64), axis=1)
    np.testing.assert_array_equal(np.array(loaded.greedy_tokens(hidden)), want)
