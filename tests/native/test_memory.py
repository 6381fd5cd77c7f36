"""The KV-cache budget, with the device faked."""

from __future__ import annotations

import pytest

from vllm_metal.native import memory

GiB = 1 << 30


def test_explicit_bytes_win():
    assert memory.kv_cache_budget(device="gpu", total=64 * GiB, utilization=0.9, weights=10 * GiB,
                                  other_used=GiB, explicit=123456) == 123456


def test_metal_budget_is_utilization_of_working_set_minus_weights():
    # e.g. a 64 GB Mac whose recommended working set is 48 GiB
    got = memory.kv_cache_budget(device="gpu", total=48 * GiB, utilization=0.9, weights=8 * GiB,
                                 other_used=GiB, explicit=None)
    assert got == int(0.9 * 48 * GiB) - 9 * GiB


def test_cpu_budget_is_capped():
    got = memory.kv_cache_budget(device="cpu", total=24 * GiB, utilization=0.9, weights=GiB,
                                 other_used=GiB, explicit=None)
    assert got == memory.CPU_DEFAULT_KV_CAP_BYTES


def test_no_room_is_a_clear_error():
    with pytest.raises(ValueError, match="no memory left for the KV cache.*--kv-cache-memory-bytes"):
        memory.kv_cache_budget(device="gpu", total=8 * GiB, utilization=0.5, weights=6 * GiB,
                               other_used=0, explicit=None)


def test_wired_limit_uses_metal_working_set(monkeypatch):
    import mlx.core as mx

    calls = []
    monkeypatch.setattr(memory, "metal_device_info", lambda: {"max_recommended_working_set_size": 40 * GiB})
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: calls.append(n), raising=False)
    memory.set_wired_limit("gpu", 50 * GiB)
    memory.set_wired_limit("gpu", 10 * GiB)
    memory.set_wired_limit("cpu", 10 * GiB)  # no-op off Metal
    assert calls == [40 * GiB, 10 * GiB]


def test_total_memory_from_metal_info(monkeypatch):
    monkeypatch.setattr(memory, "metal_device_info", lambda: {"max_recommended_working_set_size": 40 * GiB})
    assert memory.device_total_memory("gpu") == 40 * GiB
