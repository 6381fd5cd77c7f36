"""`vllm serve <pooling checkpoint> --runner pooling` as a real server: every
pooling endpoint's numbers against the float64 torch reference of the same
weights (tests/pooling_models.py), and the bad-input catalogue: each a 4xx
naming the problem, the server still serving afterwards.

Two servers: a Qwen3 embedder (decoder: /v1/embeddings float and base64,
/pooling, /score and /rerank by cosine) and a BERT cross-encoder (encoder:
/classify, /score, /rerank, /v1/rerank with token types)."""

from __future__ import annotations

import base64
import json
import re
import urllib.error
import urllib.request

import numpy as np
import pytest
from server_helpers import SERVED_NAME, vllm_server

import pooling_models as pm

QUERY, DOCS = pm.TEXTS[0], pm.TEXTS[1:5]


def post(url: str, body) -> tuple[int, dict | str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def ok(url: str, body: dict) -> dict:
    status, out = post(url, body)
    assert status == 200, out
    return out


@pytest.fixture(scope="module")
def embedder(model_dir, tmp_path_factory):
    path, ref = pm.build_qwen3(tmp_path_factory.mktemp("q3") / "m", model_dir, "embed")
    log = tmp_path_factory.mktemp("serve") / "embedder.log"
    with vllm_server(path, "--runner", "pooling", "--max-model-len", "64", log_path=log) as (base, _):
        yield base, ref


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path, ref = pm.build_encoder(tmp_path_factory.mktemp("bert") / "m", "bert", "classify", num_labels=1)
    log = tmp_path_factory.mktemp("serve") / "cross.log"
    with vllm_server(path, "--runner", "pooling", "--max-model-len", "128", log_path=log) as (base, _):
        from transformers import AutoTokenizer

        yield base, ref, AutoTokenizer.from_pretrained(path)


def tokens(base: str, text: str) -> list[int]:
    return ok(base + "/tokenize", {"model": SERVED_NAME, "prompt": text})["tokens"]


def close(got, want, tol=1e-4):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.abs(got - want).max() <= tol


# ---- the decoder embedder -----------------------------------------------

def test_embeddings_float_and_base64(embedder):
    base, ref = embedder
    floats = ok(base + "/v1/embeddings", {"model": SERVED_NAME, "input": pm.TEXTS})
    b64 = ok(base + "/v1/embeddings", {"model": SERVED_NAME, "input": pm.TEXTS, "encoding_format": "base64"})
    assert floats["usage"]["prompt_tokens"] == sum(len(tokens(base, t)) for t in pm.TEXTS)
    for text, f, b in zip(pm.TEXTS, floats["data"], b64["data"]):
        want = pm.embedding(ref, tokens(base, text), "last")
        close(f["embedding"], want)
        assert pm.cosine(f["embedding"], want) >= 0.99999
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype=np.float32)
        np.testing.assert_allclose(decoded, f["embedding"], atol=1e-6, rtol=0)  # (another step's batch)


def test_embeddings_of_token_ids(embedder):
    base, ref = embedder
    ids = tokens(base, pm.TEXTS[2])
    out = ok(base + "/v1/embeddings", {"model": SERVED_NAME, "input": [ids]})
    close(out["data"][0]["embedding"], pm.embedding(ref, ids, "last"))


def test_pooling_endpoint(embedder):
    base, ref = embedder
    out = ok(base + "/pooling", {"model": SERVED_NAME, "input": pm.TEXTS[:2]})
    for text, row in zip(pm.TEXTS[:2], out["data"]):
        close(row["data"], pm.embedding(ref, tokens(base, text), "last"))


def test_score_and_rerank_by_cosine(embedder):
    base, ref = embedder
    q = pm.embedding(ref, tokens(base, QUERY), "last")
    want = [pm.cosine(q, pm.embedding(ref, tokens(base, d), "last")) for d in DOCS]
    score = ok(base + "/score", {"model": SERVED_NAME, "queries": QUERY, "documents": DOCS})
    close([r["score"] for r in score["data"]], want)
    rerank = ok(base + "/rerank", {"model": SERVED_NAME, "query": QUERY, "documents": DOCS})
    ranked = [r["index"] for r in rerank["results"]]
    assert ranked == list(np.argsort(-np.array(want)))
    close([r["relevance_score"] for r in rerank["results"]], sorted(want, reverse=True))


# ---- the encoder cross-encoder ------------------------------------------

def pair_scores(ref, tok, query, docs):
    out = []
    for d in docs:
        enc = tok(query, d)
        out.append(float(pm.activate(pm.classifier_logits(ref, enc["input_ids"], enc["token_type_ids"]))[0]))
    return out


def test_cross_encoder_score(cross_encoder):
    base, ref, tok = cross_encoder
    want = pair_scores(ref, tok, QUERY, DOCS)
    out = ok(base + "/score", {"model": SERVED_NAME, "queries": QUERY, "documents": DOCS})
    close([r["score"] for r in out["data"]], want)


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_cross_encoder_rerank(cross_encoder, route):
    base, ref, tok = cross_encoder
    want = pair_scores(ref, tok, QUERY, DOCS)
    out = ok(base + route, {"model": SERVED_NAME, "query": QUERY, "documents": DOCS, "top_n": 3})
    assert [r["index"] for r in out["results"]] == list(np.argsort(-np.array(want)))[:3]
    close([r["relevance_score"] for r in out["results"]], sorted(want, reverse=True)[:3])
    assert [r["document"]["text"] for r in out["results"]] == [DOCS[i] for i in np.argsort(-np.array(want))[:3]]


def test_classify(cross_encoder):
    base, ref, tok = cross_encoder
    out = ok(base + "/classify", {"model": SERVED_NAME, "input": pm.TEXTS[:3]})
    for text, row in zip(pm.TEXTS[:3], out["data"]):
        close(row["probs"], pm.activate(pm.classifier_logits(ref, tok(text)["input_ids"])))
        assert row["num_classes"] == 1


# ---- bad input: a 4xx naming the problem, and the server keeps serving ----

EMBEDDER_BAD = [  # vLLM's own front end answers all of these; the engine never sees them
    ("/v1/embeddings", {"model": SERVED_NAME, "input": []}, "at least one prompt"),
    ("/v1/embeddings", {"model": SERVED_NAME, "input": " ".join(["word"] * 200)},
     "maximum context length is 64 tokens"),
    ("/v1/embeddings", {"model": SERVED_NAME, "input": 42}, "body.input"),
    ("/v1/embeddings", {"model": SERVED_NAME, "input": [[1, 2], "text"]}, "body.input"),
    ("/v1/embeddings", {"model": SERVED_NAME, "input": "x", "encoding_format": "hex"}, "encoding_format"),
    ("/v1/embeddings", {"model": SERVED_NAME, "input": "x", "dimensions": 16}, "does not support Matryoshka"),
    ("/v1/embeddings", {"model": "no-such-model", "input": "x"}, "`no-such-model` does not exist"),
    ("/v1/embeddings", b"{not json", "JSON decode error"),
    # a generation request to an embedding model: vLLM registers only the model's tasks' routes
    ("/v1/chat/completions", {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}]},
     "Not Found"),
    ("/classify", {"model": SERVED_NAME, "input": "x"}, "Not Found"),
]


@pytest.mark.parametrize("route,body,message", EMBEDDER_BAD,
                         ids=["empty", "too-long", "number", "mixed", "encoding", "dimensions", "model", "json",
                              "chat", "classify"])
def test_embedder_bad_input(embedder, route, body, message):
    base, ref = embedder
    status, text = post(base + route, body)
    assert 400 <= status < 500, (status, text)
    assert re.search(message, str(text)), text
    # still serving, the same numbers
    out = ok(base + "/v1/embeddings", {"model": SERVED_NAME, "input": pm.TEXTS[3]})
    close(out["data"][0]["embedding"], pm.embedding(ref, tokens(base, pm.TEXTS[3]), "last"))


CROSS_BAD = [
    ("/score", {"model": SERVED_NAME, "queries": QUERY, "documents": []}, "At least one text_pair"),
    ("/score", {"model": SERVED_NAME, "queries": QUERY}, "body.documents"),
    ("/rerank", {"model": SERVED_NAME, "query": QUERY, "documents": ["word " * 200]},
     "maximum context length is 128 tokens"),
    ("/rerank", {"model": SERVED_NAME, "query": 7, "documents": DOCS}, "body.query"),
    ("/classify", {"model": SERVED_NAME, "input": []}, "at least one prompt"),
    ("/v1/embeddings", {"model": SERVED_NAME, "input": "x"}, "Not Found"),
]


@pytest.mark.parametrize("route,body,message", CROSS_BAD,
                         ids=["no-documents", "missing-documents", "too-long", "query-type", "classify-empty",
                              "embeddings"])
def test_cross_encoder_bad_input(cross_encoder, route, body, message):
    base, ref, tok = cross_encoder
    status, text = post(base + route, body)
    assert 400 <= status < 500, (status, text)
    assert re.search(message, str(text)), text
    out = ok(base + "/score", {"model": SERVED_NAME, "queries": QUERY, "documents": DOCS[:1]})
    close([out["data"][0]["score"]], pair_scores(ref, tok, QUERY, DOCS[:1]))
