"""Sharding with mlx-lm's own shard() (vllm_metal/distributed/tensor_parallel.py):
what is split, the local products equal the whole layer's slices, and the
refusals. The sums over ranks run in tests/distributed/test_engines.py."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from families import build

from vllm_metal.distributed.tensor_parallel import RowParallel, shard_model


def load(path):
    from mlx_lm.utils import load_model

    from pathlib import Path

    return load_model(Path(path), lazy=False)


def test_llama_shards_into_plain_linears_and_row_parallel_sums(model_dir, tmp_path):
    path = build("llama", tmp_path / "llama", model_dir)
    whole, config = load(path)
    x = mx.array(np.random.default_rng(0).standard_normal((3, config["hidden_size"])).astype(np.float32))
    layer = whole.model.layers[0]
    want_q = np.array(layer.self_attn.q_proj(x))
    want_down_in = np.random.default_rng(1).standard_normal((3, config["intermediate_size"])).astype(np.float32)
    want_down = np.array(layer.mlp.down_proj(mx.array(want_down_in)))
    parts, summed = [], []
    for rank in range(2):
        model, _ = load(path)
        calls = []
        done = shard_model(model, config, rank, 2, reduce=lambda y: calls.append(y) or y)
        assert done == 7 * config["num_hidden_layers"]  # q, k, v, o, gate, up, down in every layer
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert type(attn.q_proj) is nn.Linear and type(mlp.gate_proj) is nn.Linear  # fusable again
        assert isinstance(attn.o_proj, RowParallel) and isinstance(mlp.down_proj, RowParallel)
        assert (attn.n_heads, attn.n_kv_heads) == (2, 1)
        parts.append(np.array(attn.q_proj(x)))
        half = config["intermediate_size"] // 2
        summed.append(np.array(mlp.down_proj(mx.array(want_down_in[:, rank * half:(rank + 1) * half]))))
        assert len(calls) == 1  # the row-parallel product went through the group sum
    np.testing.assert_allclose(np.concatenate(parts, axis=1), want_q, atol=1e-5)  # each rank its heads
    np.testing.assert_allclose(summed[0] + summed[1], want_down, atol=1e-4)  # the sum over ranks is the layer


def test_refusals(model_dir, tmp_path):
    gemma = build("gemma", tmp_path / "gemma", model_dir)
    model, config = load(gemma)
    with pytest.raises(NotImplementedError, match="has no shard"):
        shard_model(model, config, 0, 2, reduce=None)
    llama = build("llama", tmp_path / "llama", model_dir)
    model, config = load(llama)
    with pytest.raises(ValueError, match=r"does not divide 'llama''s attention heads \(4\), KV heads \(2\)"):
        shard_model(model, config, 0, 3, reduce=None)
    moe = build("qwen3_moe", tmp_path / "qwen3_moe", model_dir)
    model, config = load(moe)
    with pytest.raises(NotImplementedError, match="their own collectives"):
        shard_model(model, config, 0, 2, reduce=None)
