"""Soak: about two hundred mixed requests in a loop (16 in flight) on the shared
server: streaming and not, completions and chat, greedy and seeded sampling,
logprobs, structured output, plus clients that hang up and bad requests.
Zero valid requests fail; at the end nothing runs, and the engine's MLX
active memory, the engine process's RSS and the API server's RSS have not
grown beyond stated bounds."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
from reliability_helpers import (GOLDEN, SCALE, SERVED_NAME, async_client, complete, completion_body,
                                 stream_completion)

NUM_REQUESTS = 192 * SCALE  # 12 of each of the 16 kinds (VLLM_METAL_RELIABILITY_SCALE=10 for a long soak)
IN_FLIGHT = 16
WARM_UP = 24
MiB = 1 << 20
# MLX active memory is the weights plus the KV cache plus nothing else between
# steps: any growth is a leak. RSS moves with allocator caching and Python
# heaps, so it gets room; a leak of even a KiB per request would still show
# at SCALE=10.
MLX_GROWTH_BOUND = 1 * MiB
RSS_GROWTH_BOUND = 64 * MiB
WORDS = GOLDEN[-1]["prompt_ids"]


def make_request(i: int, rng: random.Random):
    """(kind, coroutine factory taking the client, tokens the reply must hold or None)."""
    # 3..63 tokens: one to four KV blocks. What a leak check needs is many requests coming and
    # going, not long prefills (prompts of up to 160 tokens cost ~10% more time).
    prompt = WORDS[rng.randrange(0, 400):][:rng.randrange(3, 64)]
    n = rng.randrange(1, 13)
    kind = i % 16
    if kind == 0:
        return "hang-up", lambda c: stream_completion(c, completion_body(prompt, 200), stop_after_chunks=2), None
    if kind == 1:
        return "bad", lambda c: c.post("/v1/completions", json=completion_body(prompt, n, temperature=-1)), None
    if kind in (2, 3):
        body = dict(model=SERVED_NAME, max_tokens=n, temperature=0.8, seed=i,
                    messages=[{"role": "user", "content": f"Tell me fact number {i}."}])
        return "chat", lambda c: c.post("/v1/chat/completions", json=body), None
    if kind == 4:
        body = completion_body(prompt, n, logprobs=3, temperature=1.0, top_p=0.9, top_k=40, seed=i)
        return "logprobs", lambda c: complete(c, body), n
    if kind == 5:
        body = completion_body(prompt, 8, ignore_eos=False, structured_outputs={"choice": ["yes", "no"]})
        return "choice", lambda c: complete(c, body), None
    if kind % 2:
        return "stream", lambda c: stream_completion(c, completion_body(prompt, n)), n
    return "complete", lambda c: complete(c, completion_body(prompt, n)), n


def check(kind: str, reply, n_expected: int | None) -> str | None:
    """None if the reply is what `kind` should give, else a description."""
    if kind == "hang-up":
        return None if reply.status == 200 else f"status {reply.status}"
    if kind == "bad":
        return None if reply.status_code == 400 else f"bad request got {reply.status_code}"
    if kind == "chat":
        if reply.status_code != 200:
            return f"chat {reply.status_code}: {reply.text[:200]}"
        return None
    if reply.status != 200 or reply.error:
        return f"{kind} {reply.status}: {reply.error}"
    if kind == "choice":
        return None if reply.text in ("yes", "no") else f"choice gave {reply.text!r}"
    return None if len(reply.token_ids) == n_expected else f"{kind}: {len(reply.token_ids)} != {n_expected} tokens"


def snapshot(server) -> dict:
    stats = server.engine_stats()
    return dict(mlx_active=stats["mlx_active_bytes"], engine_rss=server.engine_core().memory_info().rss,
                api_rss=server.processes()[0].memory_info().rss, request_states=stats["request_states"])


def test_soak(server, figures):
    rng = random.Random(7)
    plan = [make_request(i, rng) for i in range(NUM_REQUESTS)]

    async def run(requests):
        failures = []
        gate = asyncio.Semaphore(IN_FLIGHT)
        async with async_client(server, timeout=120) as c:
            async def one(i, kind, factory, n):
                async with gate:
                    try:
                        problem = check(kind, await factory(c), n)
                    except httpx.HTTPError as e:
                        problem = f"{kind}: {type(e).__name__}: {e}"
                    if problem:
                        failures.append((i, problem))
            await asyncio.gather(*(one(i, *request) for i, request in requests))
        return failures

    indexed = list(enumerate(plan))
    failures = asyncio.run(run(indexed[:WARM_UP]))
    server.wait_idle(timeout=30)
    start = snapshot(server)
    t0 = time.monotonic()
    failures += asyncio.run(run(indexed[WARM_UP:]))
    elapsed = time.monotonic() - t0
    server.wait_idle(timeout=30)
    end = snapshot(server)

    assert not failures, f"{len(failures)} of {NUM_REQUESTS} requests failed: {failures[:5]}"
    assert end["request_states"] == 0
    growth = {k: end[k] - start[k] for k in ("mlx_active", "engine_rss", "api_rss")}
    figures["soak"] = dict(requests=NUM_REQUESTS, seconds=round(elapsed, 1),
                           **{f"{k}_start_MiB": round(start[k] / MiB, 1) for k in growth},
                           **{f"{k}_end_MiB": round(end[k] / MiB, 1) for k in growth})
    assert growth["mlx_active"] <= MLX_GROWTH_BOUND, growth
    assert growth["engine_rss"] <= RSS_GROWTH_BOUND * SCALE ** 0.5, growth
    assert growth["api_rss"] <= RSS_GROWTH_BOUND * SCALE ** 0.5, growth
