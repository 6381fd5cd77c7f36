"""Encoder models (models/encoders.py, bert.py, modernbert.py) against
transformers' own forward of the same weights in float64: every family,
packed steps of equal and of ragged lengths (padding only inside attention),
cross-encoder token types, ModernBERT's local windows; and the catalogue of
checkpoints that are refused, each naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

from vllm_metal.models.encoders import ENCODERS, load_encoder
from vllm_metal.pooling.serving_config import ENCODER_TYPES


def _build(tmp: Path, model_type: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
                  max_position_embeddings=128)
    if model_type == "bert":
        model = transformers.BertModel(transformers.BertConfig(**common, type_vocab_size=2), add_pooling_layer=False)
    elif model_type == "roberta":
        model = transformers.RobertaModel(transformers.RobertaConfig(**common, pad_token_id=1), add_pooling_layer=False)
    elif model_type == "xlm-roberta":
        model = transformers.XLMRobertaModel(transformers.XLMRobertaConfig(**common, pad_token_id=1,
                                                                           type_vocab_size=1), add_pooling_layer=False)
    else:  # local windows of +-4 tokens, every second layer global: windows matter at these lengths
        model = transformers.ModernBertModel(transformers.ModernBertConfig(
            **common, pad_token_id=0, bos_token_id=3, eos_token_id=4, cls_token_id=3, sep_token_id=4,
            local_attention=8, global_attn_every_n_layers=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape) / np.sqrt(p.shape[-1]))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape))
    path = tmp / model_type
    model.eval().save_pretrained(str(path))
    return path, model.double()


@pytest.fixture(scope="module", params=sorted(ENCODERS))
def encoder(request, tmp_path_factory):
    return _build(tmp_path_factory.mktemp("enc"), request.param)


def test_served_types_agree():
    assert tuple(sorted(ENCODERS)) == ENCODER_TYPES


def test_docs_table_is_generated():
    from vllm_metal.models.encoders import markdown_table

    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    block = text.split("<!-- pooling-models:begin (generated) -->")[1].split("<!-- pooling-models:end -->")[0]
    assert block.strip() == markdown_table(), "regenerate: python -m vllm_metal.models.encoders"


def _reference(model, ids, types=None):
    kwargs = {"token_type_ids": torch.tensor([types])} if types is not None else {}
    with torch.no_grad():
        return model(torch.tensor([ids]), **kwargs).last_hidden_state[0].numpy()


@pytest.mark.parametrize("lens", [[7, 7, 7], [3, 17, 9, 1, 12]], ids=["equal", "ragged"])
def test_matches_transformers(encoder, lens, rng):
    path, ref = encoder
    enc = load_encoder(path)
    ids = [rng.integers(5, 300, n) for n in lens]  # never id 1 (RoBERTa's pad: HF counts positions past it)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    h = np.array(enc.forward(np.concatenate(ids).astype(np.int32), cu))
    assert h.shape == (sum(lens), 64) and h.dtype == np.float32
    for s, row in enumerate(ids):
        want = _reference(ref, row.tolist())
        np.testing.assert_allclose(h[cu[s]:cu[s + 1]], want, atol=2e-5, rtol=0)


def test_pooled_rows_only_match_the_full_pass(encoder, rng):
    """forward(keep=...) (what the runner uses for CLS / last-token pooling):
    the last layer computed for one row per prompt gives that row of the
    full pass and of transformers; ModernBERT (windowed layers) refuses it."""
    path, ref = encoder
    enc = load_encoder(path)
    lens = [3, 17, 1, 12]
    ids = [rng.integers(5, 300, n) for n in lens]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    tokens = np.concatenate(ids).astype(np.int32)
    if not enc.computes_rows_only:
        with pytest.raises(ValueError, match="one row per prompt of a BERT-style encoder"):
            enc.forward(tokens, cu, keep=cu[:-1])
        return
    full = np.array(enc.forward(tokens, cu))
    for keep in (cu[:-1], cu[1:] - 1):  # CLS, last token
        rows = np.array(enc.forward(tokens, cu, keep=keep))
        assert rows.shape == (len(lens), 64)
        np.testing.assert_allclose(rows, full[keep], atol=2e-6, rtol=0)
        for s, row in enumerate(ids):
            np.testing.assert_allclose(rows[s], _reference(ref, row.tolist())[keep[s] - cu[s]], atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="one row per prompt"):
        enc.forward(tokens, cu, keep=cu[:2])


def test_modernbert_windows_change_the_output(tmp_path, rng):
    """A probe that the local windows are real: widening them changes the
    states of a 17-token prompt (and the reference above agrees with the narrow one)."""
    path, _ = _build(tmp_path, "modernbert")
    ids = rng.integers(5, 300, 17).astype(np.int32)
    cu = np.array([0, 17], np.int32)
    narrow = np.array(load_encoder(path).forward(ids, cu))
    config = json.loads((path / "config.json").read_text())
    config["local_attention"] = 64
    (path / "config.json").write_text(json.dumps(config))
    wide = np.array(load_encoder(path).forward(ids, cu))
    assert np.abs(narrow - wide).max() > 1e-2


def test_bert_token_types(tmp_path, rng):
    path, ref = _build(tmp_path, "bert")
    enc = load_encoder(path)
    ids = rng.integers(5, 300, 10).tolist()
    types = [0] * 4 + [1] * 6
    h = np.array(enc.forward(np.array(ids, np.int32), np.array([0, 10], np.int32), np.array(types, np.int32)))
    np.testing.assert_allclose(h, _reference(ref, ids, types), atol=2e-5, rtol=0)
    plain = np.array(enc.forward(np.array(ids, np.int32), np.array([0, 10], np.int32)))
    assert np.abs(h - plain).max() > 1e-3  # the second segment's type embedding is used


def test_bfloat16_close(tmp_path, rng):
    path, ref = _build(tmp_path, "bert")
    enc = load_encoder(path, mx.bfloat16)
    ids = rng.integers(5, 300, 9).tolist()
    h = np.array(enc.forward(np.array(ids, np.int32), np.array([0, 9], np.int32)))
    want = _reference(ref, ids)
    cos = (h * want).sum(-1) / np.linalg.norm(h, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() > 0.99


def test_longer_than_positions_refused(tmp_path):
    path, _ = _build(tmp_path, "roberta")
    enc = load_encoder(path)
    assert enc.max_positions == 128 - 2  # RoBERTa's positions start after the pad id 1
    with pytest.raises(ValueError, match="longer than the 126 positions"):
        enc.forward(np.full(127, 7, np.int32), np.array([0, 127], np.int32))


# ---- bad checkpoints ----------------------------------------------------

def _bad(tmp_path, change):
    path, _ = _build(tmp_path, "bert")
    change(path)
    return path


def _drop(name):
    def change(path):
        w = mx.load(str(path / "model.safetensors"))
        w.pop(name)
        mx.save_safetensors(str(path / "model.safetensors"), w)
    return change


def _nan(path):
    w = mx.load(str(path / "model.safetensors"))
    w["encoder.layer.0.output.dense.weight"] = w["encoder.layer.0.output.dense.weight"] * float("nan")
    mx.save_safetensors(str(path / "model.safetensors"), w)


def _pickle_only(path):
    (path / "model.safetensors").rename(path / "pytorch_model.bin")


def _corrupt(path):
    (path / "model.safetensors").write_bytes(b"\x00" * 64)


def _wrong_shape(path):
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 80
    (path / "config.json").write_text(json.dumps(config))


def _unknown_type(path):
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "electra"
    (path / "config.json").write_text(json.dumps(config))


def _bad_activation(path):
    config = json.loads((path / "config.json").read_text())
    config["hidden_act"] = "swish_beta"
    (path / "config.json").write_text(json.dumps(config))


def _rotary(path):
    config = json.loads((path / "config.json").read_text())
    config["position_embedding_type"] = "rotary"
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("change,message", [
    (_drop("encoder.layer.1.attention.self.key.weight"), "no tensor 'encoder.layer.1.attention.self.key.weight'"),
    (_drop("embeddings.word_embeddings.weight"), "no tensor 'embeddings.word_embeddings.weight'"),
    (_nan, "non-finite"),
    (_pickle_only, r"no \*.safetensors weights \(found: pytorch_model.bin\)"),
    (_corrupt, "cannot read the safetensors file"),
    (_wrong_shape, "shape"),
    (_unknown_type, "encoder model type 'electra' is not served"),
    (_bad_activation, "activation 'swish_beta' is not served"),
    (_rotary, "position_embedding_type 'rotary' is not served"),
], ids=["missing-layer-tensor", "missing-embedding", "nan", "pickle-only", "corrupt", "wrong-shape",
        "unknown-type", "activation", "rotary"])
def test_bad_checkpoint_refused(tmp_path, change, message):
    path = _bad(tmp_path, change)
    with pytest.raises((ValueError, NotImplementedError), match=message):
        load_encoder(path)
