"""Disconnects and aborts: clients that hang up (mid-stream, while waiting for
a non-streaming reply, while still queued) and requests cancelled through the
API are aborted promptly; afterwards no request runs or waits, KV-cache usage
is back to zero and the runner holds no request state."""

from __future__ import annotations

import asyncio
import time

import httpx
from reliability_helpers import (GOLDEN, RUNNING, WAITING, async_client, completion_body, stream_completion)

# Long enough that finishing instead of aborting would take far longer than
# the bounds below (~0.1 s per decode step here).
LONG_OUTPUT = 400
# An abort lands between engine steps; with no long prefill in the batch a
# step is a fraction of a second.
PROMPT_ABORT_S = 5.0


def assert_clean(server, timeout: float = 10.0) -> dict:
    """The runner holds no request. It drops an aborted request when the next
    engine step brings vLLM's finished_req_ids, which follows the scheduler
    going idle (what wait_idle reads) by a step: seconds at most, even on a
    loaded machine."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.engine_stats()
        if stats["request_states"] == 0 and stats["batch_rows"] == 0:
            return stats
        assert time.monotonic() < deadline, f"runner still holds requests after {timeout:.0f}s: {stats}"
        time.sleep(0.1)


def wait_running(server, at_least: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while server.metrics().get(RUNNING, 0) < at_least:
        assert time.monotonic() < deadline, f"fewer than {at_least} requests ever ran"
        time.sleep(0.05)


def test_streams_dropped_mid_stream_are_aborted(server, figures):
    async def run():
        async with async_client(server) as c:
            return await asyncio.gather(*(
                stream_completion(c, completion_body(GOLDEN[i]["prompt_ids"], LONG_OUTPUT), stop_after_chunks=3 + i)
                for i in range(8)))

    results = asyncio.run(run())
    assert all(r.status == 200 and len(r.token_ids) >= 3 for r in results)
    idle_s = server.wait_idle(timeout=PROMPT_ABORT_S)
    assert_clean(server)
    figures.setdefault("disconnects", {})["mid_stream_drop_to_idle_s"] = round(idle_s, 2)


def test_non_streaming_clients_that_hang_up_are_aborted(server, figures):
    async def run():
        async with httpx.AsyncClient(base_url=server.base, timeout=2.0) as c:
            async def impatient(i):
                try:
                    await c.post("/v1/completions", json=completion_body(GOLDEN[i]["prompt_ids"], LONG_OUTPUT))
                except httpx.TimeoutException:
                    return "hung up"
                return "finished"
            return await asyncio.gather(*(impatient(i) for i in range(6)))

    assert asyncio.run(run()) == ["hung up"] * 6
    idle_s = server.wait_idle(timeout=PROMPT_ABORT_S)
    assert_clean(server)
    figures.setdefault("disconnects", {})["non_streaming_hangup_to_idle_s"] = round(idle_s, 2)


def test_abort_through_the_api(server, figures):
    """POST /inference/v1/abort_requests (vllm serve --enable-scale-out) with
    the ids the client chose (X-Request-Id): the streams end with
    finish_reason "abort"."""
    ids = [f"reliability-abort-{i}" for i in range(4)]

    async def run():
        async with async_client(server) as c:
            streams = [asyncio.create_task(stream_completion(
                c, completion_body(GOLDEN[i]["prompt_ids"], LONG_OUTPUT), headers={"X-Request-Id": rid}))
                for i, rid in enumerate(ids)]
            await asyncio.to_thread(wait_running, server, len(ids))
            r = await c.post("/inference/v1/abort_requests", json={"request_ids": [f"cmpl-{rid}-0" for rid in ids]})
            assert r.status_code == 200, r.text
            start = time.monotonic()
            results = await asyncio.gather(*streams)
            return results, time.monotonic() - start

    results, end_s = asyncio.run(run())
    for r in results:
        assert r.status == 200 and r.finish_reason == "abort", (r.finish_reason, r.error)
        assert len(r.token_ids) < LONG_OUTPUT
    idle_s = server.wait_idle(timeout=PROMPT_ABORT_S)
    assert_clean(server)
    figures.setdefault("disconnects", {}).update(api_abort_to_stream_end_s=round(end_s, 2),
                                                 api_abort_to_idle_s=round(end_s + idle_s, 2))


def test_queued_requests_dropped_before_their_first_token(server, figures):
    """More long prompts than the cache holds at once: some run, the rest wait.
    Every client hangs up; running and waiting requests are all aborted. The
    last abort can wait for the prefill step in progress (one step of up to
    max_num_batched_tokens=2048 tokens, seconds on a small CPU)."""
    long = GOLDEN[-1]["prompt_ids"]

    async def run():
        async with async_client(server) as c:
            tasks = [asyncio.create_task(stream_completion(c, completion_body(long[i:], 900))) for i in range(12)]
            deadline = time.monotonic() + 120
            while server.metrics().get(WAITING, 0) == 0:  # metrics are published after each step
                assert time.monotonic() < deadline, "nothing ever waited"
                await asyncio.sleep(0.1)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())
    idle_s = server.wait_idle(timeout=60)
    assert_clean(server)
    figures.setdefault("disconnects", {})["queued_drop_to_idle_s"] = round(idle_s, 2)
