"""A tiny Qwen3.5 (qwen3_5, or qwen3_5_moe) checkpoint with a
multi-token-prediction layer under `mtp.*`, and an independent reference
of that layer's drafts.

The checkpoint: tests/families.py's tiny qwen3_5 (layers L L F: Gated
DeltaNet, Gated DeltaNet, gated full attention; qwen3_5_moe: L F L with MoE
blocks) built with as many layers more; the last full-attention one of them
becomes `mtp.layers.0`, with Qwen's own tensors beside it (mtp.fc,
mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.norm), and the text
config says the family's layer count and mtp_num_hidden_layers 1 (mlx-lm
drops `mtp.*` at load). The blocks' output projections are damped (`damp`)
and fc is close to [I | mix * R], so the layer's draft is close to the
target's own next choice: drafts are kept often, not always.
`to_hugging_face_layout` stores the same weights as Hugging Face does.

The reference (`Reference.drafts`): mlx-lm's target forward over the whole
sequence for the final (normed) hidden states (dense attention, no paging,
its own recurrent states), then the MTP layer built from mlx-lm's own
qwen3_5 DecoderLayer with mlx-lm's KVCache, run over every pair as vLLM's
Qwen3_5MultiTokenPredictor does (no embedding zeroed at position 0), the
draft the argmax of the target's head on norm(m), chained for k drafts with
norm(m) fed back.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from families import TOKENIZER_FILES, config_of

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import synthetic_heads  # noqa: E402



def build_qwen_mtp(out: Path, tokenizer_dir: str, seed: int = 3, damp: float = 0.1, noise: float = 0.003,
                   mix: float = 0.05, spread: float = 0.05, tied: bool = True, family: str = "qwen3_5",
                   experts_one_by_one: bool = False) -> str:
    """tied: the family's tied head, else an LM head of its own (a damped
    model with a tied head would repeat its token: its hidden state is
    nearly the token's embedding, whose own row scores highest). family:
    qwen3_5 or qwen3_5_moe (its MTP layer a MoE block; experts_one_by_one:
    stored per expert, mlp.experts.{e}.*, as some checkpoints do)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    config = config_of(family)
    text = config.get("text_config", config)
    layers = text["num_hidden_layers"]
    text["num_hidden_layers"] = 2 * layers
    index = max(i for i in range(layers, 2 * layers) if (i + 1) % text["full_attention_interval"] == 0)
    root = "language_model.model.layers." if text is not config else "model.layers."
    # layer `index`, a full-attention layer past the target's, becomes the MTP layer
    if "mlp_only_layers" in text:  # qwen3_next: the MTP layer (layer 0 of its own) dense, as the family's layer 0
        text["mlp_only_layers"] = [*text["mlp_only_layers"], index]
    config["tie_word_embeddings"] = text["tie_word_embeddings"] = tied
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(json.loads(json.dumps(config))))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, value in tree_flatten(model.parameters()):  # as families.build initialises
        if value.ndim >= 2:
            w = rng.standard_normal(value.shape) / np.sqrt(value.shape[-1])
            if "embed_tokens" in name or "lm_head" in name:
                w *= 4.0  # peaked logits
            elif name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
                w *= damp  # every block's output (attention, MLP, Gated DeltaNet) damped
            weights[name] = mx.array(w.astype(np.float32))
        else:
            weights[name] = value + mx.array(0.05 * rng.standard_normal(value.shape).astype(np.float32))
    out_weights = synthetic_heads.qwen_mtp_layout(weights, root, layers, index, text["hidden_size"], rng, spread,
                                                  mix, noise)
    if experts_one_by_one:
        for key in [k for k in out_weights if k.startswith("mtp.") and ".switch_mlp." in k]:
            stack = out_weights.pop(key)
            for e in range(stack.shape[0]):
                out_weights[key.replace(".switch_mlp.", f".experts.{e}.")] = stack[e]
    text.update(num_hidden_layers=layers, **{"num_nextn_predict_layers" if family == "qwen3_next"
                                              else "mtp_num_hidden_layers": 1})
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), out_weights)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_dir) / name, out / name)
    return str(out)


class Reference:
    """mlx-lm's target and the MTP layer on mlx-lm's own modules."""

    def __init__(self, model_dir: str, mtp_dir: str | None = None):
        """mtp_dir: where the MTP layer's tensors are read in mlx-lm's layout
        (model_dir's when None; mlx-lm loads a qwen3_next target beside them
        only from Hugging Face's layout)."""
        from mlx_lm.models import qwen3_5, qwen3_next
        from mlx_lm.utils import load_model

        self.target, config = load_model(Path(model_dir))
        self.target.set_dtype(mx.float32)
        text = config.get("text_config", config)
        one = {**text, "num_hidden_layers": 1, "full_attention_interval": 1}
        if config["model_type"] == "qwen3_next":
            self.block = qwen3_next.Qwen3NextDecoderLayer(qwen3_next.ModelArgs.from_dict(one), 0)
            self.owner = self.target
        else:
            self.block = qwen3_5.DecoderLayer(qwen3_5.TextModelArgs.from_dict(one), 0)
            self.owner = self.target.language_model
        assert not self.block.is_linear
        w = mx.load(str(Path(mtp_dir or model_dir) / "model.safetensors"))
        self.block.load_weights([(k[len("mtp.layers.0."):], v) for k, v in w.items() if k.startswith("mtp.layers.0.")])
        self.eps = text["rms_norm_eps"]
        self.w = {n: w[f"mtp.{n}.weight"] for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm", "fc")}

    def norm(self, name, x):
        return mx.fast.rms_norm(x, self.w[name], self.eps)

    def drafts(self, tokens: list[int], k: int, rows: list | None = None) -> list[int]:
        """The MTP layer's k greedy drafts after `tokens` (the newest last), as
        vLLM runs it; rows: gets the first pass's output rows (normed, every pair)."""
        from mlx_lm.models.base import create_attention_mask
        from mlx_lm.models.cache import KVCache

        inner = self.owner.model
        h = inner(mx.array(tokens)[None])[0]  # the target's final (normed) hidden states
        embed = inner.embed_tokens
        cache = KVCache()

        def layer(next_ids, prev_hidden):
            e = embed(mx.array(next_ids))
            x = mx.concatenate([self.norm("pre_fc_norm_embedding", e), self.norm("pre_fc_norm_hidden", prev_hidden)],
                               axis=-1) @ self.w["fc"].T
            x = x[None]
            return self.norm("norm", self.block(x, create_attention_mask(x, cache), cache)[0])

        head = self.owner.lm_head if "lm_head" in self.owner else embed.as_linear
        n = len(tokens)
        m = layer(tokens[1:], h[:n - 1])  # pairs (t_{i+1}, h_i), i < n - 1
        if rows is not None:
            rows.append(m)
        m = m[-1:]
        out = []
        for j in range(k):
            out.append(int(mx.argmax(head(m)[-1]).item()))  # the target's head
            if j + 1 < k:
                m = layer([out[-1]], m)
        return out


def to_hugging_face_layout(src: str, out: Path) -> str:
    """The checkpoint `src` as Hugging Face stores Qwen3.5 (what mlx-lm's
    sanitize undoes): convolution weights [C, 1, K], RMSNorm weights w for
    x * (1 + w) -- the target's, and the MTP layer's (vLLM's GemmaRMSNorm)."""
    shifted = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight",
               ".k_norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
               "mtp.norm.weight")
    w = mx.load(str(Path(src) / "model.safetensors"))
    w = {k: v.moveaxis(1, 2) if "conv1d.weight" in k else v - 1.0 if k.endswith(shifted) and v.ndim == 1 else v
         for k, v in w.items()}
    if json.loads((Path(src) / "config.json").read_text())["model_type"] == "qwen3_next":
        for key in [k for k in w if ".switch_mlp." in k]:  # its experts one by one
            stack = w.pop(key)
            for e in range(stack.shape[0]):
                w[key.replace(".switch_mlp.", f".experts.{e}.")] = stack[e]
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), w)
    for f in Path(src).iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    return str(out)


def build_draft(target: str, out: Path, tokenizer_dir: str, damp: float = 0.01) -> str:
    """A plain one-layer qwen3 of the target's vocabulary with the target's
    embedding, final norm and LM head, its block damped: a draft model whose guess is
    close to the damped target's (which mostly follows its current token)."""
    from families import build

    build("qwen3", out, tokenizer_dir, overrides={"num_hidden_layers": 1})
    t = mx.load(str(Path(target) / "model.safetensors"))
    w = mx.load(str(out / "model.safetensors"))
    w = {k: v * damp if k.endswith(("o_proj.weight", "down_proj.weight")) else v for k, v in w.items()}
    w["model.embed_tokens.weight"] = t["language_model.model.embed_tokens.weight"]
    w["lm_head.weight"] = t["language_model.lm_head.weight"]
    w["model.norm.weight"] = t["language_model.model.norm.weight"]
    mx.save_safetensors(str(out / "model.safetensors"), w)
    return str(out)
