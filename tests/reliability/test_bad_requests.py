"""Hostile and malformed requests against a real `vllm serve`: each gets a 4xx
whose message names the problem, the server stays up, the next valid request
succeeds, and a stream running alongside the abuse is not disturbed."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from reliability_helpers import GOLDEN, SERVED_NAME, completion_body, stream_completion

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


def comp(**kw):
    return dict(dict(model=SERVED_NAME, prompt="Hello", max_tokens=4), **kw)


def chat(**kw):
    return dict(dict(model=SERVED_NAME, messages=HI, max_tokens=4), **kw)


def raw(text: str):
    return text.encode()


# name: (path, body (dict = JSON, bytes = sent as is), status, regex the message must match)
CASES = {
    # the body itself
    "malformed JSON": (COMP, raw('{"model": "smollm2", "prompt": '), 400, r"JSON decode error"),
    "body is a list": (COMP, raw("[1, 2, 3]"), 400, r"valid dictionary"),
    "form-encoded body": (COMP, None, 400, r"Only 'application/json' is allowed"),
    "unknown model": (COMP, comp(model="gpt-9"), 404, r"model `gpt-9` does not exist"),
    "model is a number": (COMP, comp(model=5), 400, r"body\.model"),
    # prompts
    "empty prompt": (COMP, comp(prompt=""), 400, r"prompt .*non-empty"),
    "no prompts": (COMP, comp(prompt=[]), 400, r"at least one prompt"),
    "empty token prompt": (COMP, comp(prompt=[[]]), 400, r"prompt cannot be empty"),
    "prompt is a number": (COMP, comp(prompt=5), 400, r"body\.prompt"),
    "negative token id": (COMP, comp(prompt=[-1, 5]), 400, r"greater than or equal to 0"),
    "token id out of vocab": (COMP, comp(prompt=[10**9]), 400, r"out of vocabulary"),
    "text prompt longer than max_model_len": (COMP, comp(prompt="hello " * 3000), 400,
                                              r"maximum context length is 2048 tokens"),
    "token prompt longer than max_model_len": (COMP, comp(prompt=[504] * 2049), 400,
                                               r"maximum context length is 2048 tokens.*2049 input tokens"),
    # vLLM clamps max_tokens to max_model_len - prompt length, then rejects 0.
    "prompt fills max_model_len": (COMP, comp(prompt=[504] * 2048, max_tokens=1), 400,
                                   r"max_tokens must be at least 1, got 0"),
    "chat without messages": (CHAT, chat(messages=[]), 400, r"empty conversation"),
    "messages is a string": (CHAT, chat(messages="hi"), 400, r"body\.messages"),
    "content is a number": (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, r"content"),
    "message without role": (CHAT, chat(messages=[{"content": "hi"}]), 400, r"role"),
    # lengths
    "max_tokens 0": (COMP, comp(max_tokens=0), 400, r"max_tokens must be at least 1, got 0"),
    "max_tokens negative": (COMP, comp(max_tokens=-1), 400, r"max_tokens must be at least 1, got -1"),
    "max_tokens absurd": (COMP, comp(max_tokens=10**12), 400,
                          r"max_tokens=1000000000000 cannot be greater than max_model_len=2048"),
    "max_tokens beyond int64": (COMP, comp(max_tokens=2**70), 400, r"max_tokens"),
    "max_tokens is a string": (COMP, comp(max_tokens="lots"), 400, r"body\.max_tokens"),
    "chat max_completion_tokens 0": (CHAT, chat(max_tokens=None, max_completion_tokens=0), 400,
                                     r"max_tokens must be at least 1"),
    "min_tokens above max_tokens": (COMP, comp(min_tokens=10, max_tokens=2), 400,
                                    r"min_tokens must be less than or equal to max_tokens"),
    # sampling parameters
    "temperature negative": (COMP, comp(temperature=-1), 400, r"temperature must be non-negative"),
    "temperature NaN": (COMP, raw('{"model":"smollm2","prompt":"hi","temperature":NaN}'), 400,
                        r"temperature must be a finite number"),
    "temperature Infinity": (COMP, raw('{"model":"smollm2","prompt":"hi","temperature":Infinity}'), 400,
                             r"temperature must be a finite number"),
    "temperature absurd": (COMP, comp(temperature=1e9), 400, r"temperature must be in \[0, 2\]"),
    "temperature is a string": (COMP, comp(temperature="hot"), 400, r"body\.temperature"),
    "top_p 0": (COMP, comp(top_p=0), 400, r"top_p must be in \(0, 1\]"),
    "top_p above 1": (COMP, comp(top_p=1.5), 400, r"top_p must be in \(0, 1\]"),
    "top_k negative": (COMP, comp(top_k=-5), 400, r"top_k must be 0 \(disable\), or at least 1"),
    "top_k fractional": (COMP, comp(top_k=2.5), 400, r"body\.top_k"),
    "min_p above 1": (COMP, comp(min_p=2), 400, r"min_p must be in \[0, 1\]"),
    "min_p negative": (COMP, comp(min_p=-1), 400, r"min_p must be in \[0, 1\]"),
    "presence_penalty out of range": (COMP, comp(presence_penalty=5), 400, r"presence_penalty must be in"),
    "repetition_penalty 0": (COMP, comp(repetition_penalty=0), 400, r"repetition_penalty must be greater than zero"),
    "seed is a string": (COMP, comp(seed="x"), 400, r"body\.seed"),
    "logit_bias out of vocab": (COMP, comp(logit_bias={"999999999": 5}), 400, r"logit_bias .*out-of-vocab"),
    "allowed_token_ids out of vocab": (COMP, comp(allowed_token_ids=[10**9]), 400,
                                       r"allowed_token_ids contains out-of-vocab"),
    "stop is a number": (COMP, comp(stop=5), 400, r"body\.stop"),
    "bad_words is a number": (COMP, comp(bad_words=5), 400, r"body\.bad_words"),
    "stream is a sentence": (COMP, comp(stream="yes please"), 400, r"body\.stream"),
    # n and logprobs
    "n 0": (COMP, comp(n=0), 400, r"n must be at least 1"),
    "n huge": (COMP, comp(n=100000), 400, r"n must be at most"),
    "n is a string": (COMP, comp(n="two"), 400, r"body\.n"),
    "logprobs negative": (COMP, comp(logprobs=-2), 400, r"logprobs` must be a positive value or -1"),
    "logprobs huge": (COMP, comp(logprobs=100000), 400, r"sample logprobs of 100000.*max allowed: 20"),
    "prompt_logprobs huge": (COMP, comp(prompt_logprobs=100000), 400, r"prompt logprobs of 100000"),
    "chat top_logprobs without logprobs": (CHAT, chat(top_logprobs=5), 400,
                                           r"`top_logprobs`, `logprobs` must be set"),
    "chat top_logprobs huge": (CHAT, chat(logprobs=True, top_logprobs=1000), 400, r"logprobs of 1000"),
    # structured output
    "json_schema with an unknown type": (CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}), 400,
        r"Invalid type: nonsense"),
    "json_schema that is a string": (CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": "not a schema"}}), 400,
        r"json_schema\.schema"),
    "unclosed regex": (COMP, comp(structured_outputs={"regex": "(unclosed"}), 400, r"regex.*unclosed"),
    "broken grammar": (COMP, comp(structured_outputs={"grammar": "root ::= ("}), 400, r"[Gg]rammar"),
    "empty choice": (COMP, comp(structured_outputs={"choice": []}), 400, r"[Cc]hoice .*empty"),
    # bad parameters on a streaming request fail before the stream starts
    "streaming with bad temperature": (COMP, comp(stream=True, temperature=-3), 400,
                                       r"temperature must be non-negative"),
}


def send(client: httpx.Client, path: str, body) -> httpx.Response:
    if body is None:
        return client.post(path, content=b"model=smollm2&prompt=hi",
                           headers={"content-type": "application/x-www-form-urlencoded"})
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"content-type": "application/json"})
    return client.post(path, json=body)


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base, timeout=120) as c:
        yield c


@pytest.mark.parametrize("case", CASES)
def test_bad_request_is_rejected_and_server_survives(server, client, case):
    path, body, status, message = CASES[case]
    r = send(client, path, body)
    assert r.status_code == status, f"{case}: got {r.status_code}: {r.text[:300]}"
    error = r.json()["error"]
    assert error["code"] == status
    assert re.search(message, error["message"], re.S), \
        f"{case}: message does not name the problem: {error['message'][:300]}"
    assert server.alive() and server.healthy()
    ok = client.post(COMP, json=completion_body("The capital of France is", 2))
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2


def test_abuse_does_not_disturb_a_running_stream(server, figures):
    """Every bad request fired (twice, concurrently) while a greedy stream runs:
    the stream still returns its exact tokens."""
    golden = GOLDEN[4]
    n = len(golden["greedy_ids"])

    async def run():
        async with httpx.AsyncClient(base_url=server.base, timeout=120) as c:
            stream = asyncio.create_task(stream_completion(c, completion_body(golden["prompt_ids"], n)))

            async def bad(path, body):
                if body is None or isinstance(body, bytes):
                    content = body or b"model=smollm2"
                    kind = "application/json" if body else "application/x-www-form-urlencoded"
                    return await c.post(path, content=content, headers={"content-type": kind})
                return await c.post(path, json=body)

            replies = await asyncio.gather(*(bad(p, b) for p, b, _, _ in list(CASES.values()) * 2))
            return await stream, replies

    result, replies = asyncio.run(run())
    assert all(400 <= r.status_code < 500 for r in replies)
    assert result.status == 200 and result.token_ids == golden["greedy_ids"]
    figures["bad_requests"] = dict(cases=len(CASES), concurrent_bad_requests=len(replies))
