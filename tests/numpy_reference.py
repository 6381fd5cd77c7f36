"""Independent float64 numpy references and random paged-batch builders.

Nothing here uses vllm_metal or MLX kernels: these are the oracles the
primitives are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def paged_attention_f64(q, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
                        scale, sliding_window=None, softcap=None, sinks=None, v_head_dim=None,
                        causal=True):
    """Straight-from-the-definition paged attention in float64, one token at a time.

    sinks[h]: one more logit in head h's softmax denominator, with no value.
    v_head_dim: the values are the first v_head_dim entries of each value row.
    causal=False: every key of the sequence (within sliding_window on either side).
    """
    q = np.asarray(q, np.float64)
    kc = np.asarray(key_cache, np.float64)
    vc = np.asarray(value_cache, np.float64)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = kc.shape
    vc = vc[..., :head_dim if v_head_dim is None else v_head_dim]
    group = num_heads // num_kv_heads
    out = np.zeros((num_tokens, num_heads, vc.shape[-1]))
    for s in range(len(seq_lens)):
        lo_tok, hi_tok = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        n, ctx = hi_tok - lo_tok, int(seq_lens[s])
        positions = np.arange(ctx)
        blocks = block_tables[s][positions // block_size]
        keys = kc[blocks, positions % block_size]  # [ctx, kv_heads, D]
        values = vc[blocks, positions % block_size]
        for j in range(n):
            pos = ctx - n + j
            visible = positions <= pos if causal else np.ones(ctx, bool)
            if sliding_window is not None:
                visible &= positions > pos - sliding_window
                if not causal:
                    visible &= positions < pos + sliding_window
            for h in range(num_heads):
                kvh = h // group
                scores = keys[:, kvh] @ q[lo_tok + j, h] * scale
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                scores = np.where(visible, scores, -np.inf)
                m = scores.max() if sinks is None else max(scores.max(), float(sinks[h]))
                p = np.exp(scores - m)
                denominator = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
                out[lo_tok + j, h] = (p / denominator) @ values[:, kvh]
    return out


@dataclass
class PagedBatch:
    """A random varlen batch over a physically shuffled paged cache (numpy)."""

    q: np.ndarray
    key_cache: np.ndarray
    value_cache: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    cu_seqlens_q: np.ndarray
    scale: float


def make_batch(rng, *, new_tokens, context_lens, num_heads, num_kv_heads, head_dim,
               block_size, dtype=np.float32, spare_blocks=3, value_head_dim=None):
    """new_tokens[s] tokens for sequence s whose total context is context_lens[s].

    value_head_dim: the value cache's row size (default head_dim).
    """
    assert all(n <= c for n, c in zip(new_tokens, context_lens))
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    max_blocks = max(blocks_per_seq + [1]) + 1  # a spare column past every sequence
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = rng.permutation(num_blocks)  # physically non-contiguous blocks
    block_tables = np.zeros((len(context_lens), max_blocks), np.int32)
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = order[used:used + nb]
        block_tables[s, nb:] = -7  # garbage past the sequence's end must never be read
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    v_shape = shape[:3] + (value_head_dim or head_dim,)
    total = int(sum(new_tokens))
    return PagedBatch(
        q=rng.standard_normal((total, num_heads, head_dim)).astype(dtype),
        key_cache=rng.standard_normal(shape).astype(dtype),
        value_cache=rng.standard_normal(v_shape).astype(dtype),
        block_tables=block_tables,
        seq_lens=np.asarray(context_lens, np.int32),
        cu_seqlens_q=np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32),
        scale=float(head_dim) ** -0.5,
    )


def batch_lengths(rng, kind: str, block_size: int):
    """(new_tokens, context_lens) for a 'decode', 'prefill' or 'mixed' batch."""
    if kind == "decode":
        ctx = rng.integers(1, 9 * block_size, size=int(rng.integers(1, 5)))
        return [1] * len(ctx), ctx.tolist()
    if kind == "prefill":
        new = rng.integers(1, 40, size=int(rng.integers(1, 4)))
        return new.tolist(), new.tolist()
    # mixed: decodes, fresh prefills, and chunked prefills continuing a cache
    new, ctx = [], []
    for _ in range(int(rng.integers(2, 5))):
        role = rng.integers(3)
        if role == 0:
            new.append(1)
            ctx.append(int(rng.integers(1, 6 * block_size)))
        elif role == 1:
            n = int(rng.integers(2, 30))
            new.append(n)
            ctx.append(n)
        else:
            n = int(rng.integers(2, 30))
            new.append(n)
            ctx.append(n + int(rng.integers(1, 4 * block_size)))
    return new, ctx


def gated_delta_f64(q, k, v, g, beta, state, mask=None):
    """The gated delta rule recurrence in float64, straight from its
    definition (csrc/gated_delta.h): q, k [B, T, Hk, Dk], v [B, T, Hv, Dv],
    g, beta [B, T, Hv], state [B, Hv, Dv, Dk], mask [B, T] bool or None.
    Returns (y [B, T, Hv, Dv], final state [B, Hv, Dv, Dk]); masked steps give
    y = 0 and leave the state as it is."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    S = np.array(state, np.float64)
    B, T, Hk, _ = q.shape
    Hv, Dv = v.shape[2:]
    y = np.zeros((B, T, Hv, Dv))
    for b in range(B):
        for h in range(Hv):
            hk = h // (Hv // Hk)
            for t in range(T):
                if mask is not None and not mask[b, t]:
                    continue
                S[b, h] *= g[b, t, h]
                kv = S[b, h] @ k[b, t, hk]
                delta = (v[b, t, h] - kv) * beta[b, t, h]
                S[b, h] += np.outer(delta, k[b, t, hk])
                y[b, t, h] = S[b, h] @ q[b, t, hk]
    return y, S


def gated_delta_inputs(rng, *, batch, steps, k_heads, v_heads, key_dim, value_dim, masked=False):
    """Random inputs shaped as a Gated DeltaNet layer makes them: q, k
    L2-normalised (q also scaled by key_dim ** -0.5), g in (0, 1), beta in
    (0, 1), a random state; a right-padding mask (each row a random length
    >= 1) when `masked`. All float32 numpy arrays (mask bool)."""
    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit((batch, steps, k_heads, key_dim)) * key_dim ** -0.5
    k = unit((batch, steps, k_heads, key_dim))
    v = rng.standard_normal((batch, steps, v_heads, value_dim))
    g = np.exp(-rng.uniform(0.01, 0.5, (batch, steps, v_heads)))
    beta = rng.uniform(0.05, 0.95, (batch, steps, v_heads))
    state = 0.3 * rng.standard_normal((batch, v_heads, value_dim, key_dim))
    mask = None
    if masked:
        lengths = rng.integers(1, steps + 1, batch)
        mask = np.arange(steps)[None, :] < lengths[:, None]
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    return f32(q), f32(k), f32(v), f32(g), f32(beta), f32(state), mask
