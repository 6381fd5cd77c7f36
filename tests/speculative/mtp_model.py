"""A tiny GLM-4.5-style (glm4_moe) checkpoint with a multi-token-prediction
layer, and an independent reference of that layer's drafts.

The checkpoint: tests/families.py's tiny glm4_moe built with one layer more;
that last layer (a MoE block, as GLM's is) becomes the MTP layer `model.layers.2`
with GLM's own tensors beside it (benchmarks/synthetic_mtp.add_mtp_layer), and
the config says num_hidden_layers 2, num_nextn_predict_layers 1 (mlx-lm drops
the layer at load). With the default weights about half of the first drafts
are taken; with damp 1 (undamped blocks) the drafts depend on all of the
layer's arithmetic, attention over its cache included (the reference check).

The reference (`mtp_drafts`): mlx-lm's target forward over the whole
sequence for the hidden states (dense attention, no paging), then the MTP
layer built from mlx-lm's own DecoderLayer with mlx-lm's KVCache, run over
every pair as vLLM's Glm4MoeMultiTokenPredictorLayer does, and chained for k drafts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from families import build

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from synthetic_mtp import add_mtp_layer  # noqa: E402

LAYERS = 2


def build_glm_mtp(out: Path, tokenizer_dir: str, seed: int = 3, damp: float = 0.1, noise: float = 0.003,
                  mix: float = 0.05) -> str:
    """The tiny glm4_moe of tests/families.py with one layer more, made its MTP layer by
    benchmarks/synthetic_mtp.add_mtp_layer (damp, noise, mix: its docstring)."""
    build("glm4_moe", out, tokenizer_dir, seed=seed, overrides={"num_hidden_layers": LAYERS + 1})
    return add_mtp_layer(out, seed=seed, damp=damp, noise=noise, mix=mix)


class Reference:
    """mlx-lm's target and the MTP layer on mlx-lm's own modules."""

    def __init__(self, model_dir: str):
        from mlx_lm.models import glm4_moe
        from mlx_lm.utils import load_model

        self.target, config = load_model(Path(model_dir))
        self.target.set_dtype(mx.float32)
        args = glm4_moe.ModelArgs.from_dict({**config, "num_hidden_layers": LAYERS + 1})
        self.block = glm4_moe.DecoderLayer(args, LAYERS)
        w = mx.load(str(Path(model_dir) / "model.safetensors"))
        p = f"model.layers.{LAYERS}."
        self.block.load_weights([(k[len(p):], v) for k, v in w.items() if k.startswith(p) and
                                 not k[len(p):].startswith(("enorm", "hnorm", "eh_proj", "shared_head"))])
        eps = config["rms_norm_eps"]
        self.norms = {n: (w[p + n + ".weight"], eps) for n in ("enorm", "hnorm", "shared_head.norm")}
        self.eh = w[p + "eh_proj.weight"]

    def norm(self, name, x):
        weight, eps = self.norms[name]
        return mx.fast.rms_norm(x, weight, eps)

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The MTP layer's k greedy drafts after `tokens` (the newest last), as vLLM runs it."""
        from mlx_lm.models.base import create_attention_mask
        from mlx_lm.models.cache import KVCache

        inner = self.target.model
        h = inner(mx.array(tokens)[None])[0]  # the target's final (normed) hidden states
        embed = inner.embed_tokens
        cache = KVCache()

        def layer(next_ids, prev_hidden, positions):
            e = embed(mx.array(next_ids))
            e = mx.where(mx.array(np.asarray(positions) == 0)[:, None], 0, e)
            x = mx.concatenate([self.norm("enorm", e), self.norm("hnorm", prev_hidden)], axis=-1) @ self.eh.T
            x = x[None]
            return self.block(x, create_attention_mask(x, cache), cache)[0]

        n = len(tokens)
        m = layer(tokens[1:], h[:n - 1], list(range(n - 1)))[-1:]  # pairs (t_{i+1}, h_i), i < n - 1
        out = []
        for j in range(k):
            logits = self.target.lm_head(self.norm("shared_head.norm", m))
            out.append(int(mx.argmax(logits[-1]).item()))
            if j + 1 < k:
                m = layer([out[-1]], m, [n - 1 + j])
        return out
