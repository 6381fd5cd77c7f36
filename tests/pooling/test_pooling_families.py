"""Every served text family as an embedder (`--runner pooling --convert
embed`: vLLM's last-token pooling, normalized): one engine per family embeds
two prompts in 16-token chunks (vLLM's default chunked prefill), and each
vector matches mlx-lm's own forward of the same weights (the inner model's
final hidden state at the last token, float64 normalization): cosine >=
0.99999, max abs diff <= 1e-4. The pooling model carries no LM head and a
KV cache sized for prompts in flight (no --kv-cache-memory-bytes given)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import GOLDEN, engine, runner_of
from families import FAMILIES, build

from vllm.inputs import TokensPrompt

PROMPTS = [GOLDEN[-1]["prompt_ids"][100:141], GOLDEN[-1]["prompt_ids"][300:323]]


def reference(variant: str, prompt: list[int]) -> np.ndarray:
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(variant))
    model.set_dtype(mx.float32)
    inner = model.language_model.model if hasattr(model, "language_model") else model.model
    h = np.array(inner(mx.array(prompt)[None], cache=None)[0, -1].astype(mx.float32)).astype(np.float64)
    return h / np.linalg.norm(h)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_embeds(model_type, model_dir, tmp_path):
    variant = build(model_type, tmp_path / model_type, model_dir)
    with engine(variant, runner="pooling", convert="embed", max_model_len=512, max_num_batched_tokens=16,
                kv_cache_memory_bytes=None) as llm:
        runner = runner_of(llm)
        assert "lm_head" not in runner.mlx_model.model
        assert sum(a.nbytes for a in runner.kv.arrays()) < 64 << 20
        outs = llm.embed([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        got = np.array(out.outputs.embedding, np.float64)
        want = reference(variant, prompt)
        assert np.abs(got - want).max() <= 1e-4, model_type
        assert float(got @ want) >= 0.99999, model_type
