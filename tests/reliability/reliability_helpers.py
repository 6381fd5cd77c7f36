"""What the reliability tests share: the scale knob, a handle on a running
`vllm serve` (its /metrics, its processes, the engine's memory), an SSE
streaming client, and the figures the suite reports."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

TESTS = Path(__file__).resolve().parent.parent

from server_helpers import SERVED_NAME, vllm_server  # noqa: E402

# Multiplies request counts, durations and fuzz cases; 1 is the CI size.
SCALE = max(1, int(os.environ.get("VLLM_METAL_RELIABILITY_SCALE", "1")))
GOLDEN = json.loads((TESTS / "golden_tokens.json").read_text())

# vLLM 0.33's Prometheus gauge names (unchanged since 0.32) (vllm/v1/metrics/loggers.py).
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"

# One KV-cache block of the embedded SmolLM2 in float32: 30 layers x (K, V)
# x 16 tokens x 3 kv heads x 64 dims x 4 bytes.
SMOLLM2_BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4
# Dev endpoints: POST /collective_rpc (MetalWorker.memory_stats), POST /reset_prefix_cache.
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
SERVER_ARGS = ("--enable-scale-out",)  # POST /inference/v1/abort_requests


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value summed over label sets} ({name}{label} kept too)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        out[name] = out.get(name, 0.0) + value
        if labels:
            out[name + labels] = value
    return out


@dataclass
class Server:
    """A running `vllm serve` started by server_helpers.vllm_server."""

    base: str
    proc: object  # subprocess.Popen
    log_path: Path

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.base + "/metrics", timeout=30).text)

    def engine_stats(self) -> dict[str, int]:
        """MetalWorker.memory_stats(), read in the engine process."""
        r = httpx.post(self.base + "/collective_rpc", json={"method": "memory_stats"}, timeout=60)
        r.raise_for_status()
        return r.json()["results"][0]

    def reset_prefix_cache(self) -> None:
        """Forget cached prompt blocks (dev endpoint), so the next requests prefill for real."""
        r = httpx.post(self.base + "/reset_prefix_cache", timeout=60)
        r.raise_for_status()
        assert r.json()["success"], "the prefix cache could not be reset (blocks still held?)"

    def processes(self) -> list[psutil.Process]:
        """The API server and every process below it."""
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def engine_core(self) -> psutil.Process:
        found = [p for p in self.processes() if "EngineCore" in " ".join(_names(p))]
        assert len(found) == 1, f"expected one EngineCore process, found {found}"
        return found[0]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            return httpx.get(self.base + "/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_idle(self, timeout: float) -> float:
        """Seconds until nothing runs, nothing waits and no KV block is in use.
        Raises AssertionError with the last metrics after `timeout`."""
        start = time.monotonic()
        while True:
            m = self.metrics()
            if m.get(RUNNING) == 0 and m.get(WAITING) == 0 and m.get(KV_USAGE) == 0:
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise AssertionError(f"not idle after {timeout:.0f}s: running={m.get(RUNNING)} "
                                     f"waiting={m.get(WAITING)} kv_usage={m.get(KV_USAGE)}")
            time.sleep(0.05)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def _names(p: psutil.Process) -> list[str]:
    try:
        return [p.name(), *p.cmdline()]
    except psutil.Error:
        return []


@contextmanager
def start_server(model_dir: str, log_path: Path, *extra_args: str, env: dict | None = None):
    """A `vllm serve` with the reliability defaults (dev endpoints, abort API), as a Server."""
    with vllm_server(model_dir, *SERVER_ARGS, *extra_args, env={**SERVER_ENV, **(env or {})},
                     log_path=log_path) as (base, proc):
        yield Server(base, proc, log_path)


@dataclass
class StreamResult:
    status: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    first_token_s: float | None = None
    total_s: float = 0.0


def completion_body(prompt, max_tokens: int, **kwargs) -> dict:
    """A greedy completion that runs exactly max_tokens and returns token ids."""
    body = dict(model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                return_token_ids=True)
    body.update(kwargs)
    return body


async def stream_completion(client: httpx.AsyncClient, body: dict, *, headers: dict | None = None,
                            stop_after_chunks: int | None = None) -> StreamResult:
    """POST a streaming /v1/completions and collect it; with stop_after_chunks
    the client hangs up after that many data chunks (a dropped client)."""
    start = time.monotonic()
    result = StreamResult(status=0)
    chunks = 0
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True},
                             headers=headers) as resp:
        result.status = resp.status_code
        if resp.status_code != 200:
            result.error = (await resp.aread()).decode(errors="replace")
            return result
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = json.dumps(chunk["error"])
                break
            for choice in chunk["choices"]:
                result.token_ids += choice.get("token_ids") or []
                result.text += choice.get("text") or ""
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
            if result.first_token_s is None and result.token_ids:
                result.first_token_s = time.monotonic() - start
            chunks += 1
            if stop_after_chunks is not None and chunks >= stop_after_chunks:
                break  # leaving the context manager closes the connection
    result.total_s = time.monotonic() - start
    return result


async def complete(client: httpx.AsyncClient, body: dict) -> StreamResult:
    """A non-streaming /v1/completions as a StreamResult."""
    start = time.monotonic()
    r = await client.post("/v1/completions", json=body)
    result = StreamResult(status=r.status_code, total_s=time.monotonic() - start)
    if r.status_code != 200:
        result.error = r.text
        return result
    choice = r.json()["choices"][0]
    result.token_ids = choice.get("token_ids") or []
    result.text = choice["text"]
    result.finish_reason = choice["finish_reason"]
    return result


def async_client(server: Server, timeout: float = 300.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.base, timeout=timeout,
                             limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64))


async def poll_peak(server: Server, names: list[str], stop: asyncio.Event, every: float = 0.2) -> dict:
    """Highest value seen for each metric until `stop` is set."""
    peak = {n: 0.0 for n in names}
    async with httpx.AsyncClient(base_url=server.base, timeout=30) as c:
        while not stop.is_set():
            m = parse_metrics((await c.get("/metrics")).text)
            for n in names:
                peak[n] = max(peak[n], m.get(n, 0.0))
            try:
                await asyncio.wait_for(stop.wait(), every)
            except asyncio.TimeoutError:
                pass
    return peak


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")
