"""`vllm serve --enable-lora` as users run it: adapters from --lora-modules
(name=path and the JSON form), listed by /v1/models, named as a request's
`model`, loaded and unloaded at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING),
each answer the reference's tokens (teacher forcing); adapters that cannot
be served answered 400 naming the problem, missing ones 404, and the server
keeps serving everyone."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from engine_helpers import GOLDEN
from families import build
from lora_adapters import make_mlx_adapter, make_peft_adapter, merged_peft_model, reference_logprobs
from server_helpers import SERVED_NAME, vllm_server

PROMPT = GOLDEN[-1]["prompt_ids"][100:160]
TOL = 1e-3


def post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    variant = build("llama", root / "llama", model_dir)
    paths = {"mlx": make_mlx_adapter(variant, root / "mlx", rank=8, num_layers=3, seed=41),
             "peft": make_peft_adapter(variant, root / "peft", rank=8, alpha=16, seed=42,
                                       target_modules=("q_proj", "v_proj", "gate_proj", "down_proj")),
             "late": make_mlx_adapter(variant, root / "late", rank=4, num_layers=3, seed=43),
             "big": make_mlx_adapter(variant, root / "big", rank=16, num_layers=1)}
    full = root / "full"
    full.mkdir()
    (full / "adapter_config.json").write_text('{"fine_tune_type": "full", "num_layers": 3}')
    paths["full"] = str(full)
    refs = {"base": reference_logprobs(variant), "mlx": reference_logprobs(variant, paths["mlx"]),
            "late": reference_logprobs(variant, paths["late"]),
            "peft": reference_logprobs(merged_peft_model(variant, paths["peft"], root / "merged"))}
    log = root / "vllm_serve.log"
    with vllm_server(variant, "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules",
                     f"mlx={paths['mlx']}", json.dumps({"name": "peft", "path": paths["peft"]}),
                     env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, log_path=log) as (base, _):
        yield base, paths, refs


def complete(base: str, model: str) -> tuple[int, dict | str]:
    status, body = post(base + "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                   "temperature": 0, "return_token_ids": True})
    return status, json.loads(body) if status == 200 else body


def check(base, model, ref):
    status, body = complete(base, model)
    assert status == 200, body
    tokens = body["choices"][0]["token_ids"]
    rows = ref(PROMPT + tokens[:-1])[len(PROMPT) - 1:]
    chosen = rows[np.arange(len(tokens)), tokens]
    assert (chosen >= rows.max(axis=1) - TOL).all(), f"{model}: a token off the reference's argmax"
    return tokens


def test_models_lists_the_adapters(served):
    base, paths, _ = served
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
        cards = {c["id"]: c for c in json.loads(r.read())["data"]}
    assert {SERVED_NAME, "mlx", "peft"} <= set(cards)
    assert cards["mlx"]["root"] == paths["mlx"] and cards["mlx"]["parent"] == SERVED_NAME


def test_requests_name_their_adapter(served):
    base, _, refs = served
    tokens = {m: check(base, m, refs[m if m != SERVED_NAME else "base"]) for m in (SERVED_NAME, "mlx", "peft")}
    assert len({tuple(t) for t in tokens.values()}) == 3  # each adapter changes the base's answer


def test_runtime_load_use_unload(served):
    base, paths, refs = served
    assert complete(base, "late")[0] == 404
    status, body = post(base + "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": paths["late"]})
    assert status == 200, body
    check(base, "late", refs["late"])
    status, body = post(base + "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert status == 200, body
    assert complete(base, "late")[0] == 404


@pytest.mark.parametrize("adapter,status,words", [
    ("big", 400, "rank 16 is above --max-lora-rank 8"),
    ("full", 400, "a full fine-tune (fine_tune_type: full), not an adapter"),
    ("missing", 404, "No adapter found for /nonexistent/adapter"),
])
def test_bad_adapter_is_answered_and_the_server_keeps_serving(served, adapter, status, words):
    base, paths, refs = served
    got, body = post(base + "/v1/load_lora_adapter",
                     {"lora_name": f"bad-{adapter}", "lora_path": paths.get(adapter, "/nonexistent/adapter")})
    assert got == status and words in body, body
    assert complete(base, f"bad-{adapter}")[0] == 404
    check(base, "mlx", refs["mlx"])
    check(base, SERVED_NAME, refs["base"])
