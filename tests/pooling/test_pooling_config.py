"""What --runner pooling may be combined with (pooling/serving_config.py),
how a checkpoint resolves to a pooler (pooling/heads.py) and how the doctor
describes it (pooling/checkpoint.py): refusals name the problem and the
alternative; the catalogue of pooling checkpoints that cannot be served."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

import pooling_models as pm
from vllm.engine.arg_utils import EngineArgs
from vllm_metal.pooling.checkpoint import describe
from vllm_metal.pooling.heads import PoolingModelError, build_pooler, pooling_kind
from vllm_metal.pooling.serving_config import pooling_kv_budget
from vllm_metal.pooling.step import token_type_ids


@pytest.fixture(scope="module")
def bert_cls(tmp_path_factory):
    return pm.build_encoder(tmp_path_factory.mktemp("b") / "m", "bert", "classify", num_labels=2)[0]


@pytest.fixture(scope="module")
def qwen_embed(tmp_path_factory, model_dir):
    return pm.build_qwen3(tmp_path_factory.mktemp("q") / "m", model_dir, "embed")[0]


def config(path, **kwargs):
    args = dict(model=path, runner="pooling", max_model_len=64)
    args.update(kwargs)
    return EngineArgs(**args).create_engine_config()


@pytest.mark.parametrize("extra,words", [
    (dict(tensor_parallel_size=2), "serves pooling models on one rank"),
    (dict(pipeline_parallel_size=2), "serves pooling models on one rank"),
    (dict(enable_lora=True), "--enable-lora with --runner pooling is refused"),
    (dict(kv_transfer_config={"kv_connector": "MetalDiskConnector", "kv_role": "kv_both",
                              "kv_connector_module_path": "vllm_metal.kv.disk_connector"}),
     "drop --kv-transfer-config"),
])
def test_refused_combinations(qwen_embed, extra, words):
    with pytest.raises(Exception, match=words):
        config(qwen_embed, **extra)


def test_pooling_defaults_kept(qwen_embed, bert_cls):
    """vLLM's defaults stand: chunked prefill and prefix caching for a causal
    last-token embedder, neither for an encoder (vLLM turns them off)."""
    dec, enc = config(qwen_embed), config(bert_cls, max_model_len=128)
    assert dec.scheduler_config.enable_chunked_prefill and dec.cache_config.enable_prefix_caching
    assert not enc.scheduler_config.enable_chunked_prefill and not enc.cache_config.enable_prefix_caching


def test_kv_budget_covers_prompts_in_flight(qwen_embed):
    c = config(qwen_embed, max_num_batched_tokens=512, max_num_seqs=8)
    per_token = 1000.0
    budget = pooling_kv_budget(c, per_token)
    tokens = 512 + 64 + 8 * c.cache_config.block_size
    assert budget == tokens * per_token
    assert budget / per_token >= c.model_config.max_model_len  # one whole prompt always fits


@pytest.mark.parametrize("convert,arch,kind", [
    ("embed", "Qwen3ForCausalLM", "embed"), ("classify", "Qwen3ForCausalLM", "classify"),
    ("none", "BertModel", "embed"), ("none", "XLMRobertaForSequenceClassification", "classify"),
    ("none", "Qwen3ForCausalLM", "embed"),
])
def test_pooling_kind(convert, arch, kind):
    assert pooling_kind(SimpleNamespace(convert_type=convert, architectures=[arch])) == kind


@pytest.mark.parametrize("arch", ["BertForTokenClassification", "ColBERTModernBertModel", "BgeM3EmbeddingModel",
                                  "BertSpladeSparseEmbeddingModel", "XLMRobertaForMaskedLM"])
def test_special_heads_refused(arch):
    with pytest.raises(PoolingModelError, match=f"cannot serve {arch} with --runner pooling"):
        pooling_kind(SimpleNamespace(convert_type="none", architectures=[arch]))


def test_missing_classifier_refused(bert_cls):
    c = config(bert_cls, max_model_len=128)
    weights = {"pooler.dense.weight": np.eye(64, dtype=np.float32), "pooler.dense.bias": np.zeros(64, np.float32)}
    with pytest.raises(PoolingModelError, match="has no classifier.weight"):
        build_pooler(c, "classify", "bert", weights)


def test_decoder_classifier_without_score_refused(qwen_embed):
    c = config(qwen_embed, convert="classify")
    with pytest.raises(PoolingModelError, match="has no score.weight"):
        build_pooler(c, "classify", "qwen3", {})


@pytest.mark.parametrize("overrides,words", [
    ({"classifier_from_token": ["zz-not-a-token-zz", "yes"], "method": "from_2_way_softmax"},
     "are not tokens of the tokenizer"),
])
def test_bad_classifier_from_token(qwen_embed, overrides, words):
    c = config(qwen_embed, convert="classify", hf_overrides=overrides)
    with pytest.raises(PoolingModelError, match=words):
        build_pooler(c, "classify", "qwen3", {}, head_rows=lambda ids: np.ones((len(ids), 64), np.float32))


def test_token_types_from_vllm_compressed_form():
    from vllm.pooling_params import PoolingParams

    params = PoolingParams(task="classify", extra_kwargs={"compressed_token_type_ids": (4, 9)})
    np.testing.assert_array_equal(token_type_ids(params, np.arange(11)), [0] * 4 + [1] * 5 + [0] * 2)
    assert token_type_ids(PoolingParams(task="classify"), np.arange(3)) is None


# ---- what the doctor says -------------------------------------------------

def test_describe(tmp_path, bert_cls, qwen_embed):
    assert describe(bert_cls) | {"how": ""} == {"kind": "classify", "served": True, "encoder": True, "how": "",
                                                 "made_for_pooling": True}
    d = describe(qwen_embed)
    assert d["kind"] == "embed" and d["served"] and "sentence-transformers pooling last, normalized" in d["how"]
    special = tmp_path / "s"
    special.mkdir()
    (special / "config.json").write_text(json.dumps({"model_type": "bert",
                                                     "architectures": ["BertForTokenClassification"]}))
    assert not describe(special)["served"] and "not served" in describe(special)["how"]


def test_doctor_model_check(bert_cls, qwen_embed, tmp_path):
    from vllm_metal.doctor.capabilities import model_check

    enc = model_check(bert_cls)
    assert enc["served"] and enc["flags"] == ["--runner pooling"] and "an encoder (bert" in enc["reason"]
    dec = model_check(qwen_embed)
    assert dec["served"] and dec["pooling"]["served"]
    bad = Path(pm.build_encoder(tmp_path / "r", "bert")[0])
    cfg = json.loads((bad / "config.json").read_text())
    cfg["position_embedding_type"] = "relative_key"
    (bad / "config.json").write_text(json.dumps(cfg))
    refused = model_check(str(bad))
    assert not refused["served"] and "position_embedding_type 'relative_key'" in refused["reason"]


def test_head_rows_of_tied_and_quantized_embeddings(qwen_embed):
    """The LM-head rows a reranker's score is built from: the tied input
    embedding, dequantized where it is MLX-quantized."""
    from vllm_metal.models.loader import load_model

    m = load_model(qwen_embed, pooling=True)
    table = m.model.model.embed_tokens.weight
    np.testing.assert_array_equal(m.head_rows([5, 9]), np.array(table[mx.array([5, 9])]))
    import mlx.nn as nn

    nn.quantize(m.model.model, group_size=32, bits=8, class_predicate=lambda p, x: p == "embed_tokens")
    rows = m.head_rows([5, 9])
    assert np.abs(rows - np.array(table[mx.array([5, 9])])).max() < 0.05
