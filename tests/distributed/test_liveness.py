"""Ranks watching each other (vllm_metal/distributed/liveness.py): a peer that
dies is reported at once, naming it; an orderly stop is not a failure."""

from __future__ import annotations

import threading
import time

from vllm_metal.distributed.liveness import Liveness
from vllm_metal.distributed.ring import Peer


def mesh(n: int):
    """n Liveness objects connected as ranks 0..n-1; returns them and the losses each reported."""
    nodes = [Liveness("127.0.0.1") for _ in range(n)]
    peers = [Peer(rank=r, host="127.0.0.1", port=0, free_memory=1, fingerprint={}, liveness_port=node.port)
             for r, node in enumerate(nodes)]
    lost = [[] for _ in range(n)]
    threads = [threading.Thread(target=node.watch, args=(r, peers, 10.0, lost[r].append))
               for r, node in enumerate(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(len(node.sockets) == n - 1 for node in nodes)
    return nodes, lost


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not cond():
        time.sleep(0.02)
    return cond()


def test_a_peer_that_dies_is_reported_by_every_other_rank():
    nodes, lost = mesh(3)
    import socket

    nodes[2].closing = True  # rank 2 "dies": its connections close without a goodbye (and it reports nothing)
    for s in nodes[2].sockets:
        s.shutdown(socket.SHUT_RDWR)
    assert wait_for(lambda: lost[0] and lost[1])
    assert "lost rank 2 (127.0.0.1)" in lost[0][0] and "lost rank 2" in lost[1][0]
    assert not lost[2]
    for node in nodes[:2]:
        node.close()


def test_an_orderly_stop_is_no_failure():
    nodes, lost = mesh(2)
    nodes[1].close()
    time.sleep(0.3)
    assert lost == [[], []]
    nodes[0].close()
    time.sleep(0.2)
    assert lost == [[], []]
