"""Gated DeltaNet (linear attention) layers of hybrid models on per-request
state slots: the `linear_attn` of qwen3_next, qwen3_5 and qwen3_5_moe, run
by mlx-lm's own convolution, gating (`compute_g`) and q/k normalisation, and
a gated-delta recurrence chosen per device (`ops.gated_delta_path`,
VLLM_METAL_GATED_DELTA): on MLX's CPU device this package's fused primitive
(`ops.gated_delta`: one C++ loop per sequence and head instead of mlx-lm's
handful of MLX ops per token, which made prefill ~30x slower), on the GPU
mlx-lm's `gated_delta_update` with its own Metal kernels. qwen3_5's layer
differs from qwen3_next's only in its input projections (separate in_proj_qkv
/ _z / _b / _a instead of two packed ones interleaved per key head), which
`projections` reads either way.

Each such layer keeps two state pools indexed by vLLM's Mamba-group block id
(one slot per request, mamba_cache_mode "none"): the causal convolution's
last `conv_kernel - 1` inputs [num_blocks, kernel - 1, conv_dim] in the
model dtype, and the recurrent matrix state [num_blocks, Hv, Dv, Dk] in
float32 (mlx-lm's shapes), gathered, run and written back as
models/state_slots.py describes: every row's scheduled tokens -- decode,
prefill and chunked prefill alike -- as one right-padded batch with a mask,
inside the step's one lazy graph. Rows verifying drafts (speculative
decoding) also keep their states after each position: the same call runs
each such row again over its first 1 .. width - 1 positions (models/draft_states.py).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from vllm_metal.native import ops
from vllm_metal.models.state_slots import SlotStep


# The input projections of the two Gated DeltaNet layouts served.
PACKED = ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")  # qwen3_next
SEPARATE = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # qwen3_5, qwen3_5_moe


class GatedDeltaLayer(nn.Module):
    """Wraps one mlx-lm Gated DeltaNet module: qwen3_next's
    `Qwen3NextGatedDeltaNet` (q, k, v, z and b, a interleaved per key head in
    two projections) or qwen3_5's `GatedDeltaNet` (q | k | v in one
    projection, z, b and a in three more). Its weights stay where they are."""

    kind = "gated delta"  # registry.Family.linear

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.packed = all(hasattr(inner, n) for n in PACKED)
        needed = ("conv1d", "A_log", "dt_bias", "norm", "out_proj") + (PACKED if self.packed else SEPARATE)
        missing = [n for n in needed if not hasattr(inner, n)]
        if missing:
            raise NotImplementedError(f"linear attention module {type(inner).__module__}.{type(inner).__name__} "
                                      f"lacks {', '.join(missing)}: not the Gated DeltaNet layout served here")
        self.inner = inner
        self.conv_kernel = int(inner.conv_kernel_size)
        self.conv_dim = int(inner.conv_dim)
        self.num_k_heads, self.num_v_heads = int(inner.num_k_heads), int(inner.num_v_heads)
        self.head_k_dim, self.head_v_dim = int(inner.head_k_dim), int(inner.head_v_dim)
        self.key_dim = self.num_k_heads * self.head_k_dim
        # The fused primitive where the path says so and it supports the head sizes.
        self.fused = (ops.gated_delta_path()[0] == "fused" and self.head_k_dim in ops.GATED_DELTA_KEY_DIMS
                      and self.head_v_dim <= ops.GATED_DELTA_MAX_VALUE_DIM)

    def recurrence(self, q, k, v, gate_a, b, state, mask):
        """mlx-lm's gated_delta_update (beta = sigmoid(b), g = compute_g(A_log,
        a, dt_bias)) with the recurrence itself in the fused primitive."""
        from mlx_lm.models.gated_delta import compute_g

        a = self.inner
        return ops.gated_delta(q, k, v, compute_g(a.A_log, gate_a, a.dt_bias), mx.sigmoid(b), state, mask)

    def run(self, q, k, v, gate_a, b, state, mask):
        """The recurrence on this layer's path (fused primitive or mlx-lm's)."""
        from mlx_lm.models.gated_delta import gated_delta_update

        if self.fused:
            return self.recurrence(q, k, v, gate_a, b, state, mask)
        a = self.inner
        return gated_delta_update(q, k, v, gate_a, b, a.A_log, a.dt_bias, state, mask, use_kernel=not a.training)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per request: the convolution state, the recurrent state."""
        return ((self.conv_kernel - 1, self.conv_dim), (self.num_v_heads, self.head_v_dim, self.head_k_dim))

    def projections(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """[1, n, hidden] -> the convolution's input [1, n, conv_dim] (q | k |
        v), the output gate z [1, n, Hv, Dv], b and a [1, n, Hv]."""
        a, n = self.inner, x.shape[1]
        if not self.packed:  # qwen3_5: q | k | v already in the convolution's order
            z = a.in_proj_z(x).reshape(1, n, self.num_v_heads, self.head_v_dim)
            return a.in_proj_qkv(x), z, a.in_proj_b(x), a.in_proj_a(x)
        q, k, v, z, b, gate_a = a.fix_query_key_value_ordering(a.in_proj_qkvz(x), a.in_proj_ba(x))
        return mx.concatenate([t.reshape(1, n, -1) for t in (q, k, v)], axis=-1), z, b, gate_a

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        from mlx_lm.models.gated_delta import normalize_qk

        a = self.inner
        step = SlotStep(cache, keeps_drafts=True)
        mixed, z, b, gate_a = self.projections(x)
        conv_out = nn.silu(step.causal_conv(a.conv1d, step.pad(mixed)))
        num_seqs, width = conv_out.shape[:2]
        qc, kc, vc = mx.split(conv_out, [self.key_dim, 2 * self.key_dim], axis=-1)
        qc = qc.reshape(num_seqs, width, self.num_k_heads, self.head_k_dim)
        kc = kc.reshape(num_seqs, width, self.num_k_heads, self.head_k_dim)
        vc = vc.reshape(num_seqs, width, self.num_v_heads, self.head_v_dim)
        qc, kc = normalize_qk(qc, kc, inv_scale=self.head_k_dim ** -0.5, eps=1e-6)
        gate_a, b, state = step.pad(gate_a), step.pad(b), step.gather(1)
        drafts = step.rows.drafts
        if drafts is None:
            out, state = self.run(qc, kc, vc, gate_a, b, state, step.rows.mask)
        else:  # verify rows: their states after each position too, in the same call (draft_states.py)
            n, e = num_seqs, drafts.prefix_rows
            mask = step.rows.mask if step.rows.mask is not None else mx.ones((n, width), mx.bool_)
            out, states = self.run(*(mx.concatenate([t, t[e]]) for t in (qc, kc, vc, gate_a, b)),
                                   mx.concatenate([state, state[e]]), mx.concatenate([mask, drafts.prefix_mask]))
            out, state = out[:n], states[:n]
            prefixes = states[n:].reshape(len(drafts.rows), drafts.width - 1, *state.shape[1:])
            step.keep_candidates(mx.concatenate([prefixes, state[drafts.index][:, None]], axis=1))
        step.write(1, state)
        out = a.norm(step.unpad(out), z)
        return step.done(a.out_proj(out.reshape(1, x.shape[1], -1)))
