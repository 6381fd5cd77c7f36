"""Gated DeltaNet (linear attention) layers of hybrid models on per-request
state slots: qwen3_next's `linear_attn`, run by mlx-lm's own convolution
and gated-delta recurrence (`gated_delta_update`: its Metal kernel on the
GPU, its ops path on the CPU). qwen3_5's layer differs only in its input
projections (`projections`); it is not served yet (docs/models.md).

Each such layer keeps two state pools indexed by vLLM's Mamba-group block id
(one slot per request, mamba_cache_mode "none"): the causal convolution's
last `conv_kernel - 1` inputs [num_blocks, kernel - 1, conv_dim] in the
model dtype, and the recurrent matrix state [num_blocks, Hv, Dv, Dk] in
float32 (mlx-lm's shapes). A step gathers its rows' states by slot (one
gather per pool), runs every row's scheduled tokens -- decode, prefill and
chunked prefill alike -- as one right-padded batch with a mask, and scatters
the new states back functionally (`pool[slots] = new`), all inside the
step's one lazy graph. A row starting at position 0 (new or preempted and
recomputed) starts from zeros whatever its slot held before.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass
class LinearStepInputs:
    """The step's rows as a right-padded batch [num_seqs, max_scheduled]
    (built once per step from the packed layout)."""

    pad_index: mx.array  # int32 [num_seqs, T]: packed token of each padded position (pads repeat a row's first)
    mask: mx.array  # bool [num_seqs, T]: real tokens
    lengths: mx.array  # int32 [num_seqs]: tokens scheduled per row
    carried: mx.array  # bool [num_seqs]: the row continues a state (num_computed > 0)
    unpad_index: mx.array  # int32 [num_tokens]: each packed token's place in the flattened padded batch


def build_linear_inputs(cu_seqlens_q: np.ndarray, positions: np.ndarray) -> LinearStepInputs:
    cu = np.asarray(cu_seqlens_q, np.int64)
    counts = np.diff(cu)
    width = int(counts.max())
    offsets = np.arange(width)[None, :]
    mask = offsets < counts[:, None]
    pad_index = np.where(mask, cu[:-1, None] + offsets, cu[:-1, None])
    row_of_token = np.repeat(np.arange(len(counts)), counts)
    unpad = row_of_token * width + np.arange(cu[-1]) - cu[row_of_token]
    return LinearStepInputs(pad_index=mx.array(pad_index.astype(np.int32)), mask=mx.array(mask),
                            lengths=mx.array(counts.astype(np.int32)),
                            carried=mx.array(np.asarray(positions)[cu[:-1]] > 0),
                            unpad_index=mx.array(unpad.astype(np.int32)))


class GatedDeltaLayer(nn.Module):
    """Wraps one mlx-lm Gated DeltaNet module (qwen3_next's
    `Qwen3NextGatedDeltaNet`: q, k, v, z and b, a interleaved per key head in
    two projections). Its weights stay where they are."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        needed = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "in_proj_qkvz", "in_proj_ba",
                  "fix_query_key_value_ordering")
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

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per request: the convolution state, the recurrent state."""
        return ((self.conv_kernel - 1, self.conv_dim), (self.num_v_heads, self.head_v_dim, self.head_k_dim))

    def projections(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """[1, n, hidden] -> the convolution's input [1, n, conv_dim] (q | k |
        v), the output gate z [1, n, Hv, Dv], b and a [1, n, Hv]."""
        a, n = self.inner, x.shape[1]
        q, k, v, z, b, gate_a = a.fix_query_key_value_ordering(a.in_proj_qkvz(x), a.in_proj_ba(x))
        return mx.concatenate([t.reshape(1, n, -1) for t in (q, k, v)], axis=-1), z, b, gate_a

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

        a = self.inner
        store, step = cache.store, cache.store.step
        rows = step.linear
        layer = cache.layer
        slots = step.block_tables[store.layer_group[layer]][:, 0]
        mixed, z, b, gate_a = self.projections(x)
        num_seqs, width = rows.pad_index.shape

        def padded(t):  # [1, num_tokens, ...] -> [num_seqs, T, ...]
            return t[0][rows.pad_index]

        mixed = padded(mixed)
        mixed = mx.where(rows.mask[..., None], mixed, 0)
        conv_pool, state_pool = store.keys[layer], store.values[layer]
        carried = rows.carried[:, None, None]
        conv_state = mx.where(carried, conv_pool[slots], 0).astype(mixed.dtype)
        state = mx.where(carried[..., None], state_pool[slots], 0)
        conv_input = mx.concatenate([conv_state, mixed], axis=1)
        # The last kernel-1 inputs of each row (its real tokens end at length - 1).
        keep = (rows.lengths[:, None] + mx.arange(self.conv_kernel - 1))[..., None]
        new_conv = mx.take_along_axis(conv_input, keep, axis=1)
        conv_out = nn.silu(a.conv1d(conv_input))
        qc, kc, vc = mx.split(conv_out, [self.key_dim, 2 * self.key_dim], axis=-1)
        qc = qc.reshape(num_seqs, width, self.num_k_heads, self.head_k_dim)
        kc = kc.reshape(num_seqs, width, self.num_k_heads, self.head_k_dim)
        vc = vc.reshape(num_seqs, width, self.num_v_heads, self.head_v_dim)
        qc, kc = normalize_qk(qc, kc, inv_scale=self.head_k_dim ** -0.5, eps=1e-6)
        out, new_state = gated_delta_update(qc, kc, vc, padded(gate_a), padded(b), a.A_log, a.dt_bias, state,
                                            rows.mask, use_kernel=not a.training)
        conv_pool[slots] = new_conv.astype(conv_pool.dtype)
        state_pool[slots] = new_state.astype(state_pool.dtype)
        store.keys[layer], store.values[layer] = conv_pool, state_pool
        out = out.reshape(num_seqs * width, self.num_v_heads, self.head_v_dim)[rows.unpad_index]
        out = a.norm(out[None], z)
        out = a.out_proj(out.reshape(1, x.shape[1], -1))
        if store.after_layer is not None:
            store.after_layer(out, conv_pool, state_pool)
        return out
