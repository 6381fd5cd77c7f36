"""Starts and stops a real `vllm serve` subprocess on this plugin."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

SERVED_NAME = "smollm2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command() -> list[str]:
    script = Path(sys.executable).parent / "vllm"
    return [str(script)] if script.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


@contextmanager
def vllm_server(model_dir: str, *extra_args: str, env: dict | None = None, log_path: Path | None = None,
                timeout: float = 240.0):
    """Yields (base_url, process); the server is stopped (SIGINT, then kill) on exit."""
    port = free_port()
    cmd = [*vllm_command(), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", SERVED_NAME, "--dtype", "float32", "--max-model-len", "2048",
           "--kv-cache-memory-bytes", str(256 << 20), *extra_args]
    full_env = dict(os.environ, VLLM_METAL_DEVICE="cpu", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a real server: engine in its own process
    full_env.update(env or {})
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, timeout, log_path)
        yield base, proc
    finally:
        stop_server(proc)
        if log_path:
            log.close()


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float, log_path: Path | None = None) -> None:
    """Until `base`/health answers 200; raises if the server exits first or
    is not ready within `timeout` seconds (with the log's tail, if any)."""
    def tail() -> str:
        return f"; log: {log_path}\n{Path(log_path).read_text()[-3000:]}" if log_path else ""

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode} before becoming ready" + tail())
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"vllm serve not ready after {timeout:.0f}s" + tail())
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen, grace: float = 30.0) -> float:
    """SIGINT the server's process group; returns seconds until it exited."""
    start = time.monotonic()
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return time.monotonic() - start
