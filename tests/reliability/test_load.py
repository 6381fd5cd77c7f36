"""Load: 64 x SCALE concurrent streaming requests of mixed prompt and output
lengths all complete with exactly the requested number of tokens, and each
one's greedy tokens equal the same request run alone (which in turn equals
mlx-lm's own generation, tests/golden_tokens.json). Both runs start
from an empty prefix cache."""

from __future__ import annotations

import asyncio
import time

from reliability_helpers import (GOLDEN, RUNNING, SCALE, WAITING, async_client, complete, completion_body,
                                 percentile, poll_peak, stream_completion)

MAX_TOKENS = 16
NUM_REQUESTS = 64 * SCALE


def requests():
    """(golden prompt index, max_tokens): prompts of 4..571 tokens, outputs of 1..16."""
    return [(i % len(GOLDEN), 1 + (i * 5) % MAX_TOKENS) for i in range(NUM_REQUESTS)]


def test_concurrent_streams_equal_one_at_a_time(server, figures):
    async def run():
        async with async_client(server) as c:
            # Both runs start from an empty prefix cache: each prefills for real.
            await asyncio.to_thread(server.reset_prefix_cache)
            stop = asyncio.Event()
            peak = asyncio.create_task(poll_peak(server, [RUNNING, WAITING], stop))
            start = time.monotonic()
            burst = await asyncio.gather(*(stream_completion(c, completion_body(GOLDEN[p]["prompt_ids"], n))
                                           for p, n in requests()))
            burst_s = time.monotonic() - start
            stop.set()

            await asyncio.to_thread(server.reset_prefix_cache)
            start = time.monotonic()
            alone = []
            for g in GOLDEN:  # one at a time
                alone.append(await complete(c, completion_body(g["prompt_ids"], MAX_TOKENS)))
            sequential_s = time.monotonic() - start
            return alone, sequential_s, burst, burst_s, await peak

    alone, sequential_s, burst, burst_s, peak = asyncio.run(run())

    for g, one in zip(GOLDEN, alone):
        assert one.status == 200 and one.token_ids == g["greedy_ids"][:MAX_TOKENS], g["prompt"][:40]
    failures = []
    for (p, n), r in zip(requests(), burst):
        if r.status != 200 or r.error or r.finish_reason != "length" or r.token_ids != alone[p].token_ids[:n]:
            failures.append((p, n, r.status, r.error, r.finish_reason, len(r.token_ids)))
    assert not failures, f"{len(failures)} of {len(burst)} concurrent requests went wrong: {failures[:5]}"
    assert peak[RUNNING] >= min(NUM_REQUESTS, 32), f"the burst never ran concurrently: {peak}"
    server.wait_idle(timeout=30)

    ttft = [r.first_token_s for r in burst]
    figures["load"] = dict(
        requests=NUM_REQUESTS, prompt_tokens=sum(len(GOLDEN[p]["prompt_ids"]) for p, _ in requests()),
        output_tokens=sum(n for _, n in requests()), burst_s=round(burst_s, 1),
        peak_running=int(peak[RUNNING]), peak_waiting=int(peak[WAITING]),
        ttft_p50_s=round(percentile(ttft, 0.5), 2), ttft_max_s=round(max(ttft), 2),
        one_at_a_time_9x16_tokens_s=round(sequential_s, 1))
