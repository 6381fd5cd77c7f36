"""ministral3: llama-4 style attention temperature scaling.

mlx-lm's ministral3 multiplies the rotated queries by a per-position factor
1 + beta * log(1 + floor(position / original_max_position_embeddings)),
computed by the decoder from its one sequence's `cache.offset` and handed to
every layer. A packed step holds many sequences at different positions, so
this layer ignores that argument and computes the factor from each token's
own position (the same formula, float32, cast like mlx-lm's).
"""

from __future__ import annotations

import mlx.core as mx

from vllm_metal.models.attention_adapter import PagedAttentionLayer, StepAttentionInputs


class Attention(PagedAttentionLayer):
    def __init__(self, inner, sliding_window: int | None = None):
        super().__init__(inner, sliding_window)
        self.beta = float(inner.scaling_beta)
        self.original_max = int(inner.original_max_position_embeddings)

    def scale_queries(self, q: mx.array, step: StepAttentionInputs) -> mx.array:
        positions = step.positions.astype(mx.float32)
        factor = 1 + self.beta * mx.log(1 + mx.floor(positions / self.original_max))
        return q * factor.astype(q.dtype)[:, None, None]

    def __call__(self, x: mx.array, attn_scale=None, mask=None, cache=None) -> mx.array:
        # The decoder block calls self_attn(x, attn_scale, mask, cache).
        return super().__call__(x, mask, cache)
