"""Randomised paged-attention batches for the Metal kernel tests, with the CPU
primitive (vllm_metal.native.ops.paged_attention on mx.cpu) as the reference.

Values are drawn in float32 and rounded to the case's dtype once, so the
kernel under test and the reference see bit-identical inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from msl_executor import bf16_bits_to_float, float_to_bf16_bits

DTYPES = ("float32", "float16", "bfloat16")
MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# Both sides accumulate in float32 and round once at the end; allow a couple
# of units in the last place of the output dtype (outputs are O(1)).
TOLERANCE = {  # dtype -> (atol, rtol)
    "float32": (2e-5, 1e-4),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
}

# Batch shapes -> which kernels write its rows (decided per row on the GPU:
# sequences with >= 9 new tokens go to prefill, the rest -- decodes and
# speculative decoding's verify rows, up to 8 -- to decode).
KINDS = {
    "decode": {"decode"},                    # a few sequences, one new token each
    "multi_token_decode": {"decode"},        # 2..8 new tokens each (speculative decoding's verify rows)
    "prefill": {"prefill"},                  # fresh and chunked prefills
    "mixed": {"decode", "prefill"},          # decodes next to a prefill chunk
    "long_decode": {"decode"},               # contexts long enough to be partitioned
}


def round_to(dtype: str, x: np.ndarray) -> np.ndarray:
    """float32 values exactly representable in dtype."""
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_bits_to_float(float_to_bf16_bits(x))
    return x.astype(np.float32)


def storage(dtype: str, x: np.ndarray) -> np.ndarray:
    """x in the executor's storage type (bfloat16 as bit patterns)."""
    if dtype == "float16":
        return x.astype(np.float16)
    if dtype == "bfloat16":
        return float_to_bf16_bits(x)
    return x.astype(np.float32)


@dataclass
class Case:
    dtype: str
    q: np.ndarray            # float32, rounded to dtype
    key_cache: np.ndarray
    value_cache: np.ndarray
    block_tables: np.ndarray  # int32
    seq_lens: np.ndarray
    cu_seqlens_q: np.ndarray
    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    kind: str = ""
    extra: dict = field(default_factory=dict)
    sinks: np.ndarray | None = None   # float32 [num_heads]
    v_head_dim: int | None = None
    shared_kv: bool = False           # value_cache is key_cache (latent attention)
    causal: bool = True               # False: every key of the sequence (encoders)

    def kwargs(self) -> dict:
        """Keyword arguments for ops.paged_attention and the executor alike."""
        kw = dict(scale=self.scale, sliding_window=self.sliding_window, softcap=self.softcap)
        if not self.causal:
            kw["causal"] = False
        if self.sinks is not None:
            kw["sinks"] = self.sinks
        if self.v_head_dim is not None:
            kw["v_head_dim"] = self.v_head_dim
        return kw


def _batch(rng: np.random.Generator, kind: str) -> tuple[list[int], list[int]]:
    """(seq_lens, new tokens per sequence) for a kind of batch."""
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    if kind == "decode":
        lens = [r(1, 150) for _ in range(r(3, 5))]
        return lens, [1] * len(lens)
    if kind == "prefill":
        fresh = r(9, 48)
        cached, chunk = r(5, 60), r(9, 40)
        return [fresh, cached + chunk], [fresh, chunk]
    if kind == "multi_token_decode":
        new = [r(2, 8) for _ in range(4)]
        return [r(n, 120) for n in new], new
    if kind == "mixed":
        lens = [r(1, 120) for _ in range(r(2, 6))]
        cached, chunk = r(0, 40), r(9, 40)
        at = r(0, len(lens))  # the chunk anywhere among the decodes
        return (lens[:at] + [cached + chunk] + lens[at:],
                [1] * at + [chunk] + [1] * (len(lens) - at))
    if kind == "long_decode":
        lens = [r(700, 1300) for _ in range(2)]
        return lens, [1, 1]
    if kind.startswith("verify_b"):  # verify_b<N>: N sequences of 2..8 new tokens (the verify regime)
        new = [r(2, 8) for _ in range(int(kind.removeprefix("verify_b")))]
        lens = [r(n, 90) for n in new]
        if len(new) == 1:  # alone: a context long enough for the plan's own key partitions
            lens = [r(600, 1100)]
        return lens, new
    raise ValueError(kind)


def make_case(rng: np.random.Generator, *, dtype: str, head_dim: int, group: int,
              block_size: int, kind: str, num_kv_heads: int = 2,
              sliding_window: int | None = None, softcap: float | None = None,
              sinks: bool = False, v_head_dim: int | None = None,
              shared_kv: bool = False, causal: bool = True) -> Case:
    """sinks: draw one per head (one dominant, one -inf where there are 3+
    heads). v_head_dim: the values' size; with shared_kv the values are the
    first v_head_dim entries of the key rows (one cache, as in MLA), else a
    value cache of that width."""
    seq_lens, new_tokens = _batch(rng, kind)
    num_seqs = len(seq_lens)
    used = [(n + block_size - 1) // block_size for n in seq_lens]
    max_blocks = max(used) + 1  # a spare column the kernels must not read
    num_blocks = sum(used) + 3
    ids = rng.permutation(num_blocks).astype(np.int32)
    block_tables = np.empty((num_seqs, max_blocks), np.int32)
    at = 0
    for s, n in enumerate(used):
        block_tables[s, :n] = ids[at:at + n]
        # Entries past the used blocks are never validated: garbage on purpose.
        block_tables[s, n:] = rng.choice([-1, num_blocks, 1 << 30], size=max_blocks - n)
        at += n
    num_heads = group * num_kv_heads
    num_tokens = sum(new_tokens)
    draw = lambda *shape: round_to(dtype, rng.standard_normal(shape, dtype=np.float32))  # noqa: E731
    q = draw(num_tokens, num_heads, head_dim)
    key_cache = draw(num_blocks, block_size, num_kv_heads, head_dim)
    if shared_kv:
        value_cache = key_cache
    else:
        value_cache = draw(num_blocks, block_size, num_kv_heads, v_head_dim or head_dim)
    sink_values = None
    if sinks:
        sink_values = rng.normal(0.0, 2.0, num_heads).astype(np.float32)
        sink_values[0] = 6.0  # outweighs every key
        if num_heads >= 3:
            sink_values[-1] = -np.inf  # no sink at all
    return Case(
        dtype=dtype,
        q=q,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=np.array(seq_lens, np.int32),
        cu_seqlens_q=np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32),
        scale=float(head_dim) ** -0.5,
        sliding_window=sliding_window,
        softcap=softcap,
        kind=kind,
        sinks=sink_values,
        v_head_dim=v_head_dim,
        shared_kv=shared_kv,
        causal=causal,
    )


def mx_inputs(case: Case) -> list[mx.array]:
    dt = MX_DTYPES[case.dtype]
    key_cache = mx.array(case.key_cache).astype(dt)
    value_cache = key_cache if case.shared_kv else mx.array(case.value_cache).astype(dt)
    return [mx.array(case.q).astype(dt), key_cache, value_cache, mx.array(case.block_tables),
            mx.array(case.seq_lens), mx.array(case.cu_seqlens_q)]


def cpu_reference(case: Case) -> np.ndarray:
    from vllm_metal.native import ops

    out = ops.paged_attention(*mx_inputs(case), **case.kwargs(), stream=mx.cpu)
    return np.array(out.astype(mx.float32))


def numpy_reference(case: Case) -> np.ndarray:
    """The float64 definition (tests/numpy_reference.py) on the case's inputs
    (already rounded to its dtype): independent of every kernel."""
    from numpy_reference import paged_attention_f64

    return paged_attention_f64(
        case.q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
        case.cu_seqlens_q, case.scale, sliding_window=case.sliding_window,
        softcap=case.softcap, sinks=case.sinks, v_head_dim=case.v_head_dim, causal=case.causal)


def assert_close(out: np.ndarray, ref: np.ndarray, dtype: str, what: str = "") -> None:
    atol, rtol = TOLERANCE[dtype]
    if out.shape != ref.shape:
        raise AssertionError(f"{what}: shape {out.shape} != reference {ref.shape}")
    bad = ~np.isclose(out, ref, atol=atol, rtol=rtol)  # NaN never passes
    if bad.any():
        i = tuple(int(x) for x in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements differ (atol={atol}, rtol={rtol}); "
            f"first at {i}: got {out[i]}, reference {ref[i]}; "
            f"max abs diff {np.nanmax(np.abs(out - ref)):.3g}")


# Bad batch metadata: the CPU backend raises at eval; the GPU cannot, so the
# kernels must write NaN for exactly the rows that would need the bad data,
# leave every other row exact, and never read outside a buffer. break_case breaks
# a case in place and returns (tokens that must be NaN, tokens that must be
# exact).
def break_case(case: Case, how: str) -> tuple[list[int], list[int]]:
    bt, sl, cu = case.block_tables, case.seq_lens, case.cu_seqlens_q
    n = np.diff(cu)
    bs = case.key_cache.shape[1]
    tokens = lambda s: list(range(cu[s], cu[s + 1]))  # noqa: E731
    others = [t for s in range(len(sl)) if s != 1 for t in tokens(s)]
    if how == "block_out_of_range":
        # The last block of sequence 1: only its rows at or past that block's
        # first position need it (causal attention).
        last = (sl[1] - 1) // bs
        bt[1, last] = case.key_cache.shape[0]
        pos = sl[1] - n[1] + np.arange(n[1])
        seq1 = np.array(tokens(1))
        return list(seq1[pos >= last * bs]), others + list(seq1[pos < last * bs])
    if how == "negative_block":
        bt[1, 0] = -5
        return tokens(1), others
    if how == "huge_block":
        bt[1, 0] = 2**31 - 1
        return tokens(1), others
    if how == "seq_len_over_capacity":
        sl[1] = bt.shape[1] * bs + 7
        return tokens(1), others
    if how == "seq_len_below_new_tokens":
        sl[1] = n[1] - 1
        return tokens(1), others
    if how == "cu_starts_late":
        cu[0] = 1
        return [0], [t for s in range(1, len(sl)) for t in tokens(s)]
    if how == "cu_past_end":
        last = len(sl) - 1
        exact = [t for s in range(last) for t in tokens(s)]
        cu[-1] += 5
        return list(range(cu[-2], len(case.q))), exact
    if how == "cu_not_monotone":
        exact = [t for s in range(3, len(sl)) for t in tokens(s)]
        cu[1] = cu[2] + 1
        return [], exact
    raise ValueError(how)


BAD_INPUTS = ["block_out_of_range", "negative_block", "huge_block", "seq_len_over_capacity",
              "seq_len_below_new_tokens", "cu_starts_late", "cu_past_end", "cu_not_monotone"]
