"""Randomized and adversarial inputs to ops.paged_attention and ops.write_kv.

Run by test_primitive_fuzz.py in a subprocess, so a crash (a signal, an abort
in C++) fails that test instead of killing pytest. Every case must either
give results equal to the float64 numpy reference or raise ValueError,
TypeError or RuntimeError whose message names the argument at fault; after
every case a valid call must still be correct. NaN/Inf data must not crash
and must not leak into sequences that never read it.

    python tests/reliability/fuzz_primitives.py --cases 300 --seed 0 [--trace FILE] [--only CASE]

Prints one JSON line: {"cases", "outcomes", "unexpected": [...]}; --trace
writes each case's name before it runs, so a crash names its case.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the references

from vllm_metal.native import ops  # noqa: E402  (fast BLAS before mlx)

import mlx.core as mx  # noqa: E402
from array_helpers import MX_DTYPES, TOLERANCE, to_np  # noqa: E402
from numpy_reference import batch_lengths, make_batch, paged_attention_f64  # noqa: E402

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
ERRORS = (ValueError, TypeError, RuntimeError)


class Unexpected(Exception):
    pass


# ---- paged_attention -------------------------------------------------------

def random_batch(rng):
    """A valid random batch: (kwargs for ops.paged_attention as numpy, dtype)."""
    block_size = int(rng.choice([8, 16, 32]))
    num_kv_heads = int(rng.integers(1, 4))
    group = int(rng.choice([1, 2, 4]))
    head_dim = int(rng.choice([16, 32, 64, 80, 128]))
    new, ctx = batch_lengths(rng, str(rng.choice(["decode", "prefill", "mixed"])), block_size)
    b = make_batch(rng, new_tokens=new, context_lens=ctx, num_heads=num_kv_heads * group,
                   num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    args = dict(q=b.q, key_cache=b.key_cache, value_cache=b.value_cache, block_tables=b.block_tables,
                seq_lens=b.seq_lens, cu_seqlens_q=b.cu_seqlens_q, scale=b.scale,
                sliding_window=int(rng.integers(1, 40)) if rng.random() < 0.2 else None,
                softcap=float(rng.uniform(5, 50)) if rng.random() < 0.2 else None)
    return args, str(rng.choice(list(MX_DTYPES)))


def reference(a):
    return paged_attention_f64(a["q"], a["key_cache"], a["value_cache"], a["block_tables"], a["seq_lens"],
                               a["cu_seqlens_q"], a["scale"], a["sliding_window"], a["softcap"])


def run_attention(a, dtype, *, as_mx=("q", "key_cache", "value_cache"), views=None):
    """Calls the op with float arrays as mx (in `dtype`) and index arrays as given."""
    arrays = {}
    for name in ("q", "key_cache", "value_cache", "block_tables", "seq_lens", "cu_seqlens_q"):
        value = a[name]
        if name in as_mx and isinstance(value, np.ndarray):
            value = mx.array(value).astype(MX_DTYPES[dtype]) if value.dtype.kind == "f" else mx.array(value)
        if views and name in views:
            value = views[name](value)
        arrays[name] = value
    out = ops.paged_attention(arrays["q"], arrays["key_cache"], arrays["value_cache"], arrays["block_tables"],
                              arrays["seq_lens"], arrays["cu_seqlens_q"], scale=a["scale"],
                              sliding_window=a["sliding_window"], softcap=a["softcap"], stream=a.get("stream"))
    mx.eval(out)
    return to_np(out)


def stored(a, dtype):
    """The inputs as the op sees them after rounding to `dtype` (the reference's input)."""
    rounded = dict(a)
    for name in ("q", "key_cache", "value_cache"):
        rounded[name] = to_np(mx.array(a[name]).astype(MX_DTYPES[dtype]))
    return rounded


def check_close(got, want, dtype, rows=None, what=""):
    atol, rtol = TOLERANCE[dtype]
    if rows is not None:
        got, want = got[rows], want[rows]
    if got.shape != want.shape or not np.allclose(got, want, atol=atol * 4, rtol=rtol * 4):
        worst = np.nanmax(np.abs(got - want)) if got.shape == want.shape else f"shape {got.shape} vs {want.shape}"
        raise Unexpected(f"wrong result {what}: max error {worst}")


def expect_error(call, pattern: str):
    try:
        call()
    except ERRORS as e:
        if not re.search(pattern, str(e)):
            raise Unexpected(f"{type(e).__name__} does not name the problem ({pattern!r}): {e}") from None
        return "error"
    raise Unexpected(f"accepted, expected an error matching {pattern!r}")


def used_cell(rng, a):
    """(seq, block index) of a block-table entry the op must read."""
    seqs = [s for s in range(len(a["seq_lens"])) if a["seq_lens"][s] > 0]
    s = int(rng.choice(seqs))
    return s, int(rng.integers(0, -(-int(a["seq_lens"][s]) // a["key_cache"].shape[1])))


def seq_of_tokens(a):
    cu = a["cu_seqlens_q"]
    return np.repeat(np.arange(len(cu) - 1), np.diff(cu))


def attention_cases():
    """name -> fn(rng, args, dtype) returning an outcome string."""
    cases = {}

    def case(fn):
        cases[fn.__name__] = fn
        return fn

    @case
    def valid(rng, a, dtype):
        check_close(run_attention(a, dtype), reference(stored(a, dtype)), dtype)
        return "ok"

    @case
    def host_index_arrays(rng, a, dtype):  # numpy / lists, any integer width
        a = dict(a, block_tables=a["block_tables"].astype(np.int64), seq_lens=a["seq_lens"].tolist(),
                 cu_seqlens_q=a["cu_seqlens_q"].astype(np.uint16))
        check_close(run_attention(a, dtype, as_mx=("q", "key_cache", "value_cache")),
                    reference(stored(a, dtype)), dtype)
        return "ok"

    @case
    def strided_views(rng, a, dtype):  # non-contiguous inputs must be read through their strides
        views = dict(q=lambda x: mx.swapaxes(mx.swapaxes(x, 0, 1).astype(x.dtype) * 1, 0, 1),
                     key_cache=lambda x: mx.concatenate([x, x], axis=3)[..., :x.shape[3]],
                     value_cache=lambda x: mx.concatenate([x, x], axis=2)[:, :, x.shape[2]:],
                     block_tables=lambda x: mx.swapaxes(mx.array(np.ascontiguousarray(np.asarray(x).T)), 0, 1))
        a2 = dict(a, block_tables=a["block_tables"])
        check_close(run_attention(a2, dtype, as_mx=("q", "key_cache", "value_cache", "block_tables"), views=views),
                    reference(stored(a, dtype)), dtype)
        return "ok"

    @case
    def garbage_past_the_end(rng, a, dtype):  # unused table entries are never read
        bt = a["block_tables"].copy()
        for s in range(len(bt)):
            used = -(-int(a["seq_lens"][s]) // a["key_cache"].shape[1])
            bt[s, used:] = rng.choice([INT32_MIN, INT32_MAX, -1, 10**6])
        a = dict(a, block_tables=bt)
        check_close(run_attention(a, dtype), reference(stored(a, dtype)), dtype)
        return "ok"

    @case
    def block_id_out_of_range(rng, a, dtype):
        bt = a["block_tables"].copy()
        s, b = used_cell(rng, a)
        bt[s, b] = rng.choice([a["key_cache"].shape[0], a["key_cache"].shape[0] + 7, -1, INT32_MIN, INT32_MAX])
        return expect_error(lambda: run_attention(dict(a, block_tables=bt), dtype),
                            rf"block_tables\[{s}, {b}\] = -?\d+ is out of range")

    @case
    def block_id_beyond_int32_on_host(rng, a, dtype):
        bt = a["block_tables"].astype(np.int64)
        s, b = used_cell(rng, a)
        bt[s, b] += int(rng.choice([2**32, -2**32, 2**40]))
        return expect_error(lambda: run_attention(dict(a, block_tables=bt), dtype),
                            rf"block_tables\[{s}, {b}\] = -?\d+ does not fit in int32")

    @case
    def lazy_bad_block_id(rng, a, dtype):  # known only at eval
        bt = a["block_tables"].copy()
        s, b = used_cell(rng, a)
        bt[s, b] = -5
        lazy = lambda x: x + mx.array(0, dtype=mx.int32)  # noqa: E731
        return expect_error(lambda: run_attention(dict(a, block_tables=bt), dtype,
                                                  as_mx=("q", "key_cache", "value_cache", "block_tables"),
                                                  views=dict(block_tables=lazy)),
                            r"block_tables\[\d+, \d+\] = -5 is out of range")

    @case
    def seq_len_beyond_capacity(rng, a, dtype):
        sl = a["seq_lens"].copy()
        s = int(rng.integers(len(sl)))
        capacity = a["block_tables"].shape[1] * a["key_cache"].shape[1]
        sl[s] = rng.choice([capacity + 1, INT32_MAX])
        return expect_error(lambda: run_attention(dict(a, seq_lens=sl), dtype),
                            rf"seq_lens\[{s}\] = \d+ must be .* <= the block table capacity")

    @case
    def seq_len_below_new_tokens(rng, a, dtype):
        sl = a["seq_lens"].copy()
        n = np.diff(a["cu_seqlens_q"])
        s = int(rng.integers(len(sl)))
        sl[s] = rng.choice([n[s] - 1, -1, INT32_MIN])
        return expect_error(lambda: run_attention(dict(a, seq_lens=sl), dtype),
                            rf"seq_lens\[{s}\] = -?\d+ must be >= the {n[s]} new tokens")

    @case
    def cu_seqlens_inconsistent(rng, a, dtype):
        cu = a["cu_seqlens_q"].copy()
        how = str(rng.choice(["start", "end", "decreasing", "huge"]))
        if how == "start":
            cu[0] = rng.choice([1, -1, INT32_MAX])
        elif how == "end":
            cu[-1] += int(rng.choice([1, -1, 1000]))
        elif how == "decreasing" and len(cu) > 2:
            cu[1] = cu[-1] + 1
        else:
            cu[-1] = INT32_MAX
        pattern = r"cu_seqlens_q must (start at 0 and end at num_tokens|be non-decreasing)"
        return expect_error(lambda: run_attention(dict(a, cu_seqlens_q=cu), dtype), pattern)

    @case
    def empty_batch(rng, a, dtype):
        H, D = a["q"].shape[1:]
        a = dict(a, q=np.zeros((0, H, D), np.float32), block_tables=np.zeros((0, 3), np.int32),
                 seq_lens=np.zeros(0, np.int32), cu_seqlens_q=np.zeros(1, np.int32))
        out = run_attention(a, dtype)
        if out.shape != (0, H, D):
            raise Unexpected(f"empty batch gave shape {out.shape}")
        return "ok"

    @case
    def sequence_without_new_tokens(rng, a, dtype):
        # an extra sequence with context but nothing scheduled: no rows, no effect
        bt = np.concatenate([a["block_tables"], a["block_tables"][:1]])
        a = dict(a, block_tables=bt, seq_lens=np.append(a["seq_lens"], 1).astype(np.int32),
                 cu_seqlens_q=np.append(a["cu_seqlens_q"], a["cu_seqlens_q"][-1]).astype(np.int32))
        check_close(run_attention(a, dtype), reference(stored(a, dtype)), dtype)
        return "ok"

    @case
    def nan_inf_in_q(rng, a, dtype):
        q = a["q"].copy()
        t = int(rng.integers(len(q)))
        q[t, int(rng.integers(q.shape[1])), 0] = rng.choice([np.nan, np.inf, -np.inf])
        a = dict(a, q=q)
        rows = np.arange(len(q)) != t  # every other token is untouched
        check_close(run_attention(a, dtype), reference(stored(a, dtype)), dtype, rows=rows, what="beside a NaN query")
        return "ok"

    @case
    def nan_inf_in_cache(rng, a, dtype):
        # poison one block that sequence s reads: only s's rows may change
        s, b = used_cell(rng, a)
        block = int(a["block_tables"][s, b])
        kc, vc = a["key_cache"].copy(), a["value_cache"].copy()
        (kc if rng.random() < 0.5 else vc)[block, 0, 0, 0] = rng.choice([np.nan, np.inf, -np.inf])
        a = dict(a, key_cache=kc, value_cache=vc)
        readers = {t for t in range(len(a["seq_lens"])) if block in
                   a["block_tables"][t, :-(-int(a["seq_lens"][t]) // kc.shape[1]) or None].tolist()
                   and a["seq_lens"][t] > 0}
        rows = ~np.isin(seq_of_tokens(a), list(readers))
        check_close(run_attention(a, dtype), reference(stored(a, dtype)), dtype, rows=rows,
                    what="in a sequence that never reads the poisoned block")
        return "ok"

    @case
    def nan_inf_in_unused_block(rng, a, dtype):
        kc = a["key_cache"].copy()
        used = {int(a["block_tables"][s, b]) for s in range(len(a["seq_lens"]))
                for b in range(-(-int(a["seq_lens"][s]) // kc.shape[1]))}
        spare = [b for b in range(kc.shape[0]) if b not in used]
        kc[spare] = np.nan
        a = dict(a, key_cache=kc)
        check_close(run_attention(a, dtype), reference(stored(a, dtype)), dtype)
        return "ok"

    @case
    def random_garbage_indices(rng, a, dtype):
        # whatever the index arrays hold: a correct result or a clear error, never a crash
        num_seqs = len(a["seq_lens"])
        a = dict(a, block_tables=rng.integers(-3, a["key_cache"].shape[0] + 3, a["block_tables"].shape, np.int32),
                 seq_lens=rng.integers(-2, 60, num_seqs, np.int32),
                 cu_seqlens_q=np.concatenate([[0], np.sort(rng.integers(-1, len(a["q"]) + 2, num_seqs))]
                                             ).astype(np.int32))
        try:
            out = run_attention(a, dtype)
        except ERRORS as e:
            if not str(e).startswith("[paged_attention] "):
                raise Unexpected(f"unclear message: {e}") from None
            return "error"
        check_close(out, reference(stored(a, dtype)), dtype)
        return "ok"

    @case
    def bad_scalar(rng, a, dtype):
        which = str(rng.choice(["scale", "sliding_window", "softcap"]))
        bad = dict(scale=[0.0, -1.0, float("nan"), float("inf")],
                   sliding_window=[0, -3], softcap=[0.0, -2.0, float("nan"), float("inf")])[which]
        return expect_error(lambda: run_attention(dict(a, **{which: rng.choice(bad)}), dtype), rf"{which} must be")

    @case
    def wrong_index_dtype(rng, a, dtype):
        name = str(rng.choice(["block_tables", "seq_lens", "cu_seqlens_q"]))
        bad = rng.choice(["float", "int64"])
        value = a[name].astype(np.float32) if bad == "float" else mx.array(a[name].astype(np.int64))
        pattern = rf"{name} must (hold integers|be int32)"
        return expect_error(lambda: run_attention(dict(a, **{name: value}), dtype), pattern)

    @case
    def wrong_shapes(rng, a, dtype):
        H, D = a["q"].shape[1:]
        kv_heads = a["key_cache"].shape[2]
        which = str(rng.choice(["q_rank", "heads", "head_dim", "table_rows", "cu_len", "cache_mismatch"]))
        if which == "heads" and kv_heads == 1:  # every head count is a multiple of 1
            which = "q_rank"
        change = dict(q_rank=("q", a["q"][0], r"q must have rank 3"),
                      heads=("q", np.zeros((a["q"].shape[0], H + 1, D), np.float32), r"num_heads .* multiple"),
                      head_dim=("q", a["q"][..., : D // 2], r"head_dim mismatch"),
                      table_rows=("block_tables", a["block_tables"][:0], r"block_tables has 0 rows"),
                      cu_len=("cu_seqlens_q", a["cu_seqlens_q"][:-1], r"cu_seqlens_q must have num_seqs \+ 1"),
                      cache_mismatch=("value_cache", a["value_cache"][:-1], r"differs from value_cache"))[which]
        return expect_error(lambda: run_attention(dict(a, **{change[0]: change[1]}), dtype), change[2])

    @case
    def wrong_types(rng, a, dtype):
        which = str(rng.choice(["q", "stream", "scale"]))
        if which == "q":
            return expect_error(lambda: ops.paged_attention(a["q"], mx.array(a["key_cache"]),
                                                            mx.array(a["value_cache"]), a["block_tables"],
                                                            a["seq_lens"], a["cu_seqlens_q"], scale=0.1),
                                r"q must be an mx.array")
        if which == "stream":
            return expect_error(lambda: run_attention(dict(a, stream="cpu"), dtype), r"stream must be")
        return expect_error(lambda: run_attention(dict(a, scale="big"), dtype), r"scale|incompatible function")

    return cases


# ---- write_kv --------------------------------------------------------------

def random_cache(rng):
    num_blocks, block_size = int(rng.integers(2, 12)), int(rng.choice([8, 16]))
    kv_heads, head_dim = int(rng.integers(1, 4)), int(rng.choice([16, 64]))
    shape = (num_blocks, block_size, kv_heads, head_dim)
    n = int(rng.integers(0, 20))
    return (rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32),
            rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32),
            rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32))


def scatter_reference(kc, vc, k, v, slots):
    num_slots = kc.shape[0] * kc.shape[1]
    kf, vf = kc.reshape(num_slots, *kc.shape[2:]).copy(), vc.reshape(num_slots, *vc.shape[2:]).copy()
    for i, s in enumerate(slots):
        if 0 <= s < num_slots:
            kf[s], vf[s] = k[i], v[i]
    return kf.reshape(kc.shape), vf.reshape(vc.shape)


def write(kc, vc, k, v, slots):
    a, b = ops.write_kv(mx.array(kc), mx.array(vc), mx.array(k), mx.array(v), slots)
    mx.eval(a, b)
    return np.array(a), np.array(b)


def write_cases():
    cases = {}

    def case(fn):
        cases["write_kv_" + fn.__name__] = fn
        return fn

    def distinct_slots(rng, kc, n, allow_pad=True):
        # distinct where they fit: which of two writes to one slot lands is unspecified
        num_slots = kc.shape[0] * kc.shape[1]
        slots = rng.permutation(num_slots)[:n] if n <= num_slots else rng.integers(0, num_slots, n)
        if allow_pad and n:
            slots[rng.random(n) < 0.2] = -1
        return slots.astype(np.int64)

    @case
    def valid(rng):
        kc, vc, k, v = random_cache(rng)
        if len(k) > kc.shape[0] * kc.shape[1]:
            k, v = k[:kc.shape[0]], v[:kc.shape[0]]
        slots = distinct_slots(rng, kc, len(k))
        as_lazy = rng.random() < 0.3
        got = write(kc, vc, k, v, mx.array(slots) + 0 if as_lazy else slots)
        for g, w in zip(got, scatter_reference(kc, vc, k, v, slots)):
            if not np.array_equal(g, w):
                raise Unexpected("write_kv wrote the wrong slots")
        return "ok"

    @case
    def host_slot_out_of_range(rng):
        kc, vc, k, v = random_cache(rng)
        if not len(k):
            k, v = np.zeros((1, *kc.shape[2:]), np.float32), np.zeros((1, *kc.shape[2:]), np.float32)
        slots = distinct_slots(rng, kc, len(k))
        i = int(rng.integers(len(slots)))
        slots[i] = rng.choice([kc.shape[0] * kc.shape[1], -2, 2**62, -2**62])
        return expect_error(lambda: write(kc, vc, k, v, slots), rf"slot_mapping\[{i}\] = -?\d+ is outside")

    @case
    def lazy_slot_out_of_range_is_dropped(rng):
        kc, vc, k, v = random_cache(rng)
        k, v = k[:kc.shape[0] * kc.shape[1]], v[:kc.shape[0] * kc.shape[1]]  # distinct slots: one writer each
        if not len(k):
            return "ok"
        slots = distinct_slots(rng, kc, len(k))
        slots[rng.random(len(slots)) < 0.3] = rng.choice([kc.shape[0] * kc.shape[1] + 5, -9, 2**40])
        got = write(kc, vc, k, v, mx.array(slots) + 0)
        for g, w in zip(got, scatter_reference(kc, vc, k, v, slots)):
            if not np.array_equal(g, w):
                raise Unexpected("an out-of-range lazy slot was written or a valid one lost")
        return "ok"

    @case
    def bad_arguments(rng):
        kc, vc, k, v = random_cache(rng)
        n = len(k)
        if n == 0:  # an empty mapping holds no wrong values
            k = v = np.zeros((1, *kc.shape[2:]), np.float32)
            n = 1
        which = str(rng.choice(["float_slots", "slot_count", "k_shape", "k_dtype", "cache_rank", "not_array"]))
        if which == "float_slots":
            return expect_error(lambda: write(kc, vc, k, v, np.zeros(n) + 0.5), r"slot_mapping must hold integers")
        if which == "slot_count":
            return expect_error(lambda: write(kc, vc, k, v, np.zeros(n + 1, np.int64)),
                                r"slot_mapping must be \[num_tokens\]")
        if which == "k_shape":
            return expect_error(lambda: write(kc, vc, k[..., :1], v, np.full(n, -1)), r"k must be \[num_tokens")
        if which == "k_dtype":
            return expect_error(lambda: ops.write_kv(mx.array(kc), mx.array(vc), mx.array(k).astype(mx.float16),
                                                     mx.array(v), np.full(n, -1)), r"k dtype")
        if which == "cache_rank":
            return expect_error(lambda: write(kc[0], vc[0], k, v, np.full(n, -1)), r"key_cache must have rank 4")
        return expect_error(lambda: ops.write_kv(kc, mx.array(vc), mx.array(k), mx.array(v), np.full(n, -1)),
                            r"key_cache must be an mx.array")

    @case
    def nan_values(rng):
        kc, vc, k, v = random_cache(rng)
        if not len(k) or len(k) > kc.shape[0] * kc.shape[1]:
            return "ok"
        k = k.copy()
        k[0] = np.nan
        slots = distinct_slots(rng, kc, len(k), allow_pad=False)
        got = write(kc, vc, k, v, slots)
        want = scatter_reference(kc, vc, k, v, slots)
        if not all(np.array_equal(g, w, equal_nan=True) for g, w in zip(got, want)):
            raise Unexpected("NaN values were not written as given")
        return "ok"

    return cases


# ---- driver ----------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", type=Path)
    parser.add_argument("--only", action="append", help="run only these cases (repeatable)")
    opts = parser.parse_args(argv)
    rng = np.random.default_rng(opts.seed)
    mx.set_default_device(mx.cpu)
    attention, writes = attention_cases(), write_cases()
    names = opts.only or list(attention) + list(writes)
    unknown = set(names) - set(attention) - set(writes)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {sorted(attention) + sorted(writes)}")
    trace = open(opts.trace, "w", buffering=1) if opts.trace else None
    outcomes, unexpected = Counter(), []
    baseline, baseline_dtype = random_batch(np.random.default_rng(opts.seed + 1))
    baseline_out = reference(stored(baseline, baseline_dtype))
    for i in range(opts.cases):
        name = names[i % len(names)]
        args, dtype = random_batch(rng)
        if trace:
            trace.write(f"{i} {name} {dtype} q{args['q'].shape} cache{args['key_cache'].shape}\n")
        try:
            if name in attention:
                outcome = attention[name](rng, args, dtype)
            else:
                outcome = writes[name](rng)
            outcomes[outcome] += 1
        except Unexpected as e:
            unexpected.append(f"case {i} {name} ({dtype}): {e}")
        except Exception as e:  # noqa: BLE001 -- any other exception type is a finding
            unexpected.append(f"case {i} {name} ({dtype}): {type(e).__name__}: {e}")
        try:  # the primitive still works after whatever happened
            check_close(run_attention(baseline, baseline_dtype), baseline_out, baseline_dtype,
                        what="on the valid call after the case")
        except Exception as e:  # noqa: BLE001
            unexpected.append(f"after case {i} {name}: {type(e).__name__}: {e}")
    print(json.dumps(dict(cases=opts.cases, outcomes=dict(outcomes), unexpected=unexpected)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
