"""Every rank watches every other: a rank that dies or becomes unreachable
stops the run within seconds instead of leaving it waiting.

vLLM's executor watches the worker processes of its own host only; across
hosts, a step waits for a lost rank's answer until
VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s). So each pair of ranks keeps one
idle TCP connection with keepalive probes. A peer process that exits closes
it at once (its kernel does), an unreachable host fails the probes
(~KEEPALIVE_IDLE + KEEPALIVE_COUNT x KEEPALIVE_INTERVAL seconds); either way
this rank logs which peer it lost and exits -- vLLM's monitor on the
engine's host sees its local workers go, fails the requests in flight and
stops the server. A rank that shuts down in order says goodbye first.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 5, 2, 3
BYE = b"B"
EXIT_CODE = 70

logger = logging.getLogger("vllm." + __name__)


def _keepalive(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = getattr(socket, "TCP_KEEPIDLE", None) or getattr(socket, "TCP_KEEPALIVE", None)  # Linux / macOS
    if idle is not None:
        s.setsockopt(socket.IPPROTO_TCP, idle, KEEPALIVE_IDLE)
    if hasattr(socket, "TCP_KEEPINTVL"):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL)
    if hasattr(socket, "TCP_KEEPCNT"):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)


class Liveness:
    """Listens before the exchange (its port goes into this rank's Peer),
    then `watch` connects the pairs: rank i connects to every rank j > i."""

    def __init__(self, host: str):
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.closing = False
        self.sockets: list[socket.socket] = []

    def watch(self, rank: int, peers, timeout: float = 60.0, on_lost=None) -> None:
        """Connects to every peer (listed with .rank, .host, .liveness_port)
        and starts one watcher thread per connection."""
        on_lost = on_lost or _exit
        names = {p.rank: f"rank {p.rank} ({p.host})" for p in peers}
        for peer in peers:
            if peer.rank > rank:
                s = socket.create_connection((peer.host, peer.liveness_port), timeout=timeout)
                s.sendall(rank.to_bytes(4, "little"))
                self._start(s, names[peer.rank], on_lost)
        self.listener.settimeout(timeout)
        for _ in range(rank):
            s, _ = self.listener.accept()
            s.settimeout(timeout)
            other = int.from_bytes(_read(s, 4), "little")
            self._start(s, names.get(other, f"rank {other}"), on_lost)
        self.listener.close()

    def _start(self, s: socket.socket, name: str, on_lost) -> None:
        s.settimeout(None)
        _keepalive(s)
        self.sockets.append(s)
        threading.Thread(target=self._wait, args=(s, name, on_lost), daemon=True,
                         name=f"vllm-metal-liveness-{name}").start()

    def _wait(self, s: socket.socket, name: str, on_lost) -> None:
        try:
            data = s.recv(1)
        except OSError as e:
            data, why = b"", f"{type(e).__name__}: {e}"
        else:
            why = "its connection closed"
        if data == BYE or self.closing:
            return
        on_lost(f"vllm-metal: lost {name}: {why} (the process died or the host is unreachable); this rank "
                "stops, and with it the run")

    def close(self) -> None:
        """An orderly stop: tells the peers this is no failure."""
        self.closing = True
        for s in self.sockets:
            try:
                s.sendall(BYE)
                s.close()
            except OSError:
                pass


def _read(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed the liveness connection during start-up")
        data += chunk
    return data


def _exit(message: str) -> None:
    logger.error(message)
    for handler in logging.getLogger("vllm").handlers:
        handler.flush()
    os._exit(EXIT_CODE)
