"""The Metal gated-delta kernel (metal/gated_delta_kernel.h), run by the MSL
executor exactly as GatedDelta::eval_gpu dispatches it, against the float64
definition (tests/numpy_reference.py: gated_delta_f64).

q, k and v are rounded to the dtype under test first and the reference is
computed on the rounded values, so only the kernel's float32 arithmetic and
the final rounding of y separate the two."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import msl_build
import msl_executor
from metal_tools import embedding_project, tool_missing
from numpy_reference import gated_delta_f64, gated_delta_inputs
from paged_attention_cases import round_to, storage

REPO = Path(__file__).resolve().parents[2]
DTYPES = ("float32", "float16", "bfloat16")
KEY_DIMS = (32, 64, 128, 256)
# (atol, rtol). y: float32 arithmetic, then one rounding to the dtype (|y| is
# O(0.1..1)); the state is float32 whatever the dtype.
Y_TOLERANCE = {
    "float32": (1e-6, 1e-5),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
}
STATE_TOLERANCE = (1e-5, 1e-5)


def make_inputs(rng, dtype, *, batch=2, steps=4, k_heads=1, v_heads=2, key_dim=64,
                value_dim=20, masked=False, mask=None):
    """gated_delta_inputs with q, k, v rounded to dtype (float32 values);
    `mask` (bool [B, T]) replaces the random right-padding mask."""
    q, k, v, g, beta, state, m = gated_delta_inputs(
        rng, batch=batch, steps=steps, k_heads=k_heads, v_heads=v_heads, key_dim=key_dim,
        value_dim=value_dim, masked=masked)
    q, k, v = (round_to(dtype, a) for a in (q, k, v))
    return q, k, v, g, beta, state, (m if mask is None else np.asarray(mask, bool))


def run(executor, dtype, inputs, **options):
    q, k, v, g, beta, state, mask = inputs
    return executor.gated_delta(dtype, storage(dtype, q), storage(dtype, k), storage(dtype, v),
                                g, beta, state, mask, **options)


def assert_close(out, ref, tolerance, what):
    atol, rtol = tolerance
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != reference {ref.shape}"
    assert not np.isnan(out).any(), f"{what}: {int(np.isnan(out).sum())} elements never written"
    bad = ~np.isclose(out, ref, atol=atol, rtol=rtol)
    if bad.any():
        i = tuple(int(x) for x in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements differ (atol={atol}, rtol={rtol}); "
            f"first at {i}: got {out[i]}, reference {ref[i]}; "
            f"max abs diff {np.abs(out - ref).max():.3g}")


def check(executor, dtype, inputs, what="", **options):
    y, state, plan = run(executor, dtype, inputs, **options)
    y_ref, state_ref = gated_delta_f64(*inputs)
    assert_close(y, y_ref, Y_TOLERANCE[dtype], f"{what} y")
    assert_close(state, state_ref, STATE_TOLERANCE, f"{what} state")
    return y, state, plan


@pytest.mark.parametrize("key_dim", KEY_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_step(executor, rng, dtype, key_dim):
    """T = 1 (a decode step) for a batch, GQA (Hv = 2 Hk), Dv not a multiple of 4."""
    inputs = make_inputs(rng, dtype, batch=3, steps=1, k_heads=2, v_heads=4, key_dim=key_dim,
                         value_dim=22)
    _, _, plan = check(executor, dtype, inputs, "decode")
    assert plan == {"grid": (6, 4, 3), "threads": 128, "dispatched": True}


@pytest.mark.parametrize("key_dim", KEY_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_with_padding_mask(executor, rng, dtype, key_dim):
    """T = 20 with right padding (each sequence a random length), GQA, B > 1."""
    inputs = make_inputs(rng, dtype, batch=3, steps=20, k_heads=1, v_heads=2, key_dim=key_dim,
                         value_dim=int(rng.choice([20, 30, 64])), masked=True)
    y, _, _ = check(executor, dtype, inputs, "prefill")
    mask = inputs[-1]
    assert not mask.all(), "the case should pad some sequence"
    assert (y[~mask] == 0).all(), "masked steps must write y = 0 exactly"


@pytest.mark.parametrize("value_dim", [1, 3, 20, 37, 128, 255, 256])
def test_value_dims(executor, rng, value_dim):
    """Value dims around the rows-per-threadgroup edge up to the largest (256):
    the last threadgroup's surplus simdgroups neither read nor write."""
    dtype = DTYPES[value_dim % 3]
    key_dim = int(rng.choice([64, 128, 256]))
    inputs = make_inputs(rng, dtype, batch=2, steps=5, k_heads=1, v_heads=2, key_dim=key_dim,
                         value_dim=value_dim, masked=True)
    _, _, plan = check(executor, dtype, inputs, f"Dv={value_dim} Dk={key_dim}")
    rows = min(4, value_dim)
    assert plan["threads"] == 32 * rows and plan["grid"] == (-(-value_dim // rows), 2, 2)
    # Threads before the buffers, too (the guard page below the data).
    check(executor, dtype, inputs, f"Dv={value_dim} at start", at_start=True)


@pytest.mark.parametrize("k_heads,v_heads", [(1, 1), (2, 2), (1, 4), (2, 6)])
def test_head_groups(executor, rng, k_heads, v_heads):
    """Value head h reads key head h / (Hv / Hk)."""
    inputs = make_inputs(rng, "float32", batch=2, steps=6, k_heads=k_heads, v_heads=v_heads,
                         key_dim=32, value_dim=12)
    check(executor, "float32", inputs, f"Hk={k_heads} Hv={v_heads}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_arbitrary_mask_and_fully_masked_rows(executor, rng, dtype):
    """Holes anywhere in a row, and sequences with no active step at all:
    y = 0 exactly at every masked step, and a fully masked sequence's state
    comes out bit for bit as it went in."""
    B, T = 4, 9
    mask = rng.random((B, T)) < 0.6
    mask[1] = False
    mask[3] = False
    mask[2, 0] = False
    inputs = make_inputs(rng, dtype, batch=B, steps=T, k_heads=2, v_heads=4, key_dim=64,
                         value_dim=21, mask=mask)
    y, state, _ = check(executor, dtype, inputs, "mask")
    assert (y[~mask] == 0).all()
    np.testing.assert_array_equal(state[[1, 3]], inputs[5][[1, 3]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_mask_never_reads_the_mask_slot(executor, rng, dtype):
    """Without a mask, q sits in the mask slot (as eval_gpu binds it); q's
    first bytes are zero here, so a kernel reading the slot as a mask would
    skip every step."""
    B, T = 2, 6
    inputs = list(make_inputs(rng, dtype, batch=B, steps=T, k_heads=1, v_heads=2, key_dim=32,
                              value_dim=5))
    inputs[0][0, 0, 0, :] = 0.0  # 32 elements >= B * T bytes
    y, _, _ = check(executor, dtype, tuple(inputs), "no mask")
    assert (y[:, 1:] != 0).any()


def test_all_steps_masked_in_place(executor, rng):
    """Nothing active, state donated: y all zeros, the state untouched."""
    inputs = make_inputs(rng, "float16", batch=2, steps=3, key_dim=128, value_dim=8,
                         mask=np.zeros((2, 3), bool))
    y, state, _ = run(executor, "float16", inputs, in_place=True)
    assert (y == 0).all()
    np.testing.assert_array_equal(state, inputs[5])


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_state_matches_separate_buffers(executor, rng, dtype, masked):
    """The final state written over the input state (a donated state) gives
    the same bytes as a separate output buffer, for y and the state."""
    inputs = make_inputs(rng, dtype, batch=2, steps=7, k_heads=1, v_heads=2,
                         key_dim=int(rng.choice(KEY_DIMS)), value_dim=23, masked=masked)
    y_sep, state_sep, _ = run(executor, dtype, inputs, raw=True)
    y_in, state_in, _ = run(executor, dtype, inputs, raw=True, in_place=True, seed=7)
    assert y_in.tobytes() == y_sep.tobytes()
    assert state_in.tobytes() == state_sep.tobytes()
    assert not np.isnan(state_sep).any()


def test_scheduling_order_does_not_matter(executor, rng):
    """Lanes interleaved in different orders give the same bytes."""
    inputs = make_inputs(rng, "bfloat16", batch=2, steps=5, k_heads=1, v_heads=2,
                         key_dim=128, value_dim=9, masked=True)
    first = run(executor, "bfloat16", inputs, raw=True)
    for seed in (1, 2):
        again = run(executor, "bfloat16", inputs, raw=True, seed=seed)
        assert again[0].tobytes() == first[0].tobytes()
        assert again[1].tobytes() == first[1].tobytes()


def test_no_steps_copies_the_state(executor, rng):
    """T = 0: y is empty and the kernel still runs, to copy the state (q, k, v,
    g, beta, mask are empty; eval_gpu binds the state in their slots)."""
    for in_place in (False, True):
        inputs = make_inputs(rng, "float32", batch=2, steps=0, key_dim=32, value_dim=5,
                             mask=np.zeros((2, 0), bool))
        y, state, plan = run(executor, "float32", inputs, in_place=in_place)
        assert y.shape == (2, 0, 2, 5) and plan["dispatched"]
        np.testing.assert_array_equal(state, inputs[5])


def test_empty_batch_is_not_dispatched(executor, rng):
    inputs = make_inputs(rng, "float16", batch=0, steps=3, key_dim=64, value_dim=4)
    y, state, plan = run(executor, "float16", inputs)
    assert y.shape == (0, 3, 2, 4) and state.shape == (0, 2, 4, 64)
    assert not plan["dispatched"]


def test_every_kernel_the_host_asks_for_is_instantiated(executor):
    names = executor.kernel_names()
    for dtype in DTYPES:
        for key_dim in KEY_DIMS:
            name = executor.gated_delta_kernel_name(dtype, key_dim)
            assert name == f"gated_delta_{dtype}_dk{key_dim}"
            assert name in names, f"eval_gpu would ask for {name}, which is not instantiated"


@pytest.mark.parametrize("key_dim", [16, 96, 512])
def test_plan_rejects_key_dims_without_a_kernel(executor, rng, key_dim):
    inputs = make_inputs(rng, "float32", batch=1, steps=1, key_dim=key_dim, value_dim=4)
    with pytest.raises(msl_executor.KernelFault, match="no Metal kernel for key dim"):
        run(executor, "float32", inputs)


# ---------------------------------------------------------------- the source


@pytest.fixture(scope="module")
def embedded(tmp_path_factory) -> str:
    try:
        return msl_build.embedded_metal_source(tmp_path_factory.mktemp("embed"), "gated_delta")
    except msl_build.ExecutorUnavailable as e:
        tool_missing(str(e))


def test_embedded_source_is_self_contained_ascii(embedded):
    embedded.encode("ascii")  # raises on anything else
    assert '#include "' not in embedded, "quoted includes must be inlined"
    assert "#pragma once" not in embedded
    for header in ("gated_delta_kernel.h", "gated_delta_params.h"):
        assert embedded.count(f'#line 1 "{header}"') == 1, header
    assert '#line 1 "gated_delta_plan.h"' not in embedded  # host-only
    assert "paged_attention" not in embedded  # its own library
    assert re.search(r"\[\[kernel\]\] void gated_delta\(", embedded)


def test_cmake_embeds_the_gated_delta_library(tmp_path, embedded):
    """cmake/metal_kernels.cmake generates gated_delta_metal_source.h with the
    embedded source, and lists csrc/gated_delta_metal.cpp among the sources."""
    _, build_and_print = embedding_project(tmp_path, 1, "gated_delta_metal_source.h", "kGatedDeltaMetalSource")
    printed = build_and_print()
    assert printed == embedded
    assert "csrc/gated_delta_metal.cpp" in (REPO / "cmake" / "metal_kernels.cmake").read_text()
