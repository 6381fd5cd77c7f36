"""Short gated convolutions of hybrid models on per-request state slots:
lfm2's and lfm2_moe's `conv` layers (mlx-lm's `ShortConv`), run by mlx-lm's own modules.

A layer projects each token to B, C and x, convolves B * x causally over
the last `L_cache` tokens (depthwise, kernel 3 in LFM2) and gates the result
with C. Its only state is the convolution's last `L_cache - 1` inputs,
[num_blocks, L_cache - 1, hidden] in the model dtype: one pool per layer
(`store.keys[layer]`; no recurrent state, `store.values[layer]` None),
gathered, run and written back as models/state_slots.py describes.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from vllm_metal.models.state_slots import SlotStep


class ShortConvLayer(nn.Module):
    """Wraps one mlx-lm short-convolution module (lfm2's `ShortConv`). Its
    weights stay where they are."""

    kind = "short conv"

    def __init__(self, inner: nn.Module):
        super().__init__()
        missing = [n for n in ("conv", "in_proj", "out_proj", "L_cache") if not hasattr(inner, n)]
        if missing:
            raise NotImplementedError(f"convolution module {type(inner).__module__}.{type(inner).__name__} lacks "
                                      f"{', '.join(missing)}: not the short gated convolution served here")
        self.inner = inner
        self.kernel = int(inner.L_cache)
        self.channels = int(inner.conv.weight.shape[0])

    @property
    def state_shapes(self) -> tuple[tuple[int, ...]]:
        """Per request: the convolution state only."""
        return ((self.kernel - 1, self.channels),)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        a = self.inner
        step = SlotStep(cache)
        b, c, h = mx.split(a.in_proj(x), 3, axis=-1)
        conv_out = step.causal_conv(a.conv, step.pad(b * h))
        return step.done(a.out_proj(c * step.unpad(conv_out)))
