"""The adapter pool on a loaded model (fused projections, as the CPU device
serves): each token's delta is its own adapter's x @ A @ B * scale (numpy
float64), a base row's an exact zero; the projections an adapter may name
are the ones the model computes; loading, eviction and pinning; adapters
that do not fit the model refused with the reason."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from families import build
from lora_adapters import make_mlx_adapter

from vllm.lora.request import LoRARequest

from vllm_metal.adapters.adapter_files import AdapterError, read_adapter
from vllm_metal.adapters.pool import AdapterPool
from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs
from vllm_metal.models.loader import load_model


@pytest.fixture(scope="module")
def base(model_dir, tmp_path_factory) -> str:
    return build("llama", tmp_path_factory.mktemp("lora-pool") / "llama", model_dir)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("lora-pool")
    return [make_mlx_adapter(base, root / "kv", rank=4, scale=2.0, keys=["self_attn.k_proj", "self_attn.v_proj"],
                             num_layers=3, seed=1),
            make_mlx_adapter(base, root / "all", rank=8, scale=0.5, num_layers=3, seed=2),
            make_mlx_adapter(base, root / "third", rank=2, scale=1.0, num_layers=1, seed=3)]


def pool_for(model_dir: str, capacity: int = 4, max_loras: int = 2, extra=None):
    m = load_model(model_dir, fuse=True, norm_rope=True)
    if extra is not None:
        extra(m)
    pool = AdapterPool(m, m.dtype, max_rank=16, max_loras=max_loras, capacity=capacity)
    kv = m.allocate_kv(8, [16], [0] * m.num_layers)
    inputs = build_step_inputs([ScheduledRow([1, 2, 3], 0, [[1]])], [16])
    pool.trace()
    mx.eval(m.forward(kv, inputs, np.array([2])))
    pool.seal()
    return m, pool


def request(i: int, path: str) -> LoRARequest:
    return LoRARequest(f"adapter-{i}", i, path)


def test_targets_are_the_projections_the_model_computes(base):
    m, pool = pool_for(base)
    assert m.fused["qkv"] == 3 and m.fused["gate_up"] == 3  # fusion stays on with LoRA
    names = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj"}
    assert set(pool.targets) == {(i, n) for i in range(3) for n in names}
    fused = {pool.sites[t.site].name for t in pool.targets.values()}
    assert fused == {"self_attn.fused_qkv_proj", "self_attn.o_proj", "mlp.fused_gate_up_proj", "mlp.down_proj"}


@pytest.mark.parametrize("counts", [[3, 2, 1, 2], [30, 20, 10, 12]])
def test_each_token_gets_its_own_adapters_delta(counts, base, adapters, rng):
    _, pool = pool_for(base)
    reqs = [request(1, adapters[0]), request(2, adapters[1])]
    for r in reqs:
        pool.add(r)
    rows = [reqs[0], None, reqs[1], reqs[0]]
    counts = np.array(counts)
    pool.begin_step(rows, counts)
    tokens = int(counts.sum())
    per_token = np.repeat(np.arange(4), counts)
    read = {r.lora_int_id: {(mo.layer, mo.path): mo for mo in read_adapter("x", r.lora_path, 16).modules}
            for r in reqs}
    for layer, member in [(1, "self_attn.k_proj"), (1, "self_attn.q_proj"), (2, "mlp.up_proj"), (0, "mlp.down_proj")]:
        target = pool.targets[(layer, member)]
        site = pool.sites[target.site]
        x = rng.standard_normal((1, tokens, site.in_dims)).astype(np.float32)
        got = np.array(pool.apply(target.site, mx.array(x), mx.zeros((1, tokens, site.out_dims)))[0]).astype(np.float64)
        for t in range(tokens):
            request_of_row = rows[per_token[t]]
            mod = read[request_of_row.lora_int_id].get((layer, member)) if request_of_row is not None else None
            want = np.zeros(site.out_dims)
            if mod is not None:
                want[target.lo:target.hi] = x[0, t].astype(np.float64) @ mod.a @ mod.b * mod.scale
            if request_of_row is None:
                assert (got[t, target.lo:target.hi] == 0).all()  # a base row: exactly nothing added
            np.testing.assert_allclose(got[t, target.lo:target.hi], want[target.lo:target.hi], atol=1e-5)
    pool.end_step()
    y = mx.ones((1, tokens, 64))
    assert pool.apply(0, mx.zeros((1, tokens, 64)), y) is y  # no step: the base projection alone


def test_a_step_of_one_adapter_needs_no_mask(base, adapters, rng):
    _, pool = pool_for(base)
    r = request(2, adapters[1])
    pool.begin_step([r, r], np.array([2, 3]))
    assert pool.step.uniform
    mods = {(m.layer, m.path): m for m in read_adapter("x", r.lora_path, 16).modules}
    site = pool.sites[pool.targets[(1, "mlp.gate_proj")].site]  # the fused gate/up matmul
    x = rng.standard_normal((1, 5, site.in_dims)).astype(np.float32)
    y = rng.standard_normal((1, 5, site.out_dims)).astype(np.float32)
    got = np.array(pool.apply(site.index, mx.array(x), mx.array(y))[0]).astype(np.float64)
    want = y[0].astype(np.float64)
    for member in ("mlp.gate_proj", "mlp.up_proj"):
        target, mod = pool.targets[(1, member)], mods[(1, member)]
        want[:, target.lo:target.hi] += x[0].astype(np.float64) @ mod.a @ mod.b * mod.scale
    np.testing.assert_allclose(got, want, atol=1e-5)
    pool.end_step()
    pool.begin_step([r, None], np.array([2, 3]))
    assert not pool.step.uniform  # a base row: masked


def test_a_slot_swap_changes_no_other_rows_delta(base, adapters, rng):
    """Row 0's delta alone, beside another adapter in either slot order, is the same."""
    _, pool = pool_for(base, max_loras=3)
    a, b = request(1, adapters[0]), request(2, adapters[1])
    target = pool.targets[(2, "self_attn.v_proj")]
    x = mx.array(rng.standard_normal((1, 3, pool.sites[target.site].in_dims)).astype(np.float32))
    results = []
    for rows in ([a], [a, b], [b, a]):
        counts = np.ones(len(rows), int)
        if rows[0] is not a:
            counts = counts[::-1].copy()
            rows = rows[::-1]
        pool.begin_step(rows + [None] * (3 - len(rows)), np.concatenate([counts, np.ones(3 - len(rows), int)]))
        zeros = mx.zeros((1, 3, pool.sites[target.site].out_dims))
        results.append(np.array(pool.apply(target.site, x, zeros)[0, 0]))
        pool.end_step()
    # Another adapter only adds exact zeros to row 0's sum (float rounding of the BLAS blocking aside).
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results[2], results[0], rtol=1e-5, atol=1e-6)


def test_loading_evicts_the_least_recently_used_never_a_pinned_one(base, adapters):
    _, pool = pool_for(base, capacity=2, max_loras=1)
    r1, r2, r3 = (request(i + 1, p) for i, p in enumerate(adapters))
    pool.add(r1)
    pool.add(r2)
    assert pool.list() == {1, 2}
    pool.pin(1)
    pool.add(r3)  # 2 is the least recently used unpinned one
    assert pool.list() == {1, 3}
    pool.pin(3)
    with pytest.raises(AdapterError, match="are pinned or in use"):
        pool.add(r2)
    assert pool.list() == {1, 3}  # nothing already accepted is lost
    assert pool.remove(3) and not pool.remove(3)
    with pytest.raises(ValueError, match="not loaded"):
        pool.pin(3)
    pool.begin_step([r2], np.array([1]))  # a request naming an unloaded adapter loads it
    assert 2 in pool.list()
    pool.end_step()


def rename(src: str, dst: Path, old: str, new: str, shape_change=None) -> str:
    shutil.copytree(src, dst)
    weights = dict(mx.load(str(dst / "adapters.safetensors")))
    out = {}
    for k, v in weights.items():
        k2 = k.replace(old, new)
        out[k2] = shape_change(k2, v) if shape_change else v
    mx.save_safetensors(str(dst / "adapters.safetensors"), out)
    return str(dst)


@pytest.mark.parametrize("case,words", [
    ("unknown-module", "layer 2 self_attn.qkv_proj: not a projection this model computes (targets of layer 2: "
                       "mlp.down_proj, mlp.gate_proj, mlp.up_proj, self_attn.k_proj, self_attn.o_proj, "
                       "self_attn.q_proj, self_attn.v_proj)"),
    ("layer-beyond", ": the model has 3 layers"),
    ("other-hidden-size", "layer 2 self_attn.q_proj: the adapter maps 32 -> 64 features, the model's projection "
                          "64 -> 64"),
])
def test_adapter_that_does_not_fit_the_model_is_refused(case, words, base, adapters, tmp_path):
    _, pool = pool_for(base)
    src = adapters[2]  # layer 2 only
    if case == "unknown-module":
        path = rename(src, tmp_path / case, "self_attn.q_proj", "self_attn.qkv_proj")
    elif case == "layer-beyond":
        path = rename(src, tmp_path / case, "layers.2.", "layers.7.")
    else:
        path = rename(src, tmp_path / case, "", "", lambda k, v: v[:32] if k.endswith("q_proj.lora_a") else v)
    pool.add(request(1, adapters[0]))
    with pytest.raises(AdapterError) as e:
        pool.add(request(2, path))
    assert words in str(e.value), str(e.value)
    assert pool.list() == {1}


def test_memory_kept_for_adapters_is_what_they_can_hold(base, tmp_path):
    """--max-cpu-loras adapters at --max-lora-rank on every projection, and
    their slot pack, fill exactly what the worker keeps out of the KV budget."""
    m = load_model(base, fuse=True, norm_rope=True)
    pool = AdapterPool(m, m.dtype, max_rank=8, max_loras=2, capacity=2)
    full = [make_mlx_adapter(base, tmp_path / f"r8-{i}", rank=8, num_layers=3, seed=i) for i in range(2)]
    reqs = [request(i + 1, p) for i, p in enumerate(full)]
    pool.begin_step(reqs, np.array([1, 1]))  # both seated: the slot pack is built
    pool.end_step()
    packed = sum(a.nbytes + b.nbytes for a, b, _ in pool._slot_pack.values())
    held = sum(a.nbytes for a in pool.loaded.values()) + packed
    assert held == pool.reserve_bytes() > 0


def test_a_projection_the_model_never_calls_is_not_a_target(base, adapters, tmp_path):
    """A Linear in a layer that no forward reaches (here one added to layer 2's
    MLP) is sealed off after the traced step: an adapter naming it is refused,
    not silently ignored."""
    import mlx.nn as nn

    def add_unused(m):
        m.model.model.layers[2].mlp["unused_proj"] = nn.Linear(64, 64)

    _, pool = pool_for(base, extra=add_unused)
    assert any(s.name == "mlp.unused_proj" for s in pool.sites)  # wrapped, but never called
    assert (2, "mlp.unused_proj") not in pool.targets and (2, "mlp.up_proj") in pool.targets
    path = rename(adapters[2], tmp_path / "unused", "mlp.up_proj", "mlp.unused_proj",
                  lambda k, v: v[:, :64] if k.endswith("unused_proj.lora_b") else v)
    with pytest.raises(AdapterError, match="layer 2 mlp.unused_proj: not a projection this model computes"):
        pool.add(request(1, path))


def test_load_inplace_replaces_the_adapters_weights(base, adapters, rng):
    """vLLM's load_inplace (/v1/load_lora_adapter with load_inplace): the same
    id reloaded from another path computes with the new weights."""
    _, pool = pool_for(base)
    pool.add(request(1, adapters[0]))
    pool.begin_step([request(1, adapters[0])], np.array([2]))
    pool.end_step()
    again = LoRARequest("adapter-1", 1, adapters[1], load_inplace=True)
    pool.add(again)
    assert pool.loads == 2 and pool.list() == {1}
    mod = {(m.layer, m.path): m for m in read_adapter("x", adapters[1], 16).modules}[(0, "mlp.down_proj")]
    target = pool.targets[(0, "mlp.down_proj")]
    x = rng.standard_normal((1, 2, pool.sites[target.site].in_dims)).astype(np.float32)
    pool.begin_step([again], np.array([2]))
    got = np.array(pool.apply(target.site, mx.array(x), mx.zeros((1, 2, 64)))[0])
    np.testing.assert_allclose(got, x[0].astype(np.float64) @ mod.a @ mod.b * mod.scale, atol=1e-5)
