"""Pooling models through vLLM's offline API (LLM.embed / classify / score /
encode) on this plugin, against float64 transformers references of the same
weights (tests/pooling_models.py): embeddings cosine >= 0.99999 and max abs
diff <= 1e-4, scores and probabilities within 1e-4 with the same ranking;
solo == batched == chunked; and what a pooling engine does not allocate."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch

import pooling_models as pm
from engine_helpers import clear_upstream_caches, runner_of

LONG_TEXTS = [pm.TEXTS[2] + " " + pm.TEXTS[0], pm.TEXTS[4] + " " + pm.TEXTS[5], pm.TEXTS[1]]
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
            "is_original_qwen3_reranker": True}


def _llm(path, **kwargs):
    from vllm import LLM

    args = dict(runner="pooling", dtype="float32", max_model_len=256, seed=0)
    args.update(kwargs)
    return LLM(path, **args)


def _close(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    clear_upstream_caches()
    gc.freeze()  # as engine_helpers.engine does: the next engine's start-up collects only what is new


@pytest.fixture(scope="module")
def tokenizer_dir(model_dir):
    return model_dir  # the embedded SmolLM2's tokenizer files


def assert_vectors(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4
    assert pm.cosine(got, want) >= 0.99999


def assert_scores(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert list(np.argsort(-got.ravel())) == list(np.argsort(-want.ravel()))


def assert_distinct(scores):
    """Every two references differ by more than twice the tolerance: the ranking is well defined."""
    gaps = np.diff(np.sort(np.asarray(scores, np.float64)))
    assert gaps.min() > 2e-4, scores


# ---- a decoder embedder (Qwen3-Embedding's layout) ------------------------

@pytest.fixture(scope="class")
def built(tmp_path_factory, tokenizer_dir):
    return pm.build_qwen3(tmp_path_factory.mktemp("q3e") / "m", tokenizer_dir, "embed", matryoshka=True)


@pytest.fixture(scope="class")
def llm(built):
    llm = _llm(built[0])
    yield llm
    _close(llm)


class TestQwen3Embedder:
    def test_embed_matches_reference(self, llm, built):
        outs = llm.embed(pm.TEXTS, use_tqdm=False)
        vectors = [o.outputs.embedding for o in outs]
        for o, v in zip(outs, vectors):
            assert_vectors(v, pm.embedding(built[1], o.prompt_token_ids, "last"))
        assert max(pm.cosine(vectors[0], v) for v in vectors[1:]) < 0.99  # texts give different vectors

    def test_solo_equals_batched(self, llm):
        batched = [o.outputs.embedding for o in llm.embed(pm.TEXTS, use_tqdm=False)]
        for text, want in zip(pm.TEXTS[:3], batched):
            solo = llm.embed([text], use_tqdm=False)[0].outputs.embedding
            np.testing.assert_allclose(solo, want, atol=1e-6, rtol=0)

    def test_matryoshka_dimensions(self, llm, built):
        from vllm import PoolingParams

        outs = llm.embed(pm.TEXTS[:3], pooling_params=PoolingParams(dimensions=24), use_tqdm=False)
        for o in outs:
            assert len(o.outputs.embedding) == 24
            assert_vectors(o.outputs.embedding, pm.embedding(built[1], o.prompt_token_ids, "last", dims=24))

    def test_unnormalized(self, llm, built):
        from vllm import PoolingParams

        o = llm.embed(pm.TEXTS[:1], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)[0]
        want = pm.embedding(built[1], o.prompt_token_ids, "last", normalize=False)
        assert abs(np.linalg.norm(want) - 1) > 0.1
        assert_vectors(o.outputs.embedding, want)

    def test_score_is_cosine(self, llm, built):
        outs = llm.score(pm.TEXTS[0], pm.TEXTS[1:], use_tqdm=False)
        tok = llm.get_tokenizer()
        q = pm.embedding(built[1], tok(pm.TEXTS[0])["input_ids"], "last")
        want = [pm.cosine(q, pm.embedding(built[1], tok(d)["input_ids"], "last")) for d in pm.TEXTS[1:]]
        assert_scores([o.outputs.score for o in outs], want)

    def test_no_generator_cache(self, llm):
        """A pooling model's cache holds prompts in flight, not a generator's share of memory."""
        runner = runner_of(llm)
        cache_bytes = sum(a.nbytes for a in runner.kv.arrays())
        assert cache_bytes <= 64 << 20
        assert runner.pooling is not None and runner.pooling.kind == "embed"
        assert "lm_head" not in runner.mlx_model.model  # the LM head is not built


def test_qwen3_chunked_equals_one_pass(tmp_path, tokenizer_dir):
    """Chunked prefill (vLLM's default for last-token pooling) with 8-token
    chunks gives the vectors of one pass; prefix-cache hits too."""
    path, ref = pm.build_qwen3(tmp_path / "m", tokenizer_dir, "embed")
    llm = _llm(path, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64)
    try:
        first = llm.embed(LONG_TEXTS, use_tqdm=False)
        assert max(len(o.prompt_token_ids) for o in first) > 16  # several chunks
        again = llm.embed(LONG_TEXTS, use_tqdm=False)  # whole blocks come from the prefix cache now
        assert sum(o.num_cached_tokens for o in again) > 0
        for a, b in zip(first, again):
            want = pm.embedding(ref, a.prompt_token_ids, "last")
            assert_vectors(a.outputs.embedding, want)
            assert_vectors(b.outputs.embedding, want)
    finally:
        _close(llm)


def test_qwen3_token_embed_chunked(tmp_path, tokenizer_dir):
    """vLLM's token_embed task (--pooler-config task): every token's
    normalized state, gathered across 8-token chunks (PoolingStates)."""
    from vllm.config import PoolerConfig

    path, ref = pm.build_qwen3(tmp_path / "m", tokenizer_dir, "embed")
    llm = _llm(path, pooler_config=PoolerConfig(task="token_embed"), max_num_batched_tokens=8, max_num_seqs=4,
               max_model_len=64)
    try:
        outs = llm.encode(LONG_TEXTS, pooling_task="token_embed", use_tqdm=False)
        assert max(len(o.prompt_token_ids) for o in outs) > 16
        for o in outs:
            h = pm.hidden_states(ref, o.prompt_token_ids)
            want = (h / h.norm(dim=-1, keepdim=True)).numpy()
            got = o.outputs.data.numpy()
            assert got.shape == want.shape
            assert np.abs(got - want).max() <= 1e-4
    finally:
        _close(llm)


# ---- decoder classifiers and rerankers ----------------------------------

def test_qwen3_classifier(tmp_path, tokenizer_dir):
    path, ref = pm.build_qwen3(tmp_path / "m", tokenizer_dir, "classify", num_labels=3)
    llm = _llm(path)
    try:
        outs = llm.classify(pm.TEXTS, use_tqdm=False)
        for o in outs:
            want = pm.activate(pm.classifier_logits(ref, o.prompt_token_ids))
            assert_scores(o.outputs.probs, want)
        assert len({int(np.argmax(o.outputs.probs)) for o in outs}) > 1  # labels differ between texts
    finally:
        _close(llm)


def test_qwen3_reranker_hf_overrides(tmp_path, tokenizer_dir):
    """Qwen3-Reranker's formulation: a causal LM scored by sigmoid(logit yes - logit no)."""
    path, ref = pm.build_qwen3(tmp_path / "m", tokenizer_dir, "causal")
    llm = _llm(path, hf_overrides=RERANKER)
    try:
        tok = llm.get_tokenizer()
        yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
        outs = llm.score(pm.TEXTS[0], pm.TEXTS[1:], use_tqdm=False)
        want = []
        for o in outs:
            with torch.no_grad():
                logits = ref(torch.tensor([o.prompt_token_ids])).logits[0, -1]
            want.append(float(torch.sigmoid(logits[yes] - logits[no])))
        assert_scores([o.outputs.score for o in outs], want)
        assert_distinct(want)
    finally:
        _close(llm)


# ---- encoders -----------------------------------------------------------

ENCODER_CASES = [("bert", "mean"), ("xlm-roberta", "cls"), ("modernbert", "mean")]


@pytest.mark.parametrize("model_type,pooling", ENCODER_CASES)
def test_encoder_embedder(tmp_path, model_type, pooling):
    path, ref = pm.build_encoder(tmp_path / "m", model_type, "embed", pooling=pooling)
    llm = _llm(path, max_model_len=128)
    try:
        runner = runner_of(llm)
        assert runner.kv is None and runner.mlx_model is None  # an encoder: no KV cache at all
        encoder, rows_only = runner.pooling.encoder, []
        forward = encoder.forward
        encoder.forward = lambda *a, **k: rows_only.append(k.get("keep") is not None) or forward(*a, **k)
        outs = llm.embed(pm.TEXTS, use_tqdm=False)
        # CLS pooling of a BERT-style encoder: the last layer computes the CLS rows only
        assert rows_only and set(rows_only) == {pooling == "cls" and model_type != "modernbert"}
        for o in outs:
            assert o.prompt_token_ids[0] == 3  # [CLS] / <s> first: the tokenizer's template
            assert_vectors(o.outputs.embedding, pm.embedding(ref, o.prompt_token_ids, pooling))
        solo = llm.embed(pm.TEXTS[2:3], use_tqdm=False)[0].outputs.embedding
        np.testing.assert_allclose(solo, outs[2].outputs.embedding, atol=1e-6, rtol=0)
    finally:
        _close(llm)
    if pooling == "cls":
        # CLS embeddings compute the last layer for the CLS rows only; the
        # same model serving token_embed still gets every row's state
        from vllm.config import PoolerConfig

        llm = _llm(path, max_model_len=128, pooler_config=PoolerConfig(task="token_embed"))
        try:
            for o in llm.encode(pm.TEXTS[:2], pooling_task="token_embed", use_tqdm=False):
                h = pm.hidden_states(ref, o.prompt_token_ids)
                want = (h / h.norm(dim=-1, keepdim=True)).numpy()
                got = o.outputs.data.numpy()
                assert got.shape == want.shape and np.abs(got - want).max() <= 1e-4
        finally:
            _close(llm)


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta", "modernbert"])
def test_encoder_cross_encoder(tmp_path, model_type):
    path, ref = pm.build_encoder(tmp_path / "m", model_type, "classify", num_labels=1)
    llm = _llm(path, max_model_len=128)
    try:
        tok = llm.get_tokenizer()
        outs = llm.score(pm.TEXTS[0], pm.TEXTS[1:], use_tqdm=False)
        want = []
        for d, o in zip(pm.TEXTS[1:], outs):
            enc = tok(pm.TEXTS[0], d)
            assert o.prompt_token_ids == enc["input_ids"]
            types = enc["token_type_ids"] if model_type == "bert" else None
            want.append(float(pm.activate(pm.classifier_logits(ref, enc["input_ids"], types))[0]))
        assert_scores([o.outputs.score for o in outs], want)
        assert_distinct(want)
        probs = llm.classify(pm.TEXTS[:3], use_tqdm=False)
        for o in probs:
            assert_scores(o.outputs.probs, pm.activate(pm.classifier_logits(ref, o.prompt_token_ids)))
    finally:
        _close(llm)
