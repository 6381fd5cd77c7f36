"""Ranks, stage roles and the layer split (vllm_metal/distributed/topology.py)."""

from __future__ import annotations

import pytest

from vllm_metal.distributed.topology import Topology, parse_partition, split_by_memory, stage_layers


def test_roles_walk_the_ring_one_hop_at_a_time():
    # pp=3 x tp=2: ranks 0-1 stage 0, 2-3 stage 1, 4-5 stage 2 (vLLM's numbering).
    roles = {r: Topology(tp=2, pp=3, rank=r) for r in range(6)}
    assert [(t.pp_rank, t.tp_rank) for t in roles.values()] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [r for r, t in roles.items() if t.receives] == [2, 3, 4, 5]  # from rank - 1
    assert [r for r, t in roles.items() if t.forwards] == [2, 4]  # to the next TP rank of the stage
    assert [r for r, t in roles.items() if t.sends] == [1, 3]  # a stage's last TP rank -> next stage
    # Every message goes to rank + 1: received by it.
    for r, t in roles.items():
        if t.forwards or t.sends:
            assert roles[r + 1].receives


def test_pure_pipeline_and_pure_tensor_parallel_roles():
    pp = [Topology(tp=1, pp=3, rank=r) for r in range(3)]
    assert [(t.receives, t.sends, t.forwards) for t in pp] == [(False, True, False), (True, True, False),
                                                               (True, False, False)]
    tp = [Topology(tp=3, pp=1, rank=r) for r in range(3)]
    assert not any(t.receives or t.sends or t.forwards for t in tp)


def test_bad_topology_is_refused():
    with pytest.raises(ValueError, match="bad topology"):
        Topology(tp=2, pp=2, rank=4)


@pytest.mark.parametrize("free,expected", [
    ([10, 10], [15, 15]),
    ([10, 10, 10], [10, 10, 10]),
    ([10, 10, 10, 10], [8, 8, 7, 7]),  # extra layers on the first stages
    ([30, 10], [22, 8]),  # 1 + 28 x 3/4 = 22
    ([1, 1000], [1, 29]),  # every stage keeps at least one layer
])
def test_split_by_memory(free, expected):
    split = split_by_memory(30, free)
    assert split == expected and sum(split) == 30


def test_split_by_memory_is_proportional_and_total(rng):
    for _ in range(200):
        pp = int(rng.integers(1, 6))
        layers = int(rng.integers(pp, 100))
        free = [int(x) for x in rng.integers(1, 10**12, size=pp)]
        split = split_by_memory(layers, free)
        assert sum(split) == layers and min(split) >= 1
        share = [(layers - pp) * f / sum(free) for f in free]
        assert all(abs(s - 1 - sh) < 1 + 1e-9 for s, sh in zip(split, share))  # within one layer of the share


def test_split_refusals():
    with pytest.raises(ValueError, match="cannot be split over 4"):
        split_by_memory(3, [1, 1, 1, 1])
    with pytest.raises(ValueError, match="no free memory"):
        split_by_memory(8, [5, 0])


def test_partition_from_vllms_variable():
    assert parse_partition("8,8,14", 30, 3) == [8, 8, 14]
    for text, match in [("8,22", "2 entries for 3"), ("8,8,8", "summing to the model's 30"), ("a,b,c", "comma"),
                        ("0,10,20", "positive")]:
        with pytest.raises(ValueError, match=match):
            parse_partition(text, 30, 3)


def test_stage_layers():
    assert [list(stage_layers([2, 3, 1], s)) for s in range(3)] == [[0, 1], [2, 3, 4], [5]]


def test_ring_hostfile_routes(monkeypatch):
    from vllm_metal.distributed.ring import Peer, hostfile, listen_port

    peers = [Peer(rank=r, host="10.0.0.%d" % (r + 1), port=5000 + r, free_memory=1, fingerprint={}) for r in range(3)]
    monkeypatch.delenv("VLLM_METAL_RING_VIA", raising=False)
    assert hostfile(peers, 0) == [["10.0.0.1:5000"], ["10.0.0.2:5001"], ["10.0.0.3:5002"]]
    monkeypatch.setenv("VLLM_METAL_RING_VIA", "1=127.0.0.1:7001, 2=127.0.0.1:7002")
    assert hostfile(peers, 1) == [["10.0.0.1:5000"], ["10.0.0.2:5001"], ["127.0.0.1:7002"]]  # own: where it listens
    monkeypatch.setenv("VLLM_METAL_RING_PORT", "41000")
    assert listen_port("127.0.0.1", 2) == 41002
    monkeypatch.setenv("VLLM_METAL_RING_VIA", "one=host")
    with pytest.raises(ValueError, match="not RANK=HOST:PORT"):
        hostfile(peers, 0)


def test_start_up_exchange_refuses_a_rank_that_differs():
    from vllm_metal.distributed.ring import Peer, exchange

    def peers(fp1):
        return [Peer(0, "h0", 1, 1, {"model": "a", "mlx": "0.32.4"}), Peer(1, "h1", 2, 1, fp1)]

    assert [p.rank for p in exchange(None, lambda _: list(reversed(peers({"model": "a", "mlx": "0.32.4"}))))] == [0, 1]
    with pytest.raises(RuntimeError, match=r"rank 1 \(h1\) does not match rank 0 \(h0\): model: rank 0 has 'a', "
                                           r"rank 1 has 'b'"):
        exchange(None, lambda _: peers({"model": "b", "mlx": "0.32.4"}))
