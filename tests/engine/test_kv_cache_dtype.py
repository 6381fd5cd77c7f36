"""`--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2 | fp8_per_token_head`: 8-bit float KV caches.

Quality on the embedded model (real weights): next-token distributions over
a 571-token prompt with the 8-bit cache against the model-dtype cache, KL
divergence and top-1 agreement within the bounds docs/checkpoints.md states
(benchmarks/kv_cache_quality.py measures them on 2k-token contexts). The
engine: the cache is uint8 and holds 4x the blocks of a float32 cache (2x a
16-bit one) in the same --kv-cache-memory-bytes; greedy answers agree; what
cannot be served is refused naming the alternative.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import GOLDEN, engine, greedy, paged_run, runner_of

from vllm_metal.models.loader import load_model

# (mean KL nats, top-1 agreement) bounds per format on the embedded model.
BOUNDS = {"fp8_e4m3": (0.02, 0.97), "fp8_e5m2": (0.05, 0.95), "fp8_per_token_head": (0.01, 0.97)}


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(model_dir, dtype="float32", dequantize=True)


@pytest.mark.parametrize("fmt", sorted(BOUNDS))
def test_next_token_distributions_stay_close(loaded, fmt):
    prompt = GOLDEN[-1]["prompt_ids"]
    base, base_tokens = paged_run(loaded, prompt, 4)
    got, tokens = paged_run(loaded, prompt, 4, kv_cache_dtype=fmt)
    kl = (np.exp(base) * (base - got)).sum(axis=-1)
    top1 = (base.argmax(-1) == got.argmax(-1)).mean()
    max_kl, min_top1 = BOUNDS[fmt]
    assert 0 < kl.mean() < max_kl and top1 >= min_top1, (kl.mean(), top1)  # 8-bit for real, and close
    assert tokens == base_tokens


def _blocks_and_answers(model_dir, dtype, kv_cache_dtype, prompts):
    with engine(model_dir, dtype=dtype, max_model_len=1024, kv_cache_memory_bytes=64 << 20,
                kv_cache_dtype=kv_cache_dtype) as llm:
        kv = runner_of(llm).kv
        tokens, _ = greedy(llm, prompts, 8)
        return kv.keys[0].shape[0], str(kv.keys[0].dtype), tokens


def test_engine_holds_more_blocks_and_agrees(model_dir):
    prompts = [g["prompt_ids"] for g in GOLDEN]
    blocks, dtype, want = _blocks_and_answers(model_dir, "float32", "auto", prompts)
    fp8_blocks, fp8_dtype, got = _blocks_and_answers(model_dir, "float32", "fp8", prompts)
    assert (dtype, fp8_dtype) == ("mlx.core.float32", "mlx.core.uint8")
    assert abs(fp8_blocks / blocks - 4) < 0.05  # a float32 cache: 4 bytes -> 1
    agree = [a[:4] == b[:4] for a, b in zip(got, want)]
    assert sum(agree) >= len(prompts) - 1, agree
    half, _, _ = _blocks_and_answers(model_dir, "bfloat16", "auto", prompts[:1])
    half_fp8, _, _ = _blocks_and_answers(model_dir, "bfloat16", "fp8_e5m2", prompts[:1])
    assert abs(half_fp8 / half - 2) < 0.05  # a 16-bit cache (Metal's dtypes): twice the blocks
    rows, row_dtype, row_answers = _blocks_and_answers(model_dir, "float32", "fp8_per_token_head", prompts)
    assert row_dtype == "mlx.core.uint8" and abs(rows / blocks - 4 * 64 / 68) < 0.05  # 64 codes + a 4-byte scale
    assert sum(a[:4] == b[:4] for a, b in zip(row_answers, want)) >= len(prompts) - 1


def test_refusals(model_dir, tmp_path):
    from families import build

    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(Exception, match="int8_per_token_head.*fp8 \\(= fp8_e4m3\\), fp8_e5m2 or fp8_per_token_head"):
        EngineArgs(model=model_dir, kv_cache_dtype="int8_per_token_head").create_engine_config()
    with pytest.raises(Exception, match="kv_cache_dtype=\"float16\" is incompatible with dtype=\"float32\""):
        EngineArgs(model=model_dir, dtype="float32", kv_cache_dtype="float16").create_engine_config()
    mla = build("deepseek_v2", tmp_path / "mla", model_dir)
    loaded = load_model(mla)
    with pytest.raises(NotImplementedError, match="latent attention \\(MLA\\) keeps its cache in the model dtype"):
        loaded.allocate_kv(8, [16], [0] * loaded.num_layers, kv_cache_dtype="fp8")
