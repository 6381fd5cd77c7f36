"""A tiny Gemma 4 target with a tiny `gemma4_assistant` checkpoint (vLLM's
Gemma 4 MTP drafter), and an independent reference of the assistant's drafts.

The target: tests/families.py's tiny gemma4_text (layers S F S F, the last
two reading layers 0 and 1's caches, keys as values, per-layer inputs, MoE)
with an untied head, its blocks damped (their post-norms scaled by `damp`:
Gemma's sandwich norms set each block's output size) and its token
embeddings in its first RANK coordinates, so that its next token follows
mostly from the last one (a bigram an assistant can copy).

The assistant: built with transformers' own Gemma4AssistantConfig /
Gemma4AssistantForCausalLM and written by its save_pretrained, the layout
vLLM's Gemma4MTP loader reads (model.layers.* with queries only,
model.norm, pre_projection, post_projection, the head tied to
model.embed_tokens, masked_embedding.* with use_ordered_embeddings). Its
weights copy the target's bigram: the embedding half of pre_projection
keeps the first `hidden` coordinates, the other half is mix x random, its
final norm and head are the target's (seen through those coordinates), its
blocks' post-norms are scaled by `damp`; with masking, clusters that tend to
hold the head's best tokens (benchmarks/synthetic_heads.ordered_clusters). So its drafts are the
target's tokens often, not always; with damp 0.5 (the tests' "raw"
assistant) its blocks, attention over the target's cache included, move
its drafts (a wrong window, position or context changes them).

The reference (`Reference.drafts`): mlx-lm's own gemma4_text forward over
the sequence before the newest token, its KVCache holding the K/V of every
layer with a cache (dense, no paging), then the assistant in plain mlx ops
as vLLM's Gemma4MTP / Gemma4Proposer run it: the query at the last target
position P - 1 (every pass: `constant_draft_positions`), attending the K/V
of the target's last layer of its own kind with a cache (sliding layers
within their window), fed [embed(token) * sqrt(backbone), hidden]: the
newest token and the target's final hidden state at P - 1, then each draft
and the assistant's post_projection output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from families import build

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import synthetic_heads  # noqa: E402

BACKBONE = 64  # tests/families.py's hidden size
RANK = 48  # the target's token embeddings use its first RANK coordinates


def build_target(out: Path, tokenizer_dir: str, damp: float = 0.3, seed: int = 0) -> str:
    """The tiny gemma4_text of tests/families.py, untied head, blocks damped, its token
    embeddings in the first RANK coordinates (an assistant of that width can copy them whole)."""
    build("gemma4_text", out, tokenizer_dir, seed=seed, overrides={"tie_word_embeddings": False})
    w = mx.load(str(out / "model.safetensors"))
    post = ("post_attention_layernorm", "post_feedforward_layernorm", "post_per_layer_input_norm")
    w = {k: v * damp if any(p in k for p in post) else v for k, v in w.items()}
    embed = np.array(w["model.embed_tokens.weight"])
    embed[:, RANK:] = 0
    w["model.embed_tokens.weight"] = mx.array(embed)
    mx.save_safetensors(str(out / "model.safetensors"), w)
    return str(out)


def build_assistant(out: Path, target_dir: str, hidden: int = BACKBONE, damp: float = 0.1, mix: float = 0.05,
                    masked: tuple[int, int] | None = None, seed: int = 1, text: dict | None = None,
                    top: dict | None = None) -> str:
    """A gemma4_assistant checkpoint for the target at `target_dir` (module
    docstring); masked: (num_centroids, centroid_intermediate_top_k) turns
    on use_ordered_embeddings. text / top: config fields over the defaults
    (the text config's, the assistant config's)."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    tw = mx.load(str(Path(target_dir) / "model.safetensors"))
    return synthetic_heads.build_assistant(out, target, tw, damp, mix, masked, seed, hidden, text=text, top=top)


def rope(x: mx.array, position: int, params: dict) -> mx.array:
    """x [heads, dim] rotated at `position` (neox pairs (i, i + dim / 2)): rope_type "default", or
    "proportional" (the first partial_rotary_factor of the frequencies, the rest unrotated)."""
    dim = x.shape[-1]
    half = dim // 2
    rotated = int(dim * params.get("partial_rotary_factor", 1.0)) // 2 if params["rope_type"] == "proportional" \
        else half
    inv = np.zeros(half)
    inv[:rotated] = params["rope_theta"] ** (-np.arange(0, 2 * rotated, 2) / dim) / params.get("factor", 1.0)
    angle = mx.array((position * inv).astype(np.float32))
    cos, sin = mx.cos(angle), mx.sin(angle)
    a, b = x[:, :half], x[:, half:]
    return mx.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def rms(x: mx.array, w: mx.array | None, eps: float) -> mx.array:
    y = x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def gelu_tanh(x: mx.array) -> mx.array:
    return 0.5 * x * (1 + mx.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


class Reference:
    """mlx-lm's gemma4_text target (its KVCache) and the assistant in plain mlx ops."""

    def __init__(self, target_dir: str, assistant_dir: str):
        from mlx_lm.utils import load_model

        self.target, self.tconfig = load_model(Path(target_dir))
        self.target.set_dtype(mx.float32)
        full = json.loads((Path(assistant_dir) / "config.json").read_text())
        self.top, self.config = full, full["text_config"]
        self.w = {k: v.astype(mx.float32) if v.dtype != mx.int64 else v
                  for k, v in mx.load(str(Path(assistant_dir) / "model.safetensors")).items()}
        types = self.tconfig["layer_types"]
        owners = types[:len(types) - self.tconfig["num_kv_shared_layers"]]
        # Each assistant layer reads the target's last layer of its kind that has a cache.
        self.source = [max(i for i, t in enumerate(owners) if t == kind) for kind in self.config["layer_types"]]
        self.n_owners = len(owners)

    def target_states(self, tokens: list[int]):
        """mlx-lm's forward over `tokens`: final (normed) hidden states [n, hidden], and the
        K/V [kv_heads, n, dim] of every layer with a cache (its KVCache)."""
        from mlx_lm.models.cache import KVCache

        caches = [KVCache() for _ in range(self.n_owners)]
        h = self.target.model(mx.array(tokens)[None], cache=caches)[0]
        return h, [(c.keys[0, :, :c.offset], c.values[0, :, :c.offset]) for c in caches]

    def layer(self, i: int, x: mx.array, position: int, kv) -> mx.array:
        w, c, eps = self.w, self.config, self.config["rms_norm_eps"]
        p = f"model.layers.{i}."
        kind = c["layer_types"][i]
        keys, values = kv[self.source[i]]
        heads = c["num_attention_heads"]
        dim = w[p + "self_attn.q_norm.weight"].shape[0]
        h = rms(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(heads, dim)
        q = rope(rms(q, w[p + "self_attn.q_norm.weight"], eps), position, c["rope_parameters"][kind])
        n = keys.shape[1]
        group = heads // keys.shape[0]
        k, v = mx.repeat(keys, group, axis=0), mx.repeat(values, group, axis=0)  # [heads, n, dim]
        scores = (k @ q[:, :, None])[:, :, 0]  # scale 1 (Gemma 4)
        j = np.arange(n)
        allowed = j <= position
        if kind == "sliding_attention":
            allowed &= position - j < c["sliding_window"]
        scores = mx.where(mx.array(allowed)[None], scores, -mx.inf)
        attn = (mx.softmax(scores, axis=-1)[:, None, :] @ v)[:, 0, :].reshape(-1)
        h = rms(attn @ w[p + "self_attn.o_proj.weight"].T, w[p + "post_attention_layernorm.weight"], eps)
        x = x + h
        h = rms(x, w[p + "pre_feedforward_layernorm.weight"], eps)
        h = (gelu_tanh(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
        x = x + rms(h, w[p + "post_feedforward_layernorm.weight"], eps)
        return x * w[p + "layer_scalar"]

    def draft(self, d: mx.array) -> int:
        head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        if not self.top.get("use_ordered_embeddings"):
            return int(mx.argmax(head @ d).item())
        scores = np.array(self.w["masked_embedding.centroids.weight"] @ d)
        top = np.argsort(-scores, kind="stable")[:self.top["centroid_intermediate_top_k"]]
        clusters = np.array(self.w["masked_embedding.token_ordering"]).reshape(self.top["num_centroids"], -1)
        selected = clusters[top].reshape(-1)
        logits = np.array(head[mx.array(selected)] @ d)
        return int(selected[int(np.argmax(logits))])

    def inputs(self, token: int, hidden: mx.array) -> mx.array:
        """[embed(token) * sqrt(backbone), hidden]: the target's embedding, vLLM's normalizer."""
        embed = self.target.model.embed_tokens.weight
        return mx.concatenate([embed[token] * self.top["backbone_hidden_size"] ** 0.5, hidden])

    def one_pass(self, token: int, hidden: mx.array, position: int, kv) -> tuple[mx.array, mx.array]:
        """(d, post_projection(d)) of one pass at `position` over the target's K/V `kv`."""
        x = self.inputs(token, hidden) @ self.w["pre_projection.weight"].T
        for i in range(self.config["num_hidden_layers"]):
            x = self.layer(i, x, position, kv)
        d = rms(x, self.w["model.norm.weight"], self.config["rms_norm_eps"])
        return d, d @ self.w["post_projection.weight"].T

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The assistant's k greedy drafts after `tokens` (the newest last), as vLLM runs it."""
        h, kv = self.target_states(tokens[:-1])
        position = len(tokens) - 2
        token, hidden, out = tokens[-1], h[position], []
        for _ in range(k):
            d, hidden = self.one_pass(token, hidden, position, kv)
            token = self.draft(d)
            out.append(token)
        return out
