"""KV-cache exhaustion: a server whose cache holds 32 blocks (512 tokens)
receives a burst that needs several times that; the scheduler preempts and
resumes, every request completes, and the greedy tokens equal the same burst
on the default server (whose cache never runs out)."""

from __future__ import annotations

import asyncio

import pytest
from reliability_helpers import (GOLDEN, KV_USAGE, PREEMPTIONS, RUNNING, SCALE, SMOLLM2_BLOCK_BYTES, WAITING,
                                 async_client, completion_body, poll_peak, start_server, stream_completion)

NUM_BLOCKS = 32
MAX_MODEL_LEN = 256
MAX_TOKENS = 64
LONG = GOLDEN[-1]["prompt_ids"]  # 571 tokens


def burst():
    """(prompt, max_tokens): 8 x SCALE prompts of 30..114 tokens that grow by 64
    (admitted on their prompts, they run out of blocks while decoding), plus
    one that fills max_model_len."""
    reqs = [(LONG[i:i + 30 + 12 * (i % 8)], MAX_TOKENS) for i in range(8 * SCALE)]
    reqs.append((LONG[:MAX_MODEL_LEN - 8], 8))
    return reqs


async def run_burst(server):
    async with async_client(server) as c:
        stop = asyncio.Event()
        peak = asyncio.create_task(poll_peak(server, [RUNNING, WAITING, KV_USAGE], stop))
        results = await asyncio.gather(*(stream_completion(c, completion_body(p, n)) for p, n in burst()))
        stop.set()
        return results, await peak


@pytest.fixture(scope="module")
def tiny_server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("kv_exhaustion") / "vllm_serve.log"
    with start_server(model_dir, log, "--kv-cache-memory-bytes", str(NUM_BLOCKS * SMOLLM2_BLOCK_BYTES),
                      "--max-model-len", str(MAX_MODEL_LEN)) as srv:
        yield srv


def test_burst_beyond_the_cache_completes_through_preemption(server, tiny_server, figures):
    expected, _ = asyncio.run(run_burst(server))
    assert all(r.status == 200 and r.finish_reason == "length" for r in expected)

    before = tiny_server.metrics().get(PREEMPTIONS, 0.0)
    results, peak = asyncio.run(run_burst(tiny_server))
    preemptions = tiny_server.metrics().get(PREEMPTIONS, 0.0) - before

    for (prompt, n), want, got in zip(burst(), expected, results):
        assert got.status == 200 and not got.error, got.error
        assert got.finish_reason == "length" and len(got.token_ids) == n
        assert got.token_ids == want.token_ids, f"prompt of {len(prompt)} tokens differs after preemption"
    assert preemptions > 0, "the burst should not have fit: no preemption happened"
    assert peak[KV_USAGE] > 0.9, f"the cache was never close to full: {peak}"

    tiny_server.wait_idle(timeout=30)
    stats = tiny_server.engine_stats()
    assert stats["request_states"] == 0 and stats["batch_rows"] == 0, stats
    demand = sum(-(-(len(p) + n) // 16) for p, n in burst())
    figures["kv_exhaustion"] = dict(cache_blocks=NUM_BLOCKS, requests=len(results), blocks_demanded=demand,
                                    preemptions=int(preemptions), peak_kv_usage=round(peak[KV_USAGE], 3),
                                    peak_running=int(peak[RUNNING]), peak_waiting=int(peak[WAITING]))
