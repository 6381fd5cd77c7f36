"""ops.argmax_head with the head's bfloat16 screen (ops.argmax_head_screen):
the same tokens as the exact ArgmaxHead kernel, row for row and tie for tie,
with exact float32 logits computed only for the tokens the screen cannot rule
out. The kernel has an AVX-512 BF16 build and an AVX2 one (both tested on
a host with AVX-512 BF16: the AVX2 one under VLLM_METAL_CPU_ISA=avx2); with
neither the screen is never built (tested here too)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.native import greedy_head, ops

needs_screen = pytest.mark.skipif(not greedy_head.screen_available(),
                                  reason="the screened kernel needs AVX2 or AVX-512 BF16 (this CPU has neither)")


def exact(h: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The exact kernel's tokens (no screen), from any row count."""
    return np.array(ops._ext.argmax_head(mx.array(h), mx.array(w), stream=mx.cpu))


def screened(h: np.ndarray, w: np.ndarray, screen=None) -> tuple[np.ndarray, dict]:
    """The screened kernel's tokens for any row count (the primitive itself: ops.argmax_head
    leaves rows past the screen's max_rows to the exact kernel: test_the_avx2_build_under_the_avx2_cap)."""
    screen = screen or ops.argmax_head_screen(mx.array(w))
    assert screen is not None
    before = greedy_head.screen_counters()
    got = np.array(ops._ext.argmax_head(mx.array(h), mx.array(w), screen_weight=screen.weight,
                                        screen_table=screen.table, stream=mx.cpu))
    after = greedy_head.screen_counters()
    return got, {k: after[k] - before[k] for k in after}


@needs_screen
@pytest.mark.parametrize("rows,dim,vocab", [(1, 1, 1), (1, 3, 17), (2, 33, 1000), (7, 64, 4097),
                                            (8, 128, 49152), (13, 576, 3001), (64, 128, 49152),
                                            (70, 96, 2500), (130, 40, 999)])
def test_the_same_tokens_as_the_exact_kernel_and_float64(rng, rows, dim, vocab):
    w = rng.standard_normal((vocab, dim)).astype(np.float32)
    h = rng.standard_normal((rows, dim)).astype(np.float32)
    got, work = screened(h, w)
    np.testing.assert_array_equal(got, exact(h, w))
    logits = h.astype(np.float64) @ w.astype(np.float64).T
    clear = np.ptp(np.sort(logits, axis=1)[:, -2:], axis=1) > 1e-3 if vocab > 1 else np.ones(rows, bool)
    np.testing.assert_array_equal(got[clear], np.argmax(logits, axis=1)[clear])
    assert work["calls"] == 1 and work["rows"] == rows and work["declined"] == 0


@needs_screen
def test_the_screen_screens(rng):
    """A 49k-token head: a few exact logits a row, not the vocabulary (a
    screen that let everything through would pass every equality test)."""
    w = rng.standard_normal((49152, 128)).astype(np.float32)
    h = rng.standard_normal((64, 128)).astype(np.float32)
    _, work = screened(h, w)
    assert work["exact"] <= 64 * 8, work


@needs_screen
def test_ties_and_rounding_level_gaps_pick_what_the_exact_kernel_picks(rng):
    """Exact ties (a duplicated vocabulary row, across the kernel's task
    boundaries too) keep the first index; two tokens whose float64 logits
    agree (different rows, so their float32 sums round differently) resolve
    as the exact kernel's own sums do: computed in another order, the same
    candidates would pick differently on some of these rows."""
    vocab, dim, rows = 6000, 64, 200
    w = rng.standard_normal((vocab, dim)).astype(np.float32) * 0.1
    h = rng.standard_normal((rows, dim)).astype(np.float32)
    w[[17, 18, 1500, 5999]] = h[0] / np.linalg.norm(h[0]) * 4  # ties for row 0, inside a task and across tasks
    h64 = h.astype(np.float64)
    for r in range(1, rows):
        a, b = 20 + r, 3000 + r
        unit = h64[r] / np.linalg.norm(h64[r])
        w[a] = unit * 4 + 0.3 * rng.standard_normal(dim)
        wb = unit * 4 + 0.3 * rng.standard_normal(dim)
        wb += (h64[r] @ w[a].astype(np.float64) - h64[r] @ wb) / (h64[r] @ h64[r]) * h64[r]
        w[b] = wb
    got, work = screened(h, w)
    np.testing.assert_array_equal(got, exact(h, w))
    assert got[0] == 17
    assert work["exact"] >= 2 * rows  # every tied or near-tied pair was computed exactly
    assert {20 + r for r in range(1, rows)} & set(got) and {3000 + r for r in range(1, rows)} & set(got)


@needs_screen
def test_flat_logits_overflow_the_candidate_lists_and_stay_exact(rng):
    """Every token within the screen's bound of the best: more candidates than
    a task keeps (its tokens are then all computed exactly): still the
    exact kernel's tokens."""
    vocab, dim = 5000, 48
    base = rng.standard_normal(dim).astype(np.float32)
    w = (base + 1e-4 * rng.standard_normal((vocab, dim))).astype(np.float32)
    h = np.stack([base, -base, rng.standard_normal(dim).astype(np.float32)])
    got, work = screened(h, w)
    np.testing.assert_array_equal(got, exact(h, w))
    assert work["exact"] > 3 * 1024


@needs_screen
@pytest.mark.parametrize("bad", ["nan", "inf", "huge", "zeros", "tiny"])
def test_rows_outside_the_screen_go_to_the_exact_kernel(rng, bad):
    w = rng.standard_normal((3000, 32)).astype(np.float32)
    h = rng.standard_normal((9, 32)).astype(np.float32)
    h[4] = {"nan": np.where(np.arange(32) == 3, np.nan, h[4]), "inf": np.where(np.arange(32) == 3, np.inf, h[4]),
            "huge": h[4] * 2.0**42, "zeros": 0.0, "tiny": h[4] * 2.0**-45}[bad]
    got, work = screened(h, w)
    assert work["declined"] == 1 and work["rows"] == 0
    np.testing.assert_array_equal(got, exact(h, w))
    if bad == "zeros":
        assert got[4] == 0  # every logit 0: the first index


@needs_screen
def test_zero_vocabulary_rows_and_an_odd_vocabulary(rng):
    """All-zero weight rows (logit exactly 0), a vocabulary that ends mid-tile,
    negative-only logits: the padded lanes past the vocabulary are never picked."""
    w = rng.standard_normal((37, 5)).astype(np.float32)
    w[::3] = 0.0
    h = -np.abs(rng.standard_normal((5, 5))).astype(np.float32)
    w[1::3] = np.abs(w[1::3])  # their logits negative: zero rows win
    got, _ = screened(h, w)
    np.testing.assert_array_equal(got, exact(h, w))
    assert (got < 37).all()


@needs_screen
def test_heads_the_screen_cannot_take_are_not_screened(rng, caplog):
    caplog.set_level(logging.INFO, logger=greedy_head.logger.name)
    w = rng.standard_normal((100, 16)).astype(np.float32)
    for value in (np.nan, np.inf, 2.0**41):
        bad = w.copy()
        bad[7, 3] = value
        assert ops.argmax_head_screen(mx.array(bad)) is None
    tiny = w.copy()
    tiny[9] = 2.0**-45
    assert ops.argmax_head_screen(mx.array(tiny)) is None
    assert "cannot be screened: vocabulary row 9" in caplog.text
    assert ops.argmax_head_screen(mx.zeros((2, 2**20 + 1))) is None  # the bound's K term: dim <= 2^20
    assert "hidden size 1048577 is outside 1-1048576" in caplog.text
    ok = w.copy()
    ok[9] = 0.0  # an all-zero row is fine
    assert ops.argmax_head_screen(mx.array(ok)) is not None


@needs_screen
def test_bad_screens_are_refused(rng):
    w = mx.array(rng.standard_normal((100, 16)).astype(np.float32))
    h = mx.array(rng.standard_normal((3, 16)).astype(np.float32))
    other = ops.argmax_head_screen(mx.array(rng.standard_normal((200, 16)).astype(np.float32)))
    with pytest.raises(ValueError, match="not argmax_head_screen's for a \\[100, 16\\] weight"):
        ops.argmax_head(h, w, screen=other)
    with pytest.raises(TypeError, match="HeadScreen"):
        ops.argmax_head(h, w, screen=(other.weight, other.table))
    with pytest.raises(ValueError, match="come together"):
        ops._ext.argmax_head(h, w, screen_weight=other.weight)
    with pytest.raises(ValueError, match="float32"):
        ops.argmax_head_screen(w.astype(mx.float16))
    with pytest.raises(ValueError, match="float32"):
        ops.argmax_head_screen(w[0])


def test_the_switch(monkeypatch, rng):
    w = mx.array(rng.standard_normal((50, 8)).astype(np.float32))
    monkeypatch.setenv("VLLM_METAL_HEAD_SCREEN", "0")
    assert ops.argmax_head_screen(w) is None
    monkeypatch.setenv("VLLM_METAL_HEAD_SCREEN", "maybe")
    with pytest.raises(ValueError, match="VLLM_METAL_HEAD_SCREEN"):
        ops.argmax_head_screen(w)


def test_not_built_under_the_generic_cap():
    """VLLM_METAL_CPU_ISA=generic: no screened kernel, the screen is never built."""
    code = ("import vllm_metal.native.ops as o, mlx.core as mx; "
            "print(o.argmax_head_screen(mx.ones((4, 4))) is None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "VLLM_METAL_CPU_ISA": "generic"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


AVX2_BUILD = """
import numpy as np, mlx.core as mx
from vllm_metal.native import greedy_head, ops
rng = np.random.default_rng(5)
bad = 0
for rows, dim, vocab in [(1, 3, 17), (2, 33, 1000), (3, 64, 4097), (4, 576, 3001), (5, 96, 2500), (9, 40, 999),
                         (1, 576, 49152)]:
    w = rng.standard_normal((vocab, dim)).astype(np.float32)
    h = rng.standard_normal((rows, dim)).astype(np.float32)
    screen = ops.argmax_head_screen(mx.array(w))
    got = np.array(ops._ext.argmax_head(mx.array(h), mx.array(w), screen_weight=screen.weight,
                                        screen_table=screen.table, stream=mx.cpu))
    want = np.array(ops._ext.argmax_head(mx.array(h), mx.array(w), stream=mx.cpu))
    bad += int((got != want).sum())
c = greedy_head.screen_counters()
# ops.argmax_head screens up to the AVX2 build's max_rows, then runs the exact kernel
assert screen.max_rows == greedy_head.AVX2_SCREEN_MAX_ROWS, screen
for rows in (greedy_head.AVX2_SCREEN_MAX_ROWS, greedy_head.AVX2_SCREEN_MAX_ROWS + 1):
    h = mx.array(rng.standard_normal((rows, 576)).astype(np.float32))
    ops.argmax_head(h, mx.array(w), screen=screen).tolist()
after = greedy_head.screen_counters()
print(bad, c["calls"], c["rows"], c["exact"], after["calls"] - c["calls"], after["rows"] - c["rows"])
"""


def test_the_avx2_build_under_the_avx2_cap():
    """VLLM_METAL_CPU_ISA=avx2 (how an AVX-512 host runs an AVX2-only one's
    kernels): the AVX2 build of the screened kernel, the exact kernel's tokens,
    a few exact logits a row; ops.argmax_head screens up to AVX2_SCREEN_MAX_ROWS."""
    out = subprocess.run([sys.executable, "-c", AVX2_BUILD], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_METAL_CPU_ISA": "avx2"})
    assert out.returncode == 0, out.stderr
    bad, calls, rows, exact_logits, policy_calls, policy_rows = map(int, out.stdout.split())
    assert bad == 0 and calls == 7 and rows == 25
    assert exact_logits <= 25 * 8
    assert (policy_calls, policy_rows) == (1, greedy_head.AVX2_SCREEN_MAX_ROWS)  # 8 rows: the exact kernel
