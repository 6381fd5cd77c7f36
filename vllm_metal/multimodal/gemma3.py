"""Gemma 3's vision tower in MLX: SigLIP (a linear patch embedding with
learned positions, pre-norm LayerNorm blocks with full bidirectional
attention and a tanh-GELU MLP, a final LayerNorm) and Gemma 3's projector
(average pooling of the patch grid to `mm_tokens_per_image` tokens, Gemma's
RMSNorm (1 + w), a projection into the text model's hidden size).

Every image (and every pan-and-scan crop) is the same size, so a step's
images are one batch. The text model attends to an image's tokens both ways
(vLLM's prefix-LM images; models/attention_adapter.attend_image_spans).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from vllm_metal.multimodal import vit


class Gemma3VisionTower:
    """SigLIP + projector of a Gemma 3 checkpoint (`vision_tower.`, `multi_modal_projector.`)."""

    def __init__(self, config: dict, weights: dict[str, mx.array], dtype: mx.Dtype):
        v = config["vision_config"]
        self.dtype = dtype
        self.hidden = int(v.get("hidden_size", 1152))
        self.heads = int(v.get("num_attention_heads", 16))
        self.head_dim = self.hidden // self.heads
        self.layers = int(v.get("num_hidden_layers", 27))
        self.image_size = int(v.get("image_size", 896))
        self.patch = int(v.get("patch_size", 14))
        self.eps = float(v.get("layer_norm_eps", 1e-6))
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu", "gelu_new"):
            raise NotImplementedError(f"Gemma 3 vision tower: hidden_act {act!r} is not served")
        self.approximate = act != "gelu"
        self.side = self.image_size // self.patch
        self.mm_tokens = int(config.get("mm_tokens_per_image", 256))
        per_side = math.isqrt(self.mm_tokens)
        if per_side * per_side != self.mm_tokens or self.side % per_side:
            raise ValueError(f"Gemma 3: mm_tokens_per_image {self.mm_tokens} does not pool a {self.side}x{self.side} "
                             "patch grid evenly")
        self.pool = self.side // per_side
        self.w = weights
        vit.take(weights, "vision_tower.embeddings.patch_embedding.weight",
                 (self.hidden, 3, self.patch, self.patch))
        vit.take(weights, "vision_tower.embeddings.position_embedding.weight",
                 (self.side * self.side, self.hidden))
        for i in range(self.layers):
            vit.take(weights, f"vision_tower.encoder.layers.{i}.self_attn.q_proj.weight",
                     (self.hidden, self.hidden))
        text_hidden = int(config["text_config"]["hidden_size"])
        vit.take(weights, "multi_modal_projector.mm_input_projection_weight", (self.hidden, text_hidden))

    def tokens(self, crops: int) -> int:
        return crops * self.mm_tokens

    def __call__(self, pixel_values: np.ndarray) -> mx.array:
        """[images, 3, S, S] -> [images, mm_tokens_per_image, text hidden] (lazy)."""
        b, c, hgt, wid = pixel_values.shape
        if (c, hgt, wid) != (3, self.image_size, self.image_size):
            raise ValueError(f"Gemma 3 images must be 3x{self.image_size}x{self.image_size} after processing, "
                             f"got {c}x{hgt}x{wid}")
        w, p, s = self.w, "vision_tower.", self.side
        # [b, 3, S, S] -> [b, patches, 3 * P * P] in the convolution's (channel, row, column) order
        x = pixel_values.reshape(b, 3, s, self.patch, s, self.patch).transpose(0, 2, 4, 1, 3, 5)
        x = mx.array(np.ascontiguousarray(x).reshape(b * s * s, -1)).astype(self.dtype)
        x = vit.linear(x, w[p + "embeddings.patch_embedding.weight"].reshape(self.hidden, -1),
                       w[p + "embeddings.patch_embedding.bias"])
        x = (x.reshape(b, s * s, self.hidden) + w[p + "embeddings.position_embedding.weight"]).reshape(-1, self.hidden)
        cu = vit.segments(np.arange(b + 1) * s * s)
        for i in range(self.layers):
            q = f"{p}encoder.layers.{i}."
            h = vit.layer_norm(x, w[q + "layer_norm1.weight"], w[q + "layer_norm1.bias"], self.eps)
            x = x + self._attention(h, q + "self_attn.", cu)
            h = vit.layer_norm(x, w[q + "layer_norm2.weight"], w[q + "layer_norm2.bias"], self.eps)
            h = vit.gelu(vit.linear(h, w[q + "mlp.fc1.weight"], w[q + "mlp.fc1.bias"]), self.approximate)
            x = x + vit.linear(h, w[q + "mlp.fc2.weight"], w[q + "mlp.fc2.bias"])
        x = vit.layer_norm(x, w[p + "post_layernorm.weight"], w[p + "post_layernorm.bias"], self.eps)
        # average pooling over pool x pool patches of the grid
        k, t = self.pool, s // self.pool
        x = x.reshape(b, t, k, t, k, self.hidden).astype(mx.float32).mean(axis=(2, 4)).reshape(b, t * t, self.hidden)
        x = vit.rms_norm(x, w["multi_modal_projector.mm_soft_emb_norm.weight"], self.eps, offset=1.0)
        return (x @ w["multi_modal_projector.mm_input_projection_weight"].astype(mx.float32)).astype(self.dtype)

    def _attention(self, x: mx.array, p: str, cu: vit.EncoderBatch) -> mx.array:
        w, n = self.w, x.shape[0]
        q, k, v = (vit.linear(x, w[p + f"{name}.weight"], w[p + f"{name}.bias"]).reshape(n, self.heads, self.head_dim)
                   for name in ("q_proj", "k_proj", "v_proj"))
        out = vit.segment_attention(q, k, v, cu, self.head_dim ** -0.5)
        return vit.linear(out.reshape(n, self.hidden), w[p + "out_proj.weight"], w[p + "out_proj.bias"])
