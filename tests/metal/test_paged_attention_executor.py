"""The Metal paged-attention kernels, run by the MSL executor exactly as
eval_gpu dispatches them, against the CPU primitive."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import msl_executor
from paged_attention_cases import (BAD_INPUTS, DTYPES, KINDS, assert_close, break_case,
                                   cpu_reference, make_case, numpy_reference, storage)


def run(executor, case, **options):
    s = lambda a: storage(case.dtype, a)  # noqa: E731
    return executor.paged_attention(
        case.dtype, s(case.q), s(case.key_cache), s(case.value_cache), case.block_tables,
        case.seq_lens, case.cu_seqlens_q, **case.kwargs(), **options)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_cpu_primitive(executor, rng, dtype, head_dim, group, block_size, kind):
    case = make_case(rng, dtype=dtype, head_dim=head_dim, group=group,
                     block_size=block_size, kind=kind)
    out, info = run(executor, case)
    assert info["prefill_dispatched"] == (len(case.q) >= 9)
    if kind == "long_decode":
        assert info["partitions"] > 1
    assert_close(out, cpu_reference(case), dtype, f"{kind} {info}")


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_row_is_written_by_its_kernel(executor, rng, kind):
    """Rows of sequences with >= 9 new tokens come from the prefill kernel,
    all others from decode: running one kernel alone leaves exactly the other
    kernel's rows unwritten (NaN, the executor's poison)."""
    case = make_case(rng, dtype="float32", head_dim=64, group=2, block_size=16, kind=kind)
    new_tokens = np.diff(case.cu_seqlens_q)
    prefill_rows = np.repeat(new_tokens >= 9, new_tokens)
    ref = cpu_reference(case)
    for kernel, mine in (("decode", ~prefill_rows), ("prefill", prefill_rows)):
        out, _ = run(executor, case, kernels=(kernel,))
        assert np.isnan(out[~mine]).all(), f"{kernel} wrote rows it does not own"
        assert_close(out[mine], ref[mine], "float32", kernel)
    assert set(KINDS[kind]) == {k for k, m in (("decode", ~prefill_rows),
                                               ("prefill", prefill_rows)) if m.any()}


@pytest.mark.parametrize("sliding_window,softcap", [(16, None), (None, 30.0), (5, 20.0), (1, None)])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window_and_softcap(executor, rng, dtype, kind, sliding_window, softcap):
    case = make_case(rng, dtype=dtype, head_dim=int(rng.choice([64, 80, 128])),
                     group=int(rng.choice([1, 4])), block_size=int(rng.choice([8, 16, 32])),
                     kind=kind, sliding_window=sliding_window, softcap=softcap)
    out, info = run(executor, case)
    assert_close(out, cpu_reference(case), dtype, f"{kind} {info}")


@pytest.mark.parametrize("sliding_window,sinks", [(None, False), (5, False), (40, True)])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_causal(executor, rng, dtype, kind, sliding_window, sinks):
    """causal=False (encoders): every row sees its whole sequence (within the
    window on both sides), on the decode and prefill kernels alike: against
    the CPU primitive and the float64 definition, and unlike causal."""
    case = make_case(rng, dtype=dtype, head_dim=int(rng.choice([64, 128])), group=int(rng.choice([1, 4])),
                     block_size=int(rng.choice([8, 16])), kind=kind, sliding_window=sliding_window,
                     sinks=sinks, causal=False)
    out, info = run(executor, case)
    assert_close(out, cpu_reference(case), dtype, f"non-causal {kind} {info}")
    assert_close(out, numpy_reference(case), dtype, f"non-causal {kind} vs float64")
    if (np.diff(case.cu_seqlens_q) > 1).any():  # rows with keys after their own position
        causal_out, _ = run(executor, dataclasses.replace(case, causal=True))
        assert np.abs(causal_out - out).max() > 1e-3


@pytest.mark.parametrize("sliding_window", [None, 40])
@pytest.mark.parametrize("partition_size", [32, 96, 200])
@pytest.mark.parametrize("kind", ["decode", "multi_token_decode", "mixed", "long_decode"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forced_partitions(executor, rng, dtype, kind, partition_size, sliding_window):
    """Many small partitions, including empty ones (window) and ones that end
    inside a cache block, through the reduce kernel."""
    case = make_case(rng, dtype=dtype, head_dim=int(rng.choice([64, 128, 256])), group=2,
                     block_size=int(rng.choice([8, 16, 32])), kind=kind,
                     sliding_window=sliding_window)
    out, info = run(executor, case, partition_size=partition_size)
    capacity = case.block_tables.shape[1] * case.key_cache.shape[1]
    assert info["partitions"] == -(-capacity // partition_size)
    assert_close(out, cpu_reference(case), dtype, f"{kind} {info}")


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("head_dim", [1, 31, 33, 96, 255])
def test_other_supported_shapes(executor, rng, head_dim, block_size, kind):
    """Head dims off the tiers, the large block sizes and a GQA group of 3."""
    dtype = DTYPES[head_dim % 3]
    case = make_case(rng, dtype=dtype, head_dim=head_dim, group=3, block_size=block_size,
                     kind=kind)
    out, _ = run(executor, case)
    assert_close(out, cpu_reference(case), dtype, kind)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks(executor, rng, dtype, kind):
    """Attention sinks in every kernel (decode, prefill, and the reduce of
    partitioned decode, which alone folds them in), with window and softcap
    rotating in."""
    window, softcap = [(None, None), (16, None), (None, 30.0), (5, 20.0)][int(rng.integers(4))]
    case = make_case(rng, dtype=dtype, head_dim=int(rng.choice([64, 128])), group=4,
                     block_size=int(rng.choice([8, 16, 32])), kind=kind, sliding_window=window,
                     softcap=softcap, sinks=True)
    out, info = run(executor, case)
    assert_close(out, cpu_reference(case), dtype, f"{kind} {info}")


@pytest.mark.parametrize("partition_size", [32, 200])
def test_sinks_counted_once_over_partitions(executor, rng, partition_size):
    """Many partitions, most of them empty (window): the sink joins each row once."""
    case = make_case(rng, dtype="float32", head_dim=64, group=4, block_size=16,
                     kind="long_decode", sliding_window=300, sinks=True)
    out, info = run(executor, case, partition_size=partition_size)
    assert info["partitions"] > 1
    assert_close(out, cpu_reference(case), "float32", str(info))


# Key and value head sizes of the served families: latent attention (MLA: one
# cache, K = the whole row, V = its first v_head_dim entries; deepseek 512 + 64,
# minicpm3 256 + 32) on the large tier, and 192-dim heads (with 128-dim values
# in a cache of their own) on the 256 tier.
HEAD_SIZES = [(576, 512, True), (288, 256, True), (192, None, False), (192, 128, False)]


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed", "long_decode"])
@pytest.mark.parametrize("head_dim,v_head_dim,shared", HEAD_SIZES)
def test_head_sizes(executor, rng, head_dim, v_head_dim, shared, kind):
    dtype = DTYPES[(head_dim + len(kind)) % 3]
    case = make_case(rng, dtype=dtype, head_dim=head_dim, group=4, block_size=16, kind=kind,
                     num_kv_heads=1 if shared else 2, v_head_dim=v_head_dim, shared_kv=shared)
    out, info = run(executor, case)
    assert out.shape == case.q.shape[:2] + (v_head_dim or head_dim,)
    if kind == "long_decode":
        assert info["partitions"] > 1
    assert_close(out, cpu_reference(case), dtype, f"{kind} {info}")


@pytest.mark.parametrize("kind", ["prefill", "long_decode"])
@pytest.mark.parametrize("head_dim,v_head_dim", [(333, 301), (40, 100), (1, 512)])
def test_head_sizes_off_the_tiers(executor, rng, head_dim, v_head_dim, kind):
    """Sizes between tiers, values wider than keys, separate caches."""
    case = make_case(rng, dtype="float16", head_dim=head_dim, group=3, block_size=8, kind=kind,
                     v_head_dim=v_head_dim)
    out, _ = run(executor, case)
    assert_close(out, cpu_reference(case), "float16", kind)


@pytest.mark.parametrize("kind", ["mixed", "multi_token_decode"])
def test_mla_with_sinks_window_and_partitions(executor, rng, kind):
    """Everything at once on the large tier: sinks, softcap, window and
    forced partitions next to a prefill chunk."""
    case = make_case(rng, dtype="bfloat16", head_dim=576, group=2, block_size=32, kind=kind,
                     num_kv_heads=1, v_head_dim=512, shared_kv=True, sinks=True,
                     sliding_window=30, softcap=25.0)
    out, info = run(executor, case, partition_size=64)
    assert_close(out, cpu_reference(case), "bfloat16", f"{kind} {info}")


# ---- Grouped (GQA) decode and the shape-class table ------------------------
#
# The decode kernel computes up to the tier's grouped width of query heads of
# one KV head per threadgroup (8 at d <= 128, 4 at d256, 2 on the large tier;
# paged_attention_tuning.h), reading each K/V row once for all of them;
# larger groups are split into chunks. These run it against the float64
# definition (tests/numpy_reference.py), grouped and per head.

# head_dim -> (v_head_dim, shared cache, num_kv_heads, the tier's grouped width)
GROUPED_DIMS = {64: (None, False, 2, 8), 128: (None, False, 2, 8), 256: (None, False, 2, 4),
                576: (512, True, 1, 2)}
# Groups 1, 2, 3, 4, 8 and past every tier's width (12: two chunks of 6 at
# d <= 128, three of 4 at d256, six of 2 on the large tier).
GROUPS = [1, 2, 3, 4, 8, 12]


def grouped_case(rng, *, dtype, head_dim, group, kind, **kw):
    v_head_dim, shared, kv_heads, _ = GROUPED_DIMS[head_dim]
    return make_case(rng, dtype=dtype, head_dim=head_dim, group=group,
                     block_size=int(rng.choice([8, 16, 32])), kind=kind,
                     num_kv_heads=kv_heads, v_head_dim=v_head_dim, shared_kv=shared, **kw)


def check_grouped_plan(info, case, head_dim, group):
    """The plan ran the grouped kernel (per head for a group of 1, but for
    verify rows) with balanced chunks of at most the tier's width."""
    width = GROUPED_DIMS[head_dim][3]
    kv_heads = case.key_cache.shape[2]
    chunks = -(-group // width)
    grouped = group > 1 or info["queries"] == "verify"
    assert ("_decode_gqa%d_" % width in info["decode_kernel"]) == grouped, info
    assert info["decode_tokens"] == (max(1, width // info["decode_heads"])
                                     if info["queries"] == "verify" else 1), info
    assert info["decode_chunks"] == (chunks if group > 1 else 1), info
    assert info["decode_heads"] == (-(-group // chunks) if group > 1 else 1), info
    assert info["decode_grid"][:2] == (kv_heads * info["decode_chunks"], len(case.q)), info


@pytest.mark.parametrize("partitioned", [False, True])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", list(GROUPED_DIMS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_decode(executor, rng, dtype, head_dim, group, partitioned):
    """Every group size against every tier's width, with and without key
    partitions (forced, so that short contexts split too)."""
    kind = ["decode", "multi_token_decode", "mixed"][(head_dim // 64 + group) % 3]
    case = grouped_case(rng, dtype=dtype, head_dim=head_dim, group=group, kind=kind)
    out, info = run(executor, case, partition_size=48 if partitioned else 0)
    check_grouped_plan(info, case, head_dim, group)
    assert (info["partitions"] > 1) == partitioned
    assert_close(out, numpy_reference(case), dtype, f"{kind} {info}")


@pytest.mark.parametrize("group", [3, 8, 12])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 576])
def test_grouped_long_decode(executor, rng, head_dim, group):
    """Contexts long enough for the plan's own partitioning."""
    dtype = DTYPES[(head_dim // 64 + group) % 3]
    case = grouped_case(rng, dtype=dtype, head_dim=head_dim, group=group, kind="long_decode")
    out, info = run(executor, case)
    check_grouped_plan(info, case, head_dim, group)
    assert info["partitions"] > 1
    assert_close(out, numpy_reference(case), dtype, str(info))


FEATURES = [dict(sinks=True), dict(sliding_window=16), dict(softcap=30.0),
            dict(sinks=True, sliding_window=5, softcap=20.0), dict(sliding_window=1)]


@pytest.mark.parametrize("partition_size", [0, 32])
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "+".join(f))
@pytest.mark.parametrize("group", [1, 3, 8, 12])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 576])
def test_grouped_decode_sinks_window_softcap(executor, rng, head_dim, group, features,
                                             partition_size):
    """Sinks (one per query head: each head of a chunk folds its own, once),
    sliding windows (partitions left empty) and soft caps."""
    dtype = DTYPES[(head_dim + group + partition_size) % 3]
    kind = ["decode", "multi_token_decode", "mixed"][(group + len(features)) % 3]
    case = grouped_case(rng, dtype=dtype, head_dim=head_dim, group=group, kind=kind,
                        **features)
    out, info = run(executor, case, partition_size=partition_size)
    check_grouped_plan(info, case, head_dim, group)
    assert_close(out, numpy_reference(case), dtype, f"{kind} {info}")


@pytest.mark.parametrize("head_dim", [64, 256, 576])
@pytest.mark.parametrize("group", [1, 2, 5, 12])
def test_grouped_and_per_head_kernels_agree(executor, rng, head_dim, group):
    """Forcing either kernel (the grouped one for a group of 1 too) gives the
    reference, also through partitions and with sinks."""
    width = GROUPED_DIMS[head_dim][3]
    case = grouped_case(rng, dtype="float32", head_dim=head_dim, group=group,
                        kind="multi_token_decode", sinks=True)
    ref = numpy_reference(case)
    for heads in (1, width):
        for partition_size in (0, 40):
            out, info = run(executor, case, decode_heads=heads, partition_size=partition_size)
            assert ("_gqa" in info["decode_kernel"]) == (heads > 1), info
            assert info["decode_chunks"] == (group if heads == 1 else -(-group // width))
            assert_close(out, ref, "float32", str(info))


@pytest.mark.parametrize("simdgroups", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("group", [1, 6])
def test_decode_simdgroup_counts(executor, rng, group, simdgroups):
    """The decode kernel takes its simdgroup count from the launch (the table
    gives 4 or 8): any count 1..8 splits keys and merges states correctly."""
    case = grouped_case(rng, dtype="float16", head_dim=128, group=group, kind="mixed",
                        sinks=True, sliding_window=40)
    for partition_size in (0, 64):
        out, info = run(executor, case, decode_simdgroups=simdgroups,
                        partition_size=partition_size)
        assert info["decode_threads"] == 32 * simdgroups
        assert_close(out, numpy_reference(case), "float16", str(info))


def test_grouped_decode_with_eight_kv_heads(executor, rng):
    """8 KV heads of 6 query heads each, on the launch of the table's large
    batch rows (4 simdgroups)."""
    case = make_case(rng, dtype="bfloat16", head_dim=128, group=6, block_size=16,
                     kind="multi_token_decode", num_kv_heads=8, sinks=True)
    out, info = run(executor, case, decode_simdgroups=4)
    assert info["decode_grid"][:2] == (8, len(case.q))
    assert_close(out, numpy_reference(case), "bfloat16", str(info))


# One shape per class: (num_tokens, num_seqs) by query class and batch class,
# with 8 KV heads (the batch class counts num_tokens * num_kv_heads against
# 512).
CLASS_SHAPES = {
    ("decode", "small"): (4, 4), ("decode", "large"): (64, 64),
    ("verify", "small"): (12, 4), ("verify", "large"): (192, 64),
    ("prefill", "small"): (18, 2), ("prefill", "large"): (72, 8),
}
DIMS_OF_CLASS = {"up_to_128": [(32, None), (64, None), (80, None), (128, None)],
                 "256": [(192, 128), (256, None)], "large": [(576, 512), (288, 256)]}
WIDTH_OF_CLASS = {"up_to_128": 8, "256": 4, "large": 2}


def test_decode_shape_table_has_one_row_per_class(executor):
    table = executor.decode_shape_table()
    keys = [(r["dims"], r["queries"], r["batch"]) for r in table]
    assert sorted(keys) == sorted((d, q, b) for d in DIMS_OF_CLASS
                                  for q, b in CLASS_SHAPES)
    for r in table:
        assert r["decode_heads"] in (1, WIDTH_OF_CLASS[r["dims"]])
        assert 1 <= r["decode_simdgroups"] <= 8
        assert 1 <= r["decode_tokens"] <= 8


@pytest.mark.parametrize("group", [1, 4, 12])
def test_plan_picks_the_table_row_for_each_class(executor, group):
    """Each class's shape gets its own row, and the decode launch is what the
    row says: kernel (grouped width, or per head for a group of 1), threads,
    grid and whether long contexts split keys."""
    table = executor.decode_shape_table()
    for i, row in enumerate(table):
        tokens, seqs = CLASS_SHAPES[(row["queries"], row["batch"])]
        for head_dim, v_head_dim in DIMS_OF_CLASS[row["dims"]]:
            for dtype in DTYPES:
                # 4096 keys of capacity: long enough to split when allowed.
                info = executor.plan(dtype, num_tokens=tokens, num_heads=8 * group,
                                     num_kv_heads=8, head_dim=head_dim, v_head_dim=v_head_dim,
                                     num_seqs=seqs, block_size=16, max_blocks_per_seq=256)
                what = f"row {i} {row} {head_dim}/{v_head_dim} {dtype}: {info}"
                assert info["table_row"] == i, what
                assert (info["dims"], info["queries"], info["batch"]) == (
                    row["dims"], row["queries"], row["batch"]), what
                assert info["decode_threads"] == 32 * row["decode_simdgroups"], what
                width = row["decode_heads"] if group > 1 or row["decode_tokens"] > 1 else 1
                kind = "decode_grouped" if width > 1 else "decode"
                assert info["decode_kernel"] == executor.host_kernel_name(
                    kind, dtype, head_dim, v_head_dim), what
                chunks = -(-group // width)
                assert info["decode_chunks"] == chunks, what
                assert info["decode_heads"] == -(-group // chunks), what
                assert info["decode_tokens"] == max(1, min(row["decode_tokens"],
                                                           width // info["decode_heads"])), what
                assert info["decode_grid"][:2] == (8 * chunks, tokens), what
                threadgroups = 8 * chunks * tokens
                assert (info["partitions"] > 1) == (row["partition"] and threadgroups < 1024), what
                assert info["prefill_dispatched"] == (tokens >= 9), what


@pytest.mark.parametrize("tokens,seqs,kv_heads,queries,batch", [
    (5, 5, 2, "decode", "small"), (3, 5, 2, "decode", "small"),   # sequences without tokens
    (6, 5, 2, "verify", "small"), (44, 5, 2, "verify", "small"), (45, 5, 2, "prefill", "small"),
    (1, 0, 2, "prefill", "small"),                                 # no sequences at all
    (511, 511, 1, "decode", "small"), (512, 512, 1, "decode", "large"),
    (127, 127, 4, "decode", "small"), (128, 128, 4, "decode", "large"),
    (128, 64, 4, "verify", "large"), (4096, 8, 1, "prefill", "large"),
])
def test_shape_class_boundaries(executor, tokens, seqs, kv_heads, queries, batch):
    """decode: one token per sequence at most on average; verify: fewer than 9;
    prefill: 9 or more. large batch: num_tokens * num_kv_heads >= 512."""
    info = executor.plan("float16", num_tokens=tokens, num_heads=4 * kv_heads,
                         num_kv_heads=kv_heads, head_dim=128, num_seqs=seqs)
    assert (info["queries"], info["batch"]) == (queries, batch), info


@pytest.mark.parametrize("head_dim,v_head_dim,heads", [(128, None, 4), (128, None, 2),
                                                       (256, None, 8), (576, 512, 4)])
def test_plan_rejects_widths_without_a_kernel(executor, head_dim, v_head_dim, heads):
    with pytest.raises(ValueError, match="no decode kernel"):
        executor.plan("float32", num_tokens=2, num_heads=16, num_kv_heads=2,
                      head_dim=head_dim, v_head_dim=v_head_dim, num_seqs=2,
                      decode_heads=heads)


def _strided_copy(rng, a: np.ndarray, how: str) -> np.ndarray:
    """The values of a as a non-contiguous numpy view."""
    if how == "padded_last":      # rows padded: last axis contiguous, others not
        base = np.zeros(a.shape[:-1] + (a.shape[-1] + 3,), a.dtype)
        view = base[..., 1:1 + a.shape[-1]]
    elif how == "every_other":    # stride 2 in the last axis
        base = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        view = base[..., ::2]
    elif how == "reversed":       # negative strides in the first axis
        base = np.zeros(a.shape, a.dtype)
        view = base[::-1]
    elif how == "transposed":     # axes 1 and 2 swapped in memory
        base = np.zeros((a.shape[0], a.shape[2], a.shape[1]) + a.shape[3:], a.dtype)
        view = base.swapaxes(1, 2)
    else:
        raise ValueError(how)
    view[...] = a
    assert not view.flags.c_contiguous
    return view


@pytest.mark.parametrize("kind", ["decode", "prefill", "long_decode"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs(executor, rng, dtype, kind):
    """Every input as a non-contiguous view: the kernels read through strides
    (eval_gpu passes MLX's strides instead of copying to temporaries)."""
    case = make_case(rng, dtype=dtype, head_dim=80, group=2, block_size=16, kind=kind)
    s = lambda a: storage(dtype, a)  # noqa: E731
    out, _ = executor.paged_attention(
        dtype,
        _strided_copy(rng, s(case.q), "padded_last"),
        _strided_copy(rng, s(case.key_cache), "transposed"),
        _strided_copy(rng, s(case.value_cache), "every_other"),
        _strided_copy(rng, case.block_tables, "every_other"),
        _strided_copy(rng, case.seq_lens, "reversed"),
        _strided_copy(rng, case.cu_seqlens_q, "every_other"),
        **case.kwargs())
    assert_close(out, cpu_reference(case), dtype, kind)


def test_sequences_without_new_tokens(executor, rng):
    case = make_case(rng, dtype="float32", head_dim=64, group=2, block_size=8, kind="decode")
    # Sequence 1 contributes no query rows this step (cu repeats an entry).
    case.cu_seqlens_q = np.array([0, 1, 1] + [2 + i for i in range(len(case.seq_lens) - 2)],
                                 np.int32)
    case.q = case.q[:case.cu_seqlens_q[-1]]
    out, _ = run(executor, case)
    assert_close(out, cpu_reference(case), "float32")


def test_schedule_order_does_not_matter(executor, rng):
    """Different thread interleavings between barriers give bit-identical
    results: the kernels have no data race the executor can expose."""
    for kind, partition_size, group, simdgroups in (("mixed", 0, 4, 0), ("decode", 48, 4, 0),
                                                    ("multi_token_decode", 48, 12, 3)):
        case = make_case(rng, dtype="float16", head_dim=128, group=group, block_size=16,
                         kind=kind)
        outs = [run(executor, case, seed=seed, partition_size=partition_size,
                    decode_simdgroups=simdgroups)[0] for seed in range(4)]
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])


_RUN_IN_CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from msl_executor import Executor
    d = np.load(sys.argv[3])
    ex = Executor(Path(sys.argv[2]))
    extra = {}
    if "sinks" in d:
        extra["sinks"] = d["sinks"]
    if "v_head_dim" in d:
        extra["v_head_dim"] = int(d["v_head_dim"])
    for at_start in (False, True):
        out, _ = ex.paged_attention(
            str(d["dtype"]), d["q"], d["k"], d["v"], d["bt"], d["sl"], d["cu"],
            scale=float(d["scale"]), partition_size=int(d["partition_size"]),
            at_start=at_start, **extra)
        np.save(sys.argv[4] + ("_start.npy" if at_start else "_end.npy"), out)
""")


@pytest.mark.parametrize("how", BAD_INPUTS)
@pytest.mark.parametrize("kind", ["multi_token_decode", "prefill", "mixed", "long_decode"])
def test_bad_metadata_gives_nan_rows_and_no_out_of_bounds_read(executor, rng, tmp_path,
                                                              kind, how):
    case = make_case(rng, dtype="float16", head_dim=64, group=2, block_size=16, kind=kind)
    _check_bad_metadata(executor, tmp_path, case, kind, how)


@pytest.mark.parametrize("how", BAD_INPUTS)
@pytest.mark.parametrize("kind", ["multi_token_decode", "long_decode"])
@pytest.mark.parametrize("group", [1, 12])
def test_bad_metadata_per_head_and_in_chunks(executor, rng, tmp_path, group, kind, how):
    """The same NaN rows from a group of 1 (the per-head decode kernel, or
    for verify rows the grouped one with 8 tokens per threadgroup) and from a
    group split over two grouped threadgroups (12 = 2 x 6); the test above
    runs groups of 2 (one grouped threadgroup per KV head and 4 tokens)."""
    case = make_case(rng, dtype="float16", head_dim=64, group=group, block_size=16, kind=kind)
    _check_bad_metadata(executor, tmp_path, case, kind, how)


@pytest.mark.parametrize("how", ["block_out_of_range", "huge_block", "seq_len_over_capacity"])
@pytest.mark.parametrize("kind", ["prefill", "long_decode"])
def test_bad_metadata_on_the_large_tier(executor, rng, tmp_path, kind, how):
    """The large tier's own prefill tiling, with an MLA cache and sinks."""
    case = make_case(rng, dtype="float16", head_dim=576, group=2, block_size=16, kind=kind,
                     num_kv_heads=1, v_head_dim=512, shared_kv=True, sinks=True)
    _check_bad_metadata(executor, tmp_path, case, kind, how)


def _check_bad_metadata(executor, tmp_path, case, kind, how):
    from vllm_metal.native import ops  # noqa: F401
    import mlx.core as mx
    from paged_attention_cases import mx_inputs

    reference = cpu_reference(case)
    nan_tokens, exact_tokens = break_case(case, how)
    with pytest.raises(RuntimeError):  # the CPU backend validates instead
        mx.eval(ops.paged_attention(*mx_inputs(case), **case.kwargs(), stream=mx.cpu))

    # In a child process: a read outside a guarded buffer kills it (SIGSEGV)
    # instead of this test session. Guards sit after, then before, the data.
    inputs = tmp_path / "case.npz"
    extra = {} if case.sinks is None else dict(sinks=case.sinks)
    if case.v_head_dim is not None:
        extra["v_head_dim"] = case.v_head_dim
    np.savez(inputs, dtype=case.dtype, q=storage("float16", case.q),
             k=storage("float16", case.key_cache), v=storage("float16", case.value_cache),
             bt=case.block_tables, sl=case.seq_lens, cu=case.cu_seqlens_q, scale=case.scale,
             partition_size=128 if kind == "long_decode" else 0, **extra)
    child = subprocess.run(
        [sys.executable, "-c", _RUN_IN_CHILD, str(Path(msl_executor.__file__).parent),
         str(executor.path), str(inputs), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120,
        cwd=str(tmp_path))
    assert child.returncode == 0, (
        f"executor child died (rc {child.returncode}: a negative rc is a signal, e.g. -11 "
        f"for an out-of-bounds read):\n{child.stderr[-2000:]}")
    for suffix in ("_end.npy", "_start.npy"):
        out = np.load(tmp_path / ("out" + suffix)).astype(np.float32)
        assert np.isnan(out[nan_tokens]).all(), f"{how}: tokens {nan_tokens} must be NaN"
        assert not np.isinf(out).any()
        assert_close(out[exact_tokens], reference[exact_tokens], "float16", how)


@pytest.mark.parametrize("cache_format", ["fp8e4m3", "fp8e5m2", "fp8row"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_8bit_caches_match_cpu_primitive(executor, rng, dtype, kind, cache_format):
    """--kv-cache-dtype fp8 / fp8_e5m2: the Metal kernels decode the uint8
    caches as the CPU kernel does: keys encoded from the case's values,
    values random codes of magnitude <= 16 (every code, exactly:
    test_8bit_codes_decode_exactly)."""
    import mlx.core as mx

    from vllm_metal.native import kv_quant, ops

    case = make_case(rng, dtype=dtype, head_dim=128, group=4, block_size=16, kind=kind)
    name = {"fp8e4m3": "fp8_e4m3", "fp8e5m2": "fp8_e5m2", "fp8row": "fp8_per_token_head"}[cache_format]
    codes = [np.array(kv_quant.encode(mx.array(case.key_cache), name)),
             rng.integers(0, 256, case.value_cache.shape, dtype=np.uint8)]
    element = "fp8_e4m3" if name == "fp8_per_token_head" else name
    decoded = np.array(kv_quant.decode(mx.array(codes[1]), element))
    codes[1][~(np.abs(decoded) <= 16)] &= 0x80  # larger magnitudes (and NaN / inf) -> +-0
    if name == "fp8_per_token_head":  # each value row gets a scale of its own
        scales = rng.uniform(0.05, 4.0, case.value_cache.shape[:3] + (1,)).astype(np.float32)
        codes[1] = np.concatenate([codes[1], scales.view(np.uint8)], axis=-1)
    q = storage(dtype, case.q)
    out, info = executor.paged_attention(dtype, q, codes[0], codes[1], case.block_tables, case.seq_lens,
                                         case.cu_seqlens_q, **case.kwargs(), cache_format=cache_format)
    inputs = [mx.array(case.q).astype(getattr(mx, dtype)), mx.array(codes[0]), mx.array(codes[1]),
              mx.array(case.block_tables), mx.array(case.seq_lens), mx.array(case.cu_seqlens_q)]
    ref = ops.paged_attention(*inputs, **case.kwargs(), kv_cache_dtype=name, stream=mx.cpu)
    assert_close(out, np.array(ref.astype(mx.float32)), dtype, f"{kind} {cache_format} {info}")
    assert len(np.unique(codes[1][..., :case.value_cache.shape[-1]])) >= 150


@pytest.mark.parametrize("cache_format", ["fp8e4m3", "fp8e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_8bit_codes_decode_exactly(executor, dtype, cache_format):
    """Every one of the 256 codes as a value row seen alone (one key: its
    softmax weight is exactly 1), so each output is the decoded code."""
    import mlx.core as mx

    from vllm_metal.native import kv_quant

    name = {"fp8e4m3": "fp8_e4m3", "fp8e5m2": "fp8_e5m2"}[cache_format]
    codes = np.zeros((2, 8, 1, 128), np.uint8)  # two blocks of 8 slots; the codes in slot 0 of each
    codes[:, 0, 0] = np.arange(256, dtype=np.uint8).reshape(2, 128)
    decoded = np.array(kv_quant.decode(mx.array(codes[:, 0, 0]), name))
    finite = np.isfinite(decoded)
    q = storage(dtype, np.zeros((2, 1, 128), np.float32))
    out, _ = executor.paged_attention(dtype, q, np.zeros_like(codes), codes, np.array([[0], [1]], np.int32),
                                      np.array([1, 1], np.int32), np.array([0, 1, 2], np.int32), scale=1.0,
                                      cache_format=cache_format)
    want = decoded if dtype == "float32" else np.array(mx.array(decoded).astype(getattr(mx, dtype)).astype(mx.float32))
    np.testing.assert_array_equal(out[:, 0][finite], want[finite])
    assert np.isnan(out[:, 0][np.isnan(decoded)]).all()


# ---- The verify regime: several tokens of a sequence per decode threadgroup --
#
# Speculative decoding's verify rows (2..8 new tokens per sequence) are the
# table's verify class: the grouped decode kernel computes up to
# decode_tokens consecutive tokens of one sequence per threadgroup (within
# the tier's width after the chunk's heads), reading each K/V row once for
# all of them. Head dims 64, 128, 256 and 512 (the large tier), window on and
# off, batch 1 (partitioned by the plan) and 32, against float64.

VERIFY_DIMS = {64: 2, 128: 2, 256: 2, 512: 1}  # head_dim -> KV heads


def verify_case(rng, *, head_dim, group, batch, **kw):
    dtype = DTYPES[(head_dim // 64 + group + batch) % 3]
    return make_case(rng, dtype=dtype, head_dim=head_dim, group=group, block_size=16,
                     kind=f"verify_b{batch}", num_kv_heads=VERIFY_DIMS[head_dim], **kw)


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("window", [None, 13])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", list(VERIFY_DIMS))
def test_verify_regime_matches_float64(executor, rng, head_dim, group, window, batch):
    case = verify_case(rng, head_dim=head_dim, group=group, batch=batch, sliding_window=window)
    ref = numpy_reference(case)
    width = {64: 8, 128: 8, 256: 4, 512: 2}[head_dim]
    for tokens in (0, 1, 3, 8):  # 0: the table's (8, within the width)
        out, info = run(executor, case, decode_tokens=tokens)
        assert info["queries"] == "verify", info
        assert info["decode_tokens"] == max(1, min(tokens or 8, width // info["decode_heads"])), info
        assert (info["partitions"] > 1) == (batch == 1), info
        assert_close(out, ref, case.dtype, f"tokens {tokens}: {info}")


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "+".join(f))
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 3), (512, 1)])
def test_verify_regime_sinks_window_softcap_partitions(executor, rng, head_dim, group, features):
    """Per-row sinks, windows (a token's first keys differ from its
    neighbours'), soft caps, and forced partitions (rows with empty ones)."""
    case = verify_case(rng, head_dim=head_dim, group=group, batch=5, **features)
    ref = numpy_reference(case)
    for partition_size in (0, 32):
        out, info = run(executor, case, partition_size=partition_size)
        assert info["decode_tokens"] > 1, info
        assert_close(out, ref, case.dtype, str(info))


def test_verify_regime_tokens_do_not_cross_sequences(executor, rng):
    """Threadgroups own tokens from their sequence's first new token in steps
    of decode_tokens: sequences of 2..8 tokens packed back to back, with 3
    tokens per threadgroup (tiles never aligned to the packing), plus a
    decode and a prefill chunk in the same batch."""
    new = [2, 7, 1, 8, 3, 5, 20, 4]
    lens = [30, 9, 40, 8, 50, 61, 35, 77]
    case = make_case(rng, dtype="float32", head_dim=128, group=1, block_size=16, kind="decode")
    used = [(n + 15) // 16 for n in lens]
    ids = rng.permutation(sum(used) + 2).astype(np.int32)
    bt = np.full((len(new), max(used) + 1), -1, np.int32)
    at = 0
    for s, n in enumerate(used):
        bt[s, :n] = ids[at:at + n]
        at += n
    draw = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    case = dataclasses.replace(
        case, q=draw(sum(new), 2, 128), key_cache=draw(len(ids), 16, 2, 128),
        value_cache=draw(len(ids), 16, 2, 128), block_tables=bt, seq_lens=np.array(lens, np.int32),
        cu_seqlens_q=np.concatenate([[0], np.cumsum(new)]).astype(np.int32), scale=128 ** -0.5)
    ref = numpy_reference(case)
    for tokens in (3, 8):
        out, info = run(executor, case, decode_tokens=tokens)
        assert info["decode_tokens"] == tokens, info
        assert_close(out, ref, "float32", str(info))
        only_decode, _ = run(executor, case, decode_tokens=tokens, kernels=("decode",))
        prefill_rows = np.repeat(np.array(new) >= 9, new)
        assert np.isnan(only_decode[prefill_rows]).all()
        assert_close(only_decode[~prefill_rows], ref[~prefill_rows], "float32", str(info))
