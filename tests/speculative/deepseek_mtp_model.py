"""A tiny DeepSeek-V3 checkpoint with its multi-token-prediction layer, and
an independent reference of that layer's drafts (GLM-4.7-Flash's,
glm4_moe_lite, alike: its MTP layer is its own MLA block, chained GLM's way).

The checkpoint: tests/families.py's tiny deepseek_v3 (latent attention,
q LoRA, yarn RoPE, sigmoid group routing with a correction bias, a dense
first layer then MoE) built with one layer more; that last layer (a MoE
block at index 2, as DeepSeek-V3's layer 61 is) becomes the MTP layer
`model.layers.2` with DeepSeek's own tensors beside it, copies of the
embedding and head included (benchmarks/synthetic_mtp.add_mtp_layer), and
the config says num_hidden_layers 2, num_nextn_predict_layers 1.

The reference (`Reference.drafts`): mlx-lm's deepseek_v3 target built by
mlx-lm's classes from the checkpoint minus that layer (dense attention, no
paging), for the final hidden states; then the MTP layer on mlx-lm's own
DeepseekV3DecoderLayer (index 2: its MoE) with mlx-lm's KVCache, run over
every pair as vLLM's DeepSeekMultiTokenPredictorLayer does (embedding zeroed
at position 0, enorm / hnorm, eh_proj, the block, shared_head.norm, the
target's head) and chained for k drafts as vLLM's proposer chains
DeepSeekMTPModel: each pass after the first reads the pass before's
*normed* output (`feeds_normed`; False: GLM's way, m itself).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from families import build

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from synthetic_mtp import add_mtp_layer  # noqa: E402

LAYERS = 2
EXTRAS = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")


# model_type -> mlx-lm's module, its decoder layer and MoE classes, and vLLM's chaining (feeds the normed rows)
FAMILIES = {"deepseek_v3": ("deepseek_v3", "DeepseekV3DecoderLayer", "DeepseekV3MoE", True),
            "kimi_k2": ("deepseek_v3", "DeepseekV3DecoderLayer", "DeepseekV3MoE", True),
            "glm4_moe_lite": ("glm4_moe_lite", "Glm4MoeLiteDecoderLayer", "Glm4MoeLiteMoE", False)}


def build_deepseek_mtp(out: Path, tokenizer_dir: str, seed: int = 3, damp: float = 0.1, noise: float = 0.003,
                       mix: float = 0.05, spread: float = 0.5, bits: int | None = None,
                       model_type: str = "deepseek_v3") -> str:
    """The tiny `model_type` (FAMILIES) of tests/families.py with one layer more, made its MTP layer
    (add_mtp_layer: damp, noise, mix, spread; bits: the whole checkpoint MLX-quantized)."""
    build(model_type, out, tokenizer_dir, seed=seed, bits=bits, overrides={"num_hidden_layers": LAYERS + 1})
    return add_mtp_layer(out, seed=seed, damp=damp, noise=noise, mix=mix, copies=True, spread=spread)


class Reference:
    """mlx-lm's target and the MTP layer on mlx-lm's own modules."""

    def __init__(self, model_dir: str, feeds_normed: bool | None = None):
        """feeds_normed: the chaining (None: vLLM's for the family, FAMILIES)."""
        import importlib

        config = json.loads((Path(model_dir) / "config.json").read_text())
        name, layer_class, moe_class, normed = FAMILIES[config["model_type"]]
        family = importlib.import_module(f"mlx_lm.models.{name}")
        w = mx.load(str(Path(model_dir) / "model.safetensors"))
        p = f"model.layers.{LAYERS}."
        self.target = family.Model(family.ModelArgs.from_dict(config))
        self.target.load_weights([(k, v) for k, v in w.items() if not k.startswith(p)])  # strict
        args = family.ModelArgs.from_dict({**config, "num_hidden_layers": LAYERS + 1})
        self.block = getattr(family, layer_class)(args, LAYERS)
        self.block.load_weights([(k[len(p):], v) for k, v in w.items()
                                 if k.startswith(p) and not k[len(p):].startswith(EXTRAS)])
        assert isinstance(self.block.mlp, getattr(family, moe_class))
        eps = config["rms_norm_eps"]
        self.norms = {n: (w[p + n + ".weight"], eps) for n in ("enorm", "hnorm", "shared_head.norm")}
        self.eh = w[p + "eh_proj.weight"]
        self.feeds_normed = normed if feeds_normed is None else feeds_normed

    def norm(self, name, x):
        weight, eps = self.norms[name]
        return mx.fast.rms_norm(x, weight, eps)

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The MTP layer's k greedy drafts after `tokens` (the newest last), as vLLM runs it."""
        from mlx_lm.models.base import create_attention_mask
        from mlx_lm.models.cache import KVCache

        inner = self.target.model
        h = inner(mx.array(tokens)[None])[0]  # the target's final (normed) hidden states
        cache = KVCache()

        def layer(next_ids, prev_hidden, positions):
            e = inner.embed_tokens(mx.array(next_ids))
            e = mx.where(mx.array(np.asarray(positions) == 0)[:, None], 0, e)
            x = (mx.concatenate([self.norm("enorm", e), self.norm("hnorm", prev_hidden)], axis=-1) @ self.eh.T)[None]
            return self.block(x, create_attention_mask(x, cache, return_array=True), cache)[0]

        n = len(tokens)
        m = layer(tokens[1:], h[:n - 1], list(range(n - 1)))[-1:]  # pairs (t_{i+1}, h_i), i < n - 1
        out = []
        for j in range(k):
            normed = self.norm("shared_head.norm", m)
            out.append(int(mx.argmax(self.target.lm_head(normed)[-1]).item()))
            if j + 1 < k:
                m = layer([out[-1]], normed if self.feeds_normed else m, [n - 1 + j])
        return out

    def target_greedy(self, tokens: list[int], n: int) -> list[int]:
        """mlx-lm's own greedy continuation of the target (the plain tokens)."""
        tokens = list(tokens)
        for _ in range(n):
            tokens.append(int(mx.argmax(self.target(mx.array(tokens)[None])[0, -1]).item()))
        return tokens[-n:]
