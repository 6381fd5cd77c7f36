"""Ordered neighbour messages (vllm_metal/distributed/comm.py) over a real MLX
ring of 4 processes on loopback, shaped as 2 pipeline stages x 2 tensor-
parallel ranks: per "layer" a chain sum inside each stage, then the stage
hand-over -- all one lazy graph per rank, evaluated once. The arrays are
far larger than a socket buffer, so a send or receive MLX ran out of the
order the code issued them in would deadlock: the processes then time out
and the test fails. Sums are checked against numpy float64 (and must be
bit-identical on a stage's ranks)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import numpy as np

WORKER = textwrap.dedent("""
    import json, os, sys
    from vllm_metal.native import ops  # noqa: F401
    import mlx.core as mx
    import numpy as np
    from vllm_metal.distributed.comm import Comm
    from vllm_metal.distributed.pipeline import Chain
    from vllm_metal.distributed.topology import Topology

    mx.set_default_device(mx.cpu)
    rank, n, layers = int(os.environ["MLX_RANK"]), int(sys.argv[1]), int(sys.argv[2])
    group = mx.distributed.init(strict=True, backend="ring")
    t = Topology(tp=2, pp=2, rank=rank)
    comm = Comm(group, rank)
    chain = Chain(t, comm)
    def own(layer):  # this rank's contribution at a layer: distinct per rank and layer
        return mx.array(np.random.default_rng(1000 * layer + rank).standard_normal(n).astype(np.float32))
    h = mx.zeros((n,), dtype=mx.float32)
    if t.receives:
        h = chain.receive(h)
    for layer in range(layers):
        h = h + comm.chain_sum(own(layer), t.tp_rank, t.tp)
    chain.send(h)
    mx.eval(h, *comm.take_pending())
    np.save(sys.argv[3], np.array(h))
""")


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_stage_chain_sums_and_hand_over_do_not_deadlock_and_are_exact(tmp_path):
    n, layers = 3 << 20, 3  # 12 MiB a message
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(4)]))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = [subprocess.Popen([sys.executable, str(script), str(n), str(layers), str(tmp_path / f"out{r}.npy")],
                              env={**__import__("os").environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hosts)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(4)]
    try:
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} ({'timed out: a deadlock' if p.returncode < 0 else p.returncode}):\n" \
                                  f"{p.stdout.read()[-3000:]}"
    out = [np.load(tmp_path / f"out{r}.npy") for r in range(4)]

    def own(layer, rank):
        return np.random.default_rng(1000 * layer + rank).standard_normal(n).astype(np.float32).astype(np.float64)

    stage0 = sum(own(layer, 0) + own(layer, 1) for layer in range(layers))
    stage1 = stage0 + sum(own(layer, 2) + own(layer, 3) for layer in range(layers))
    assert np.array_equal(out[0], out[1]) and np.array_equal(out[2], out[3])  # one sum, the same bits
    np.testing.assert_allclose(out[0], stage0, atol=1e-4)
    np.testing.assert_allclose(out[2], stage1, atol=1e-4)
