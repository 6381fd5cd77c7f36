"""Shutdown: SIGTERM or SIGINT to the `vllm serve` process (to the main process
only, as `kill` or a service manager sends it) stops the EngineCore and every
helper process within seconds and leaves no orphan.

With the default --shutdown-timeout 0 vLLM aborts in-flight requests and
force-kills the EngineCore at once (its "[shutdown] Process manager: force
killing remaining processes" warning is expected then). With a grace period
the in-flight requests drain and the EngineCore must exit by itself: nothing
of ours (the C++ thread pool, MLX's threads) may keep it alive.

Known upstream limitation (vLLM 0.32, and intermittently 0.33): after a --shutdown-timeout 0 abort,
streams that already sent their first chunk are never ended by the API
server, and uvicorn waits for those clients to hang up before the API server
process exits; see docs/reliability.md."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import psutil
import pytest
from reliability_helpers import GOLDEN, RUNNING, async_client, completion_body, start_server, stream_completion

STOP_BOUND_S = 15.0
CLIENT_READ_TIMEOUT_S = 10.0  # what a patient client waits for a silent stream


class Clients:
    """Greedy streams of `max_tokens` each, running in a thread while the signal arrives."""

    def __init__(self, server, max_tokens: int, count: int = 4):
        self.results: list = []

        async def run():
            async with async_client(server, timeout=CLIENT_READ_TIMEOUT_S) as c:
                return await asyncio.gather(*(stream_completion(c, completion_body(g["prompt_ids"], max_tokens))
                                              for g in GOLDEN[:count]), return_exceptions=True)

        def main():
            self.results = asyncio.run(run())

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while server.metrics().get(RUNNING, 0) < 1:  # under way
            assert time.monotonic() < deadline, "the streams never started"
            time.sleep(0.05)


def running(p: psutil.Process) -> bool:
    """Alive and not a zombie (a killed child its parent has not reaped yet
    holds nothing but its pid)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in procs if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_sigterm_aborts_in_flight_streams_and_kills_everything(model_dir, tmp_path, figures):
    log = tmp_path / "vllm_serve.log"
    with start_server(model_dir, log) as server:
        tree = server.processes()
        engine = server.engine_core()
        clients = Clients(server, max_tokens=1500)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert not wait_gone([engine], STOP_BOUND_S), "the EngineCore outlived SIGTERM"
        engine_gone_s = time.monotonic() - start
        # The API server (and with it multiprocessing's resource tracker)
        # exits once no client holds a stream open.
        alive = wait_gone(tree, CLIENT_READ_TIMEOUT_S + STOP_BOUND_S)
        for p in alive:
            p.kill()
        assert not alive, f"still running after SIGTERM and every client gone: {alive}"
        all_gone_s = time.monotonic() - start
        clients.thread.join(timeout=30)
        assert not clients.thread.is_alive(), "a client still hangs after the server exited"
    figures.setdefault("shutdown", {}).update(SIGTERM_engine_core_gone_s=round(engine_gone_s, 2),
                                              SIGTERM_api_server_gone_s=round(all_gone_s, 2))
    left_open = [r for r in clients.results if isinstance(r, httpx.ReadTimeout)]
    if left_open:
        pytest.xfail(f"vLLM upstream (0.32, intermittently 0.33): {len(left_open)} in-flight streams were left open by the abort-mode "
                     f"shutdown and ended only by the clients' own {CLIENT_READ_TIMEOUT_S:.0f}s read timeout "
                     "(the API server waited for them); see docs/reliability.md")


def test_sigint_with_grace_drains_and_the_engine_exits_by_itself(model_dir, tmp_path, figures):
    log = tmp_path / "vllm_serve.log"
    with start_server(model_dir, log, "--shutdown-timeout", "30") as server:
        tree = server.processes()
        clients = Clients(server, max_tokens=24)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        alive = wait_gone(tree, STOP_BOUND_S)
        for p in alive:
            p.kill()
        assert not alive, f"still running {STOP_BOUND_S:.0f}s after SIGINT: {alive}"
        stop_s = time.monotonic() - start
        clients.thread.join(timeout=30)
    for r in clients.results:  # drained: every in-flight stream finished
        assert not isinstance(r, BaseException) and r.finish_reason == "length" and len(r.token_ids) == 24, r
    assert "force killing" not in log.read_text(errors="replace"), \
        "the EngineCore did not exit by itself within its grace period"
    figures.setdefault("shutdown", {})["SIGINT_drain_all_gone_s"] = round(stop_s, 2)
