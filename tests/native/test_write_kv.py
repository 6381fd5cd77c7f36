"""ops.write_kv: functional scatter into the paged cache, donated in place."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.native import ops

address = ops._ext.buffer_address


def random_cache(rng, shape=(16, 8, 2, 32), dtype=mx.float32):
    kc = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    vc = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    mx.eval(kc, vc)
    return kc, vc


def expected_after(cache: np.ndarray, new: np.ndarray, slots) -> np.ndarray:
    flat = cache.reshape(-1, *cache.shape[2:]).copy()
    for i, s in enumerate(slots):
        if s >= 0:
            flat[s] = new[i]
    return flat.reshape(cache.shape)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("form", ["list", "numpy", "mx_materialized", "mx_lazy", "slot_mapping"])
@pytest.mark.parametrize("slots", [[5, 17, 127], [5, -1, 17, -1], [-1, -1], []])
def test_writes_exactly_the_slots(rng, dtype, form, slots):
    kc, vc = random_cache(rng, dtype=dtype)
    before_k, before_v = np.array(kc.astype(mx.float32)), np.array(vc.astype(mx.float32))
    k = mx.array(rng.standard_normal((len(slots), 2, 32)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((len(slots), 2, 32)).astype(np.float32)).astype(dtype)
    mapping = {
        "list": slots,
        "numpy": np.array(slots, np.int64),
        "mx_materialized": mx.array(np.array(slots, np.int32)),
        "mx_lazy": mx.array(np.array(slots, np.int32)) + 0,  # still a graph node
        "slot_mapping": ops.SlotMapping(np.array(slots, np.int64)),  # converted once per step
    }[form]
    kc2, vc2 = ops.write_kv(kc, vc, k, v, mapping)
    np.testing.assert_array_equal(np.array(kc2.astype(mx.float32)),
                                  expected_after(before_k, np.array(k.astype(mx.float32)), slots))
    np.testing.assert_array_equal(np.array(vc2.astype(mx.float32)),
                                  expected_after(before_v, np.array(v.astype(mx.float32)), slots))


def test_one_slot_mapping_serves_every_layer_and_is_checked_per_cache(rng):
    """The runner converts a step's mapping once; each layer's write checks it
    against its own cache (sizes may differ between KV-cache groups)."""
    mapping = ops.SlotMapping(np.array([3, -1, 60], np.int64))
    k = mx.array(rng.standard_normal((3, 2, 32)).astype(np.float32))
    for _ in range(3):  # several layers, one mapping
        kc, vc = random_cache(rng)
        before = np.array(kc)
        kc2, _ = ops.write_kv(kc, vc, k, k, mapping)
        np.testing.assert_array_equal(np.array(kc2), expected_after(before, np.array(k), [3, -1, 60]))
    small_k, small_v = random_cache(rng, shape=(4, 8, 2, 32))  # 32 slots: 60 is out of range
    with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 60 is outside \[-1, 32\)"):
        ops.write_kv(small_k, small_v, k, k, mapping)
    with pytest.raises(ValueError, match=r"slot_mapping must be \[num_tokens\] = \[2\]"):
        ops.write_kv(small_k, small_v, k[:2], k[:2], mapping)
    with pytest.raises(ValueError, match="must hold integers"):
        ops.SlotMapping(np.array([1.5]))
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = -2"):
        ops.write_kv(small_k, small_v, k[:1], k[:1], ops.SlotMapping(np.array([-2])))


def test_donated_in_place_without_peak_growth(rng):
    kc, vc = random_cache(rng, shape=(256, 16, 4, 64))  # 4 MiB each
    k_addr, v_addr = address(kc), address(vc)
    k = mx.array(rng.standard_normal((3, 4, 64)).astype(np.float32))
    mx.eval(k)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for step in range(5):
        kc, vc = ops.write_kv(kc, vc, k, k, [step, 100 + step, -1])  # old refs dropped
        mx.eval(kc, vc)
    assert (address(kc), address(vc)) == (k_addr, v_addr), "cache buffers were copied"
    # A copy of either cache would add >= 4 MiB to the peak.
    assert mx.get_peak_memory() - base < 1 << 20


def test_kept_reference_is_not_clobbered(rng):
    # Holding the old cache keeps it intact: then the write must copy.
    kc, vc = random_cache(rng)
    old = np.array(kc)
    k = mx.ones((1, 2, 32))
    kc2, _ = ops.write_kv(kc, vc, k, k, [3])
    mx.eval(kc2)
    assert np.array_equal(np.array(kc), old)
    assert address(kc2) != address(kc)


def test_out_of_range_slots(rng):
    kc, vc = random_cache(rng)
    k = mx.ones((2, 2, 32))
    for bad in ([3, 128], [-2, 0]):
        with pytest.raises(ValueError, match=r"slot_mapping\[\d\] = -?\d+ is outside \[-1, 128\)"):
            ops.write_kv(kc, vc, k, k, bad)
        with pytest.raises(ValueError, match="is outside"):
            ops.write_kv(kc, vc, k, k, mx.array(bad))
    # A lazy mapping cannot be checked before evaluation: bad slots write nothing.
    before = np.array(kc)
    kc2, _ = ops.write_kv(kc, vc, k * 7, k, mx.array([3, 500]) + 0)
    after = np.array(kc2).reshape(128, 2, 32)
    assert np.all(after[3] == 7)
    after[3] = before.reshape(128, 2, 32)[3]
    assert np.array_equal(after, before.reshape(128, 2, 32))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: dict(a, k=a["k"][0]), "k must be"),
        (lambda a: dict(a, v=a["v"].astype(mx.float16)), "v dtype"),
        (lambda a: dict(a, value_cache=a["value_cache"][:4]), "value_cache"),
        (lambda a: dict(a, key_cache=a["key_cache"][0]), "key_cache must have rank 4"),
        (lambda a: dict(a, slot_mapping=[1]), r"slot_mapping must be \[num_tokens\]"),
        (lambda a: dict(a, slot_mapping=[1.5, 2.0]), "integers"),
        (lambda a: dict(a, k=np.ones((2, 2, 32))), "k must be an mx.array"),
    ],
)
def test_bad_arguments_name_the_problem(rng, change, message):
    kc, vc = random_cache(rng)
    args = dict(key_cache=kc, value_cache=vc, k=mx.ones((2, 2, 32)), v=mx.ones((2, 2, 32)),
                slot_mapping=[0, 1])
    with pytest.raises((ValueError, TypeError), match=message):
        ops.write_kv(**change(args))


@pytest.mark.parametrize("form", ["numpy", "mx_lazy"])
def test_write_cache_single_latent_cache(rng, form):
    # MLA's one cache per layer: [blocks, block_size, 1, kv_lora_rank + rope].
    cache, _ = random_cache(rng, shape=(8, 4, 1, 48))
    before, addr = np.array(cache), address(cache)
    slots = [3, -1, 30]
    x = mx.array(rng.standard_normal((3, 1, 48)).astype(np.float32))
    mapping = np.array(slots) if form == "numpy" else mx.array(np.array(slots, np.int32)) + 0
    cache = ops.write_cache(cache, x, mapping)
    mx.eval(cache)
    np.testing.assert_array_equal(np.array(cache), expected_after(before, np.array(x), slots))
    if form == "numpy":
        assert address(cache) == addr, "the latent cache was copied"
    with pytest.raises(ValueError, match=r"x must be \[num_tokens, 1, 48\]"):
        ops.write_cache(cache, x[:, :, :32], [0, 1, 2])
    with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 32 is outside"):
        ops.write_cache(cache, x, [0, 1, 32])
