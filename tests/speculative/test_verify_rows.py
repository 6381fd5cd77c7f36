"""A verified row is one varlen row of query length k + 1 in the step's
graph: its first position scores exactly what a plain decode step scores,
and the KV written for rejected drafts is dead -- the next step's row
starts over the first rejected position and never reads past its own
length (the stale slots are poisoned with NaN and the logits match a fresh
cache's, float64 log-softmax within 1e-3)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import GOLDEN

from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs
from vllm_metal.models.loader import load_model

BLOCK = 16


def log_softmax(logits) -> np.ndarray:
    x = np.array(logits).astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def step(m, kv, blocks, tokens, start):
    inputs = build_step_inputs([ScheduledRow(tokens, start, [blocks])], [BLOCK])
    logits = m.forward(kv, inputs, np.arange(len(tokens)))
    mx.eval(logits, kv.arrays())
    return log_softmax(logits)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, dequantize=True, fuse=True, norm_rope=True)


def test_rejected_drafts_kv_is_never_read(model):
    m = model
    prompt = GOLDEN[7]["prompt_ids"] + [GOLDEN[7]["greedy_ids"][0]]  # 110 tokens: position 112 opens block 7
    n = len(prompt)
    assert (n + 2) % BLOCK == 0
    blocks = list(range(1, 10))
    # Speculative: prefill, then a verified row [t1, d1, d2, d3] whose first draft is wrong.
    kv = m.allocate_kv(10, [BLOCK], [0] * m.num_layers)
    t1 = int(np.argmax(step(m, kv, blocks, prompt, 0)[-1]))
    wrong = [(t1 + 7) % 1000, 11, 12]
    verify = step(m, kv, blocks, [t1, *wrong], n)
    t2 = int(np.argmax(verify[0]))
    assert t2 != wrong[0]  # rejected: the next step starts over position n + 1
    for layer in range(m.num_layers):  # the stale slots (positions n + 2, n + 3: block 7) poisoned
        kv.keys[layer][blocks[(n + 2) // BLOCK]] = mx.nan
        kv.values[layer][blocks[(n + 2) // BLOCK]] = mx.nan
    after = step(m, kv, blocks, [t2], n + 1)
    assert np.isnan(np.array(kv.keys[0][blocks[(n + 2) // BLOCK]])).all()  # still poisoned when it was read
    # Plain: a fresh cache, the prompt and t1, then t2 alone.
    fresh = m.allocate_kv(10, [BLOCK], [0] * m.num_layers)
    plain_t2 = step(m, fresh, blocks, prompt + [t1], 0)[-1]
    plain_next = step(m, fresh, blocks, [t2], n + 1)
    assert np.isfinite(after).all()
    np.testing.assert_allclose(verify[0], plain_t2, atol=1e-3)  # a verify position scores as a decode step
    np.testing.assert_allclose(after, plain_next, atol=1e-3)
    assert int(np.argmax(after[-1])) == int(np.argmax(plain_next[-1]))
