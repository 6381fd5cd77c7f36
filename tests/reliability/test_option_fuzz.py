"""One `vllm serve` with a small KV cache that chunks prefills (64-token
budget) and preempts (40 blocks, 8 sequences at most), shared by two tests
(one server start instead of two):

KV-cache exhaustion: a burst that needs more than twice the cache; the
scheduler preempts and resumes, every request completes, and the greedy
tokens equal the same burst on the default server (whose cache never runs
out).

Request options that change the runner's bookkeeping, fuzzed: prompt
logprobs, logprobs, n, seeds, penalties and structured output, crossed with
prompt lengths around the chunk budget and the block size, 12 requests at
once. The server never exits, and every answer has the right shape: one
entry of prompt logprobs per prompt token (the first null), the requested
number of alternatives, n choices, max_tokens tokens, structured output
within its grammar."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from reliability_helpers import (GOLDEN, KV_USAGE, PREEMPTIONS, RUNNING, SCALE, SERVED_NAME, SMOLLM2_BLOCK_BYTES,
                                 WAITING, async_client, completion_body, poll_peak, start_server, stream_completion)

BUDGET, BLOCK = 64, 16
NUM_BLOCKS = 40  # 640 tokens
FUZZ_TOKENS = 24  # every answer's length (ignore_eos): decode growth that preempts (16: 3 preemptions, not 9)
MAX_MODEL_LEN = 320  # > the longest fuzz prompt (273 tokens) + FUZZ_TOKENS
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
def small_cache_server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("small_cache") / "vllm_serve.log"
    with start_server(model_dir, log, "--max-num-batched-tokens", str(BUDGET), "--max-num-seqs", "8",
                      "--kv-cache-memory-bytes", str(NUM_BLOCKS * SMOLLM2_BLOCK_BYTES),
                      "--max-model-len", str(MAX_MODEL_LEN), "--max-logprobs", "8") as srv:
        yield srv


# --- KV-cache exhaustion ---

BURST_TOKENS = 64


def burst():
    """(prompt, max_tokens): 8 x SCALE prompts of 30..114 tokens that grow by 64
    (admitted on their prompts, they run out of blocks while decoding), plus
    one that fills max_model_len."""
    reqs = [(LONG[i:i + 30 + 12 * (i % 8)], BURST_TOKENS) for i in range(8 * SCALE)]
    reqs.append((LONG[:MAX_MODEL_LEN - 8], 8))
    return reqs


async def run_burst(server):
    async with async_client(server) as c:
        stop = asyncio.Event()
        peak = asyncio.create_task(poll_peak(server, [RUNNING, WAITING, KV_USAGE], stop))
        results = await asyncio.gather(*(stream_completion(c, completion_body(p, n)) for p, n in burst()))
        stop.set()
        return results, await peak


def test_burst_beyond_the_cache_completes_through_preemption(server, small_cache_server, figures):
    demand = sum(-(-(len(p) + n) // BLOCK) for p, n in burst())
    assert demand > 2 * NUM_BLOCKS
    expected, _ = asyncio.run(run_burst(server))
    assert all(r.status == 200 and r.finish_reason == "length" for r in expected)

    before = small_cache_server.metrics().get(PREEMPTIONS, 0.0)
    results, peak = asyncio.run(run_burst(small_cache_server))
    preemptions = small_cache_server.metrics().get(PREEMPTIONS, 0.0) - before

    for (prompt, n), want, got in zip(burst(), expected, results):
        assert got.status == 200 and not got.error, got.error
        assert got.finish_reason == "length" and len(got.token_ids) == n
        assert got.token_ids == want.token_ids, f"prompt of {len(prompt)} tokens differs after preemption"
    assert preemptions > 0, "the burst should not have fit: no preemption happened"
    assert peak[KV_USAGE] > 0.9, f"the cache was never close to full: {peak}"

    small_cache_server.wait_idle(timeout=30)
    stats = small_cache_server.engine_stats()
    assert stats["request_states"] == 0 and stats["batch_rows"] == 0, stats
    figures["kv_exhaustion"] = dict(cache_blocks=NUM_BLOCKS, requests=len(results), blocks_demanded=demand,
                                    preemptions=int(preemptions), peak_kv_usage=round(peak[KV_USAGE], 3),
                                    peak_running=int(peak[RUNNING]), peak_waiting=int(peak[WAITING]))


# --- option fuzz ---


async def _send(client, prompt, extra, streamed):
    body = {**dict(model=SERVED_NAME, prompt=prompt, max_tokens=FUZZ_TOKENS, ignore_eos=True,
                   return_token_ids=True, temperature=0), **extra}
    if streamed and "prompt_logprobs" not in body and body.get("n", 1) == 1 and "logprobs" not in body:
        r = await stream_completion(client, body)
        payload = r.error if r.status != 200 else {"choices": [{"token_ids": r.token_ids, "text": r.text,
                                                                "finish_reason": r.finish_reason}]}
        return body, r.status, payload
    r = await client.post("/v1/completions", json=body)
    return body, r.status_code, (r.json() if r.status_code == 200 else r.text)


def test_options_crossed_with_chunk_and_block_boundaries(small_cache_server, figures):
    todo = cases(48 * SCALE)
    before = small_cache_server.metrics().get(PREEMPTIONS, 0.0)  # (the burst above preempted too)

    async def run():
        async with async_client(small_cache_server) as client:
            results = []
            for wave in range(0, len(todo), 12):  # 12 at once against max_num_seqs=8: queueing + preemption
                batch = todo[wave:wave + 12]
                results += await asyncio.gather(*(_send(client, p, o, (wave + i) % 4 == 0)
                                                  for i, (p, o) in enumerate(batch)))
                assert small_cache_server.alive(), f"the server exited; log: {small_cache_server.log_path}"
            return results

    results = asyncio.run(run())
    failures = []
    for (prompt, _), (body, status, payload) in zip(todo, results):
        problems = check(prompt, body, status, payload)
        if problems:
            failures.append(f"len {len(prompt)} {json.dumps({k: v for k, v in body.items() if k != 'prompt'})}: "
                            + "; ".join(problems))
    assert small_cache_server.alive() and small_cache_server.healthy()
    preemptions = small_cache_server.metrics().get(PREEMPTIONS, 0.0) - before
    figures["option_fuzz"] = {"requests": len(todo), "preemptions": preemptions, "failures": len(failures)}
    assert not failures, "\n".join(failures[:20])
    assert preemptions > 0, "the KV cache was meant to force preemptions"
