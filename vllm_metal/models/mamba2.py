"""Mamba-2 mixers of hybrid models on per-request state slots:
granitemoehybrid's `mamba` layers, run by mlx-lm's own modules and its SSD
update (`mlx_lm.models.ssm.ssm_update`: its chunked scan over a padded batch
with a mask and per-row lengths; its Metal kernel for all-decode steps on
the GPU).

A mixer projects each token to a gate, the convolution's input (x | B | C)
and per-head time steps dt; a causal depthwise convolution (kernel 4) and
SiLU give x [Hs, Dh], B and C [G, N] (heads share B and C in G groups);
the selective scan keeps per head a [Dh, N] state; the output is
normalised, gated and projected back. Its states, as mlx-lm keeps them: the
convolution's last `kernel - 1` inputs [num_blocks, kernel - 1, conv_dim]
in the model dtype (`store.keys[layer]`) and the scan's state
[num_blocks, Hs, Dh, N] in float32 (`store.values[layer]`), gathered, run
and written back as models/state_slots.py describes.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from vllm_metal.models.state_slots import SlotStep


class Mamba2Layer(nn.Module):
    """Wraps one mlx-lm Mamba-2 mixer (granitemoehybrid's
    `GraniteMoeHybridMamba2Mixer`: in_proj packing [gate | x B C | dt],
    norm(y, gate)). Its weights stay where they are. (nemotron_h's mixer has
    the same layout; its decoder is what keeps it unserved: docs/models.md.)"""

    kind = "mamba2"

    def __init__(self, inner: nn.Module):
        super().__init__()
        needed = ("in_proj", "conv1d", "A_log", "D", "dt_bias", "norm", "out_proj", "num_heads", "head_dim",
                  "n_groups", "ssm_state_size", "conv_kernel_size", "intermediate_size", "conv_dim",
                  "time_step_limit")
        missing = [n for n in needed if not hasattr(inner, n)]
        if missing:
            raise NotImplementedError(f"mixer {type(inner).__module__}.{type(inner).__name__} lacks "
                                      f"{', '.join(missing)}: not the Mamba-2 layout served here")
        self.inner = inner
        self.heads, self.head_dim = int(inner.num_heads), int(inner.head_dim)
        self.groups, self.state_size = int(inner.n_groups), int(inner.ssm_state_size)
        self.kernel, self.conv_dim = int(inner.conv_kernel_size), int(inner.conv_dim)
        self.inner_dim = int(inner.intermediate_size)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per request: the convolution state, the scan's state."""
        return ((self.kernel - 1, self.conv_dim), (self.heads, self.head_dim, self.state_size))

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        from mlx_lm.models.ssm import ssm_update

        a = self.inner
        step = SlotStep(cache)
        inner, groups = self.inner_dim, self.groups * self.state_size
        gate, conv_input, dt = mx.split(a.in_proj(x), [inner, inner + self.conv_dim], axis=-1)
        conv_out = nn.silu(step.causal_conv(a.conv1d, step.pad(conv_input)))
        h, b, c = mx.split(conv_out, [inner, inner + groups], axis=-1)
        num_seqs, width = h.shape[:2]
        y, state = ssm_update(h.reshape(num_seqs, width, self.heads, self.head_dim), a.A_log,
                              b.reshape(num_seqs, width, self.groups, self.state_size),
                              c.reshape(num_seqs, width, self.groups, self.state_size),
                              a.D.astype(h.dtype), step.pad(dt), a.dt_bias, step.gather(1), a.time_step_limit,
                              mask=step.rows.mask, lengths=step.rows.lengths)
        step.write(1, state)
        y = step.unpad(y.reshape(num_seqs, width, inner))
        return step.done(a.out_proj(a.norm(y, gate)))
