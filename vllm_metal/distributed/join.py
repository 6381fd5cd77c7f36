"""A worker's start-up in a multi-rank run: join vLLM's process group, meet
the other ranks, open the MLX group, and plan this rank's share.

Bounded: vLLM's gloo group waits `--distributed-timeout-seconds` (the
platform sets VLLM_METAL_DISTRIBUTED_TIMEOUT, 300 s, where unset) for every
rank, and MLX's ring gives up on a peer that never listens.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from vllm.logger import init_logger

from vllm_metal import envs
from vllm_metal.distributed.liveness import Liveness
from vllm_metal.distributed.ring import Peer, exchange, init_group, listen_port
from vllm_metal.distributed.topology import Topology, parse_partition, split_by_memory
from vllm_metal.distributed.plan import ParallelPlan

logger = init_logger("vllm." + __name__)


@dataclass
class Joined:
    topology: Topology
    group: object  # the MLX group over all ranks
    peers: list[Peer]
    plan: ParallelPlan
    liveness: Liveness


def model_digest(model: str) -> str:
    """What identifies the model's files without reading the weights: the
    config and the weight files' names and sizes (paths may differ between
    hosts; contents that differ in size or config are caught). A GGUF
    checkpoint: its file's name and size, and the config beside it if any."""
    from vllm_metal.formats.gguf_checkpoint import find_gguf
    from vllm_metal.formats.model_dir import resolve_model_dir

    gguf = find_gguf(model)
    path = gguf.parent if gguf is not None else resolve_model_dir(model)
    config = path / "config.json"
    h = hashlib.sha256(config.read_bytes() if config.exists() else b"")
    for f in [gguf] if gguf is not None else sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def fingerprint(vllm_config) -> dict:
    """What every rank must agree on (ring.check_fingerprints)."""
    import mlx.core as mx
    import vllm

    from vllm_metal import __version__

    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    return {"vllm-metal": __version__, "vllm": vllm.__version__, "mlx": mx.__version__,
            "model": model_digest(model.model), "dtype": str(model.dtype), "max_model_len": model.max_model_len,
            "block_size": cache.block_size, "tensor_parallel_size": parallel.tensor_parallel_size,
            "pipeline_parallel_size": parallel.pipeline_parallel_size,
            "VLLM_PP_LAYER_PARTITION": os.environ.get("VLLM_PP_LAYER_PARTITION") or None,
            "VLLM_METAL_DEVICE": envs.get("VLLM_METAL_DEVICE") or None}


def free_memory(device: str) -> int:
    """Bytes free for weights and cache on this rank's device: Metal's
    recommended working set less what MLX holds, or available RAM; shared
    evenly by the ranks of this host."""
    import psutil

    from vllm_metal.native.memory import metal_device_info

    if device == "gpu":
        import mlx.core as mx

        total = int(metal_device_info().get("max_recommended_working_set_size", 0))
        free = total - mx.get_active_memory()
    else:
        free = psutil.virtual_memory().available
    return max(int(free), 1)


def host_address(vllm_config) -> str:
    """Where this rank's ring socket listens: loopback on one host; across
    hosts VLLM_HOST_IP (vLLM's own variable) or vLLM's guess of this host's
    address."""
    if vllm_config.parallel_config.nnodes <= 1:
        return "127.0.0.1"
    from vllm.utils.network_utils import get_ip

    return os.environ.get("VLLM_HOST_IP") or get_ip()


def interface_of(address: str) -> str | None:
    """The network interface holding `address` (None if none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


def join(vllm_config, rank: int, local_rank: int, distributed_init_method: str, device: str) -> Joined:
    from vllm.distributed.parallel_state import get_world_group
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    parallel = vllm_config.parallel_config
    host = host_address(vllm_config)
    if parallel.nnodes > 1 and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo (vLLM's start-up group) otherwise takes the address the host
        # name resolves to, often loopback or another network than the one
        # the hosts share (a Thunderbolt bridge): the interface of this
        # host's address instead.
        name = interface_of(host)
        if name is None:
            raise RuntimeError(f"vllm-metal: this host has no interface with address {host} "
                               "(VLLM_HOST_IP); set VLLM_HOST_IP to this host's address on the network the "
                               "hosts share, or GLOO_SOCKET_IFNAME to its interface")
        os.environ["GLOO_SOCKET_IFNAME"] = name
    init_worker_distributed_environment(vllm_config, rank, distributed_init_method, local_rank, "gloo")
    cpu_group = get_world_group().cpu_group
    import torch.distributed as dist

    def gather(obj):
        out = [None] * dist.get_world_size(cpu_group)
        dist.all_gather_object(out, obj, group=cpu_group)
        return out

    def gather_bytes(data: bytes, n: int) -> bytes:  # JACCL's side channel
        return b"".join(gather(bytes(data[:n])))

    topology = Topology(tp=parallel.tensor_parallel_size, pp=parallel.pipeline_parallel_size, rank=rank)
    local_ranks = max(parallel.world_size // max(parallel.nnodes, 1), 1)
    liveness = Liveness(host)
    me = Peer(rank=rank, host=host, port=listen_port(host, rank), free_memory=free_memory(device) // local_ranks,
              fingerprint=fingerprint(vllm_config), liveness_port=liveness.port)
    peers = exchange(me, gather)
    liveness.watch(rank, peers)
    group = init_group(topology, peers, gather_bytes)
    logger.info("vllm-metal rank %d (tp %d/%d, pp %d/%d) joined the MLX group: %s", rank, topology.tp_rank,
                topology.tp, topology.pp_rank, topology.pp, " ".join(f"{p.host}:{p.port}" for p in peers))
    return Joined(topology, group, peers, _plan(topology, group, peers), liveness)


def _plan(topology: Topology, group, peers: list[Peer]) -> ParallelPlan:
    from vllm_metal.distributed.comm import Comm
    from vllm_metal.distributed.pipeline import Chain
    from vllm_metal.distributed.tensor_parallel import all_sum_reduce

    stage_free = [min(p.free_memory for p in peers[s * topology.tp:(s + 1) * topology.tp])
                  for s in range(topology.pp)]

    def layer_split(num_layers: int) -> list[int]:
        text = os.environ.get("VLLM_PP_LAYER_PARTITION")
        split = parse_partition(text, num_layers, topology.pp) if text else split_by_memory(num_layers, stage_free)
        logger.info("vllm-metal layer split over %d stages: %s (%s)", topology.pp, split,
                    "VLLM_PP_LAYER_PARTITION" if text else "by free memory: " +
                    ", ".join(f"{f / 2**30:.1f} GiB" for f in stage_free))
        return split

    comm = Comm(group, topology.rank)
    reduce = None
    if topology.tp > 1 and topology.pp == 1:
        reduce = all_sum_reduce(group)  # the group is the TP group: MLX's ring all-reduce
    elif topology.tp > 1:
        # A stage's ranks only: MLX's ring has no sub-groups; a chain over
        # the stage's neighbouring ranks, ordered with the stage transfers.
        def reduce(x):
            return comm.chain_sum(x, topology.tp_rank, topology.tp)
    return ParallelPlan(tp_rank=topology.tp_rank, tp=topology.tp, reduce=reduce,
                        pp_rank=topology.pp_rank, pp=topology.pp, layer_split=layer_split,
                        transport=Chain(topology, comm) if topology.pp > 1 else None)
