"""ops.argmax_head: each row's greedy token, argmax over the vocabulary of
hidden @ weight^T, through vllm-metal's ArgmaxHead primitive on MLX's CPU
device (from ARGMAX_HEAD_MIN_ROWS float32 rows) or MLX's own matmul and
argmax, against float64 numpy."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.native import ops


def reference(h: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.argmax(h.astype(np.float64) @ w.astype(np.float64).T, axis=1)


def separated(rng, rows: int, dim: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Hidden rows and a weight whose best logit beats the second by far more
    than float32 rounding, so float64's argmax is the only right answer."""
    w = rng.standard_normal((vocab, dim)).astype(np.float32)
    h = rng.standard_normal((rows, dim)).astype(np.float32)
    logits = h.astype(np.float64) @ w.astype(np.float64).T
    if vocab == 1:
        return h, w
    top2 = np.sort(logits, axis=1)[:, -2:]
    keep = (top2[:, 1] - top2[:, 0]) > 1e-3 * np.abs(top2[:, 1]).clip(1)
    h[~keep] = 0  # all-zero rows: every logit 0, a tie everywhere -> index 0
    return h, w


@pytest.mark.parametrize("rows,dim,vocab", [(8, 8, 1), (8, 16, 3), (9, 40, 1001), (16, 128, 4096),
                                            (17, 72, 257), (33, 64, 513), (64, 128, 49152),
                                            (65, 576, 2053), (130, 100, 999)])
def test_matches_float64(rng, rows, dim, vocab):
    h, w = separated(rng, rows, dim, vocab)
    got = ops.argmax_head(mx.array(h), mx.array(w))
    assert got.dtype == mx.int32 and got.shape == (rows,)
    np.testing.assert_array_equal(np.array(got), reference(h, w))


@pytest.mark.parametrize("rows", [1, 3, 7])
def test_few_rows_take_mlx_and_agree(rng, rows):
    h, w = separated(rng, rows, 96, 3000)
    np.testing.assert_array_equal(np.array(ops.argmax_head(mx.array(h), mx.array(w))), reference(h, w))


def test_the_primitive_agrees_with_mlx_on_every_row_count(rng):
    """Both paths on the same inputs (the primitive called directly below the
    row threshold too): the same tokens."""
    h, w = separated(rng, 40, 128, 5000)
    hm, wm = mx.array(h), mx.array(w)
    for n in (1, 2, 8, 16, 39, 40):
        prim = np.array(ops._ext.argmax_head(hm[:n], wm))
        mlx = np.array(mx.argmax(hm[:n] @ wm.T, axis=1))
        np.testing.assert_array_equal(prim, mlx)
        np.testing.assert_array_equal(prim, reference(h[:n], w))


def test_ties_go_to_the_first_index(rng):
    """Equal best logits in different threads' vocabulary chunks and within
    one chunk: the smallest index wins, as argmax's."""
    rows, dim, vocab = 20, 32, 3000
    w = rng.standard_normal((vocab, dim)).astype(np.float32) * 0.1
    best = rng.standard_normal(dim).astype(np.float32)
    for i in (2999, 1700, 700, 513, 512, 5):  # the same best row, later and earlier copies
        w[i] = best
    h = np.tile(best * 10, (rows, 1))
    got = np.array(ops.argmax_head(mx.array(h), mx.array(w)))
    assert (got == 5).all(), got
    zero = np.array(ops.argmax_head(mx.zeros((rows, dim)), mx.array(w)))
    assert (zero == 0).all()  # every logit 0


def test_infinite_and_huge_values(rng):
    w = rng.standard_normal((300, 16)).astype(np.float32)
    w[123] = 1e30
    h = np.abs(rng.standard_normal((10, 16))).astype(np.float32)
    got = np.array(ops.argmax_head(mx.array(h), mx.array(w)))
    assert (got == 123).all()  # +inf logits: the first +inf wins
    w[50] = -1e30
    h2 = -h
    assert (np.array(ops.argmax_head(mx.array(h2), mx.array(w))) == 50).all()


def test_strided_and_lazy_inputs(rng):
    h, w = separated(rng, 24, 48, 700)
    both = mx.concatenate([mx.array(h), mx.ones((24, 5))], axis=1)
    view = both[:, :48]  # a column slice: not contiguous
    lazy_w = mx.array(w) * 1.0
    np.testing.assert_array_equal(np.array(ops.argmax_head(view, lazy_w)), reference(h, w))
    np.testing.assert_array_equal(np.array(ops.argmax_head(mx.array(h.T).T, lazy_w)), reference(h, w))


def test_other_dtypes_take_mlx(rng):
    h, w = separated(rng, 16, 32, 500)
    got = ops.argmax_head(mx.array(h).astype(mx.bfloat16), mx.array(w).astype(mx.bfloat16))
    assert got.dtype == mx.int32 and got.shape == (16,)


def test_bad_input():
    with pytest.raises(ValueError, match=r"\[rows, dim\]"):
        ops.argmax_head(mx.zeros((8, 4)), mx.zeros((10, 5)))
    with pytest.raises(ValueError, match=r"\[rows, dim\]"):
        ops.argmax_head(mx.zeros((8,)), mx.zeros((10, 8)))
    with pytest.raises(TypeError):
        ops.argmax_head(np.zeros((8, 4)), mx.zeros((10, 4)))
    with pytest.raises(ValueError, match="float32"):
        ops._ext.argmax_head(mx.zeros((8, 4), mx.float16), mx.zeros((10, 4), mx.float16))
    with pytest.raises(ValueError, match="1 to 2"):
        ops._ext.argmax_head(mx.zeros((8, 4)), mx.zeros((0, 4)))
    with pytest.raises(ValueError, match="vocabulary"):
        ops.argmax_head(mx.zeros((8, 4)), mx.zeros((0, 4)))
    assert np.array(ops.argmax_head(mx.zeros((0, 4)), mx.zeros((10, 4)))).shape == (0,)


def test_an_unknown_isa_cap_is_refused():
    import os
    import subprocess
    import sys

    env = {**os.environ, "VLLM_METAL_CPU_ISA": "avx9000"}
    out = subprocess.run([sys.executable, "-c", "import vllm_metal.native.ops"], env=env, capture_output=True,
                         text=True)
    assert out.returncode != 0 and "VLLM_METAL_CPU_ISA='avx9000'" in out.stderr
