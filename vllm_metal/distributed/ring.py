"""The data plane's bring-up: one MLX distributed group over all ranks.

vLLM's control plane (its executor, message queues and a gloo process
group) starts the workers; each then opens an MLX group so that stage
transfers and tensor-parallel sums are nodes of the step's MLX graph. The
ranks meet once over vLLM's gloo world group: each says where its ring
socket listens, how much memory it has free and what it is about to serve;
a rank that disagrees on the model or the versions stops start-up with a
message naming the host. Then every rank writes the same MLX hostfile
(rank order = vLLM's rank order: topology.py) and initialises MLX's ring
backend (TCP; any Mac, any Linux), or JACCL (RDMA over Thunderbolt 5 on
Macs that have it: VLLM_METAL_DISTRIBUTED_BACKEND=jaccl, with MLX's own
MLX_IBV_DEVICES; its side channel is the same gloo group).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import dataclass

from vllm_metal import envs
from vllm_metal.distributed.topology import Topology

BACKENDS = ("ring", "jaccl")


@dataclass(frozen=True)
class Peer:
    """What one rank tells the others at start-up."""

    rank: int
    host: str  # the address its ring socket listens on
    port: int
    free_memory: int  # bytes the device has free for weights and cache
    fingerprint: dict  # what must be identical on every rank (check_fingerprints)
    liveness_port: int = 0  # distributed/liveness.py


def backend_name() -> str:
    name = (envs.get("VLLM_METAL_DISTRIBUTED_BACKEND") or "ring").strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"VLLM_METAL_DISTRIBUTED_BACKEND={name!r}: use one of {', '.join(BACKENDS)}")
    return name


def free_port(host: str) -> int:
    """A port free on `host` now (the ring listens on it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]


def check_fingerprints(peers: list[Peer]) -> None:
    """Every rank must serve the same model with the same software: a rank
    that differs from rank 0 is named with the fields that differ."""
    base = peers[0]
    for peer in peers[1:]:
        diff = {k: (base.fingerprint.get(k), peer.fingerprint.get(k))
                for k in sorted(set(base.fingerprint) | set(peer.fingerprint))
                if base.fingerprint.get(k) != peer.fingerprint.get(k)}
        if diff:
            text = "; ".join(f"{k}: rank 0 has {a!r}, rank {peer.rank} has {b!r}" for k, (a, b) in diff.items())
            raise RuntimeError(f"vllm-metal: rank {peer.rank} ({peer.host}) does not match rank 0 "
                               f"({base.host}): {text}. Every host must run the same vllm-metal, vLLM and MLX "
                               "versions on the same model files.")


def exchange(me: Peer, gather) -> list[Peer]:
    """All ranks' Peers, in rank order, through `gather` (an all-gather of
    picklable objects: vLLM's gloo world group)."""
    peers = gather(me)
    peers = sorted(peers, key=lambda p: p.rank)
    if [p.rank for p in peers] != list(range(len(peers))):
        raise RuntimeError(f"vllm-metal: start-up exchange got ranks {[p.rank for p in peers]}")
    check_fingerprints(peers)
    return peers


def listen_port(host: str, rank: int) -> int:
    """VLLM_METAL_RING_PORT=P: rank r listens on P + r (ports to open in a
    firewall); otherwise any free port."""
    base = envs.get("VLLM_METAL_RING_PORT")
    return int(base) + rank if base else free_port(host)


def routes() -> dict[int, str]:
    """VLLM_METAL_RING_VIA="1=host:port,2=host:port": where the other ranks
    reach rank r when that is not where it listens (a forwarded port, a
    relay; benchmarks/bench_pipeline.py puts a delaying proxy there)."""
    text = (envs.get("VLLM_METAL_RING_VIA") or "").strip()
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        rank, sep, address = item.partition("=")
        if not sep or not rank.strip().isdigit() or ":" not in address:
            raise ValueError(f"VLLM_METAL_RING_VIA: {item!r} is not RANK=HOST:PORT")
        out[int(rank)] = address.strip()
    return out


def hostfile(peers: list[Peer], me: int) -> list[list[str]]:
    """MLX's ring hostfile as rank `me` writes it: its own entry is where it
    listens, the others' where it reaches them (VLLM_METAL_RING_VIA)."""
    via = routes()
    return [[f"{p.host}:{p.port}" if p.rank == me or p.rank not in via else via[p.rank]] for p in peers]


def init_group(topology: Topology, peers: list[Peer], gather_bytes=None):
    """The MLX group over every rank (ring or JACCL)."""
    import mlx.core as mx

    backend = backend_name()
    if not mx.distributed.is_available(backend):
        raise RuntimeError(f"vllm-metal: MLX's {backend} distributed backend is not available here")
    if backend == "ring":
        path = os.path.join(tempfile.mkdtemp(prefix="vllm-metal-ring-"), "hosts.json")
        with open(path, "w") as f:
            json.dump(hostfile(peers, topology.rank), f)
        os.environ["MLX_HOSTFILE"] = path
        os.environ["MLX_RANK"] = str(topology.rank)
        group = mx.distributed.init(strict=True, backend="ring")
    else:
        os.environ["MLX_RANK"] = str(topology.rank)
        os.environ["MLX_WORLD_SIZE"] = str(topology.world)
        group = mx.distributed.init(strict=True, backend="jaccl",
                                    all_gather_factory=lambda rank, size: gather_bytes)
    if group.size() != topology.world or group.rank() != topology.rank:
        raise RuntimeError(f"vllm-metal: MLX {backend} group is rank {group.rank()} of {group.size()}, "
                           f"expected rank {topology.rank} of {topology.world}")
    return group
