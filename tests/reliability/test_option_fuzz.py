"""Request options that change the runner's bookkeeping, fuzzed against a
real `vllm serve` that chunks prefills (64-token budget) and preempts (a KV
cache of 40 blocks under 8 concurrent requests): prompt logprobs, logprobs,
n, seeds, penalties and structured output, crossed with prompt lengths around
the chunk budget and the block size. The server never exits, and every
answer has the right shape: one entry of prompt logprobs per prompt token
(the first null), the requested number of alternatives, n choices, max_tokens
tokens, structured output within its grammar."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from reliability_helpers import (GOLDEN, PREEMPTIONS, SCALE, SERVED_NAME, SMOLLM2_BLOCK_BYTES, async_client,
                                 start_server, stream_completion)

BUDGET, BLOCK = 64, 16
LENGTHS = [1, 2, BLOCK - 1, BLOCK, BLOCK + 1, BUDGET - 1, BUDGET, BUDGET + 1, 2 * BUDGET - 1, 2 * BUDGET,
           2 * BUDGET + 1, 3 * BUDGET + 1, 4 * BUDGET + BLOCK + 1]
LONG = GOLDEN[-1]["prompt_ids"]
CHOICES = ["alpha", "beta", "gamma"]


def options(rng: random.Random) -> dict:
    """A random mix of the options that touch the runner's per-request state."""
    body: dict = {}
    if rng.random() < 0.6:
        body["prompt_logprobs"] = rng.choice([0, 1, 3])
    if rng.random() < 0.4:
        body["logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.3:
        body.update(n=2, temperature=0.8, seed=rng.randrange(1000))
    elif rng.random() < 0.3:
        body.update(temperature=0.9, seed=rng.randrange(1000))
    if rng.random() < 0.3:
        body.update(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5)
    if rng.random() < 0.15:
        # Without ignore_eos: a finished grammar allows only EOS, and vLLM
        # stops constraining a request whose grammar has terminated.
        body.update(structured_outputs={"choice": CHOICES}, ignore_eos=False)
    return body


def cases(count: int) -> list[tuple[list[int], dict]]:
    rng = random.Random(1234)
    out = []
    for i in range(count):
        length = LENGTHS[i % len(LENGTHS)]
        start = rng.randrange(len(LONG) - length)
        out.append((LONG[start:start + length], options(rng)))
    return out


def check(prompt: list[int], body: dict, status: int, payload: dict | str) -> list[str]:
    """Everything wrong with one answer (empty = right shape)."""
    if status != 200:
        return [f"status {status}: {str(payload)[:300]}"]
    problems = []
    choices = payload["choices"]
    n = body.get("n", 1)
    if len(choices) != n:
        problems.append(f"{len(choices)} choices for n={n}")
    for c in choices:
        tokens = c.get("token_ids") or []
        if "structured_outputs" in body:
            if c["text"].strip() not in CHOICES or c.get("finish_reason", "stop") != "stop":
                problems.append(f"structured output {c['text']!r} not one of {CHOICES}")
        elif len(tokens) != body["max_tokens"]:
            problems.append(f"{len(tokens)} tokens for max_tokens={body['max_tokens']} (ignore_eos)")
        if body.get("logprobs") is not None:
            lp = c.get("logprobs") or {}
            top = lp.get("top_logprobs") or []
            if len(top) != len(lp.get("tokens") or []) or len(top) != len(tokens):
                problems.append(f"{len(top)} logprob entries for {len(tokens)} tokens")
            k = body["logprobs"]
            if any(not (max(k, 1) <= len(entry) <= k + 1) for entry in top if entry is not None):
                problems.append(f"logprobs={k}: entries of sizes {sorted({len(e) for e in top if e})}")
        if "prompt_logprobs" in body:
            plp = c.get("prompt_logprobs")
            k = body["prompt_logprobs"]
            if plp is None or len(plp) != len(prompt):
                problems.append(f"prompt_logprobs of length {None if plp is None else len(plp)} "
                                f"for a {len(prompt)}-token prompt")
            elif plp[0] is not None or any(e is None for e in plp[1:]):
                problems.append("prompt_logprobs: only the first entry may be null")
            elif any(not (max(k, 1) <= len(e) <= k + 1) for e in plp[1:]):
                problems.append(f"prompt_logprobs={k}: entries of sizes {sorted({len(e) for e in plp[1:]})}")
    return problems


@pytest.fixture(scope="module")
def chunking_server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("option_fuzz") / "vllm_serve.log"
    with start_server(model_dir, log, "--max-num-batched-tokens", str(BUDGET), "--max-num-seqs", "8",
                      "--kv-cache-memory-bytes", str(40 * SMOLLM2_BLOCK_BYTES), "--max-model-len", "512",
                      "--max-logprobs", "8") as srv:
        yield srv


async def _send(client, prompt, extra, streamed):
    body = {**dict(model=SERVED_NAME, prompt=prompt, max_tokens=24, ignore_eos=True, return_token_ids=True,
                   temperature=0), **extra}
    if streamed and "prompt_logprobs" not in body and body.get("n", 1) == 1 and "logprobs" not in body:
        r = await stream_completion(client, body)
        payload = r.error if r.status != 200 else {"choices": [{"token_ids": r.token_ids, "text": r.text,
                                                                "finish_reason": r.finish_reason}]}
        return body, r.status, payload
    r = await client.post("/v1/completions", json=body)
    return body, r.status_code, (r.json() if r.status_code == 200 else r.text)


def test_options_crossed_with_chunk_and_block_boundaries(chunking_server, figures):
    todo = cases(48 * SCALE)

    async def run():
        async with async_client(chunking_server) as client:
            results = []
            for wave in range(0, len(todo), 12):  # 12 at once against max_num_seqs=8: queueing + preemption
                batch = todo[wave:wave + 12]
                results += await asyncio.gather(*(_send(client, p, o, (wave + i) % 4 == 0)
                                                  for i, (p, o) in enumerate(batch)))
                assert chunking_server.alive(), f"the server exited; log: {chunking_server.log_path}"
            return results

    results = asyncio.run(run())
    failures = []
    for (prompt, _), (body, status, payload) in zip(todo, results):
        problems = check(prompt, body, status, payload)
        if problems:
            failures.append(f"len {len(prompt)} {json.dumps({k: v for k, v in body.items() if k != 'prompt'})}: "
                            + "; ".join(problems))
    assert chunking_server.alive() and chunking_server.healthy()
    preemptions = chunking_server.metrics().get(PREEMPTIONS, 0.0)
    figures["option_fuzz"] = {"requests": len(todo), "preemptions": preemptions, "failures": len(failures)}
    assert not failures, "\n".join(failures[:20])
    assert preemptions > 0, "the KV cache was meant to force preemptions"
