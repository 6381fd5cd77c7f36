"""Tiny EAGLE-3 heads for tiny targets, and an independent reference of
their drafts.

The target: tests/families.py's tiny llama / qwen3 (no windows), its
embeddings mostly in their first 32 dimensions, its blocks writing those
damped (the next token follows mostly from the last one) and the other 32
in full (the residual stream changes from layer to layer there, where its
head barely looks), and (llama) its head leaving the tokens from
DRAFT_VOCAB on almost never argmax.

The head (vLLM's checkpoint layout, as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
ships it: midlayer.*, fc.weight, norm.weight, lm_head.weight, d2t, t2d):
its attention copies the input token's embedding (queries and keys are
that embedding scaled, so each position attends mostly to itself, values
are the embedding), so norm + lm_head of its output approximates the
target's next-token guess; fc (the target's aux states), the hidden part of
q/k/v and the MLP add terms of comparable size, so that every draft depends
on all of the head's arithmetic and is often, not always, the target's
token. The llama head has a draft vocabulary (DRAFT_VOCAB target ids in a
shuffled order: d2t maps them back); the qwen3 head has none, and no
lm_head (vLLM then uses the target's).

The reference (`Reference.drafts`): mlx-lm's own target forward over the
whole sequence, its layers hooked for the residual stream before each aux
layer (vLLM's EagleModelMixin: layer n = after the last layer, before the
final norm); the head in plain MLX ops with dense causal attention over
every pair (t_{i+1}, fc(aux_i)) at position i, then chained for k drafts
(the head's pre-norm output fed back, its greedy draft as the next token),
as vLLM's EAGLE-3 proposer runs it.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from families import build

DRAFT_VOCAB = 4096


def build_target(family: str, out: Path, tokenizer_dir: str, layers: int, damp: float = 0.02,
                 spread: float = 1.0, seed: int = 0) -> str:
    """damp, spread: the factors of the blocks' writes to dims 0:32 and 32:64."""
    overrides = {"num_hidden_layers": layers}
    if family == "llama":
        overrides.update(sliding_window=None, layer_types=None)
    build(family, out, tokenizer_dir, seed=seed, overrides={k: v for k, v in overrides.items()})
    if family == "llama":  # (families' llama has windows: dropped)
        config = json.loads((out / "config.json").read_text())
        for k in ("sliding_window", "layer_types"):
            config.pop(k, None)
        (out / "config.json").write_text(json.dumps(config, indent=1))
    w = dict(mx.load(str(out / "model.safetensors")))
    for k in list(w):  # blocks write dims 0:32 damped, 32:64 in full (the aux states differ layer to layer)
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            rows = np.array(w[k])
            rows[:32] *= damp
            rows[32:] *= spread
            w[k] = mx.array(rows)
    e = np.array(w["model.embed_tokens.weight"])
    e[:, 32:] *= 0.1
    w["model.embed_tokens.weight"] = mx.array(e)
    head = np.array(w["lm_head.weight"])
    head[:, 32:] *= 0.1  # ... and barely move the logits
    if family == "llama":  # tokens past DRAFT_VOCAB practically never argmax
        head[DRAFT_VOCAB:] *= 0.05
    w["lm_head.weight"] = mx.array(head)
    mx.save_safetensors(str(out / "model.safetensors"), w)
    return str(out)


def build_head(out: Path, target_dir: str, family: str, aux_ids: list[int] | None = None, seed: int = 1,
               copy: float = 1.0, noise: float = 0.35, drop: tuple[str, ...] = (), config_overrides=None) -> str:
    """An EAGLE-3 head for the target at `target_dir` (see the module docstring).
    drop: tensor names left out; config_overrides: config fields over the head's."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    tw = mx.load(str(Path(target_dir) / "model.safetensors"))
    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads, hd = 64, 4, 2, 16
    n_aux = len(aux_ids) if aux_ids else 3

    def rand(rows, cols, scale=1.0):
        return rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)

    eye = np.eye(hd)
    q = rand(heads * hd, 2 * hidden, noise)
    k = rand(kv_heads * hd, 2 * hidden, noise)
    v = rand(kv_heads * hd, 2 * hidden, noise)
    c = 1.5 if family == "llama" else 1.0
    for h in range(heads):  # query heads 0, 1 read kv head 0 (embedding dims 0:16), 2, 3 kv head 1 (16:32)
        q[h * hd:(h + 1) * hd, (h // 2) * hd:(h // 2 + 1) * hd] += c * eye
    for g in range(kv_heads):
        k[g * hd:(g + 1) * hd, g * hd:(g + 1) * hd] += c * eye
        v[g * hd:(g + 1) * hd, g * hd:(g + 1) * hd] += eye
    o = rand(hidden, heads * hd, noise)
    for h in range(heads):
        o[(h // 2) * hd:(h // 2 + 1) * hd, h * hd:(h + 1) * hd] += 0.5 * copy * eye
    t = {"midlayer.self_attn.q_proj.weight": q, "midlayer.self_attn.k_proj.weight": k,
         "midlayer.self_attn.v_proj.weight": v, "midlayer.self_attn.o_proj.weight": o,
         "midlayer.mlp.gate_proj.weight": rand(128, hidden), "midlayer.mlp.up_proj.weight": rand(128, hidden),
         "midlayer.mlp.down_proj.weight": rand(hidden, 128, noise),
         "fc.weight": rand(hidden, n_aux * hidden, noise)}
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        t[f"midlayer.{name}.weight"] = 1 + 0.05 * rng.standard_normal(hidden)
    if family == "qwen3":  # per-head q/k norms: scaled so each position still attends mostly to itself
        t["midlayer.self_attn.q_norm.weight"] = 2 + 0.05 * rng.standard_normal(hd)
        t["midlayer.self_attn.k_norm.weight"] = 2 + 0.05 * rng.standard_normal(hd)
    t["norm.weight"] = np.array(tw["model.norm.weight"])
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": 128, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": hd, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "vocab_size": target["vocab_size"],
              "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
              "torch_dtype": "float32"}
    if family == "llama":  # a draft vocabulary: target ids 0 .. DRAFT_VOCAB - 1, shuffled
        perm = rng.permutation(DRAFT_VOCAB)
        t["lm_head.weight"] = np.array(tw["lm_head.weight"])[perm]
        t["d2t"] = (perm - np.arange(DRAFT_VOCAB)).astype(np.int64)
        t2d = np.zeros(target["vocab_size"], bool)
        t2d[perm] = True
        t["t2d"] = t2d
        config["draft_vocab_size"] = DRAFT_VOCAB
    else:  # vLLM's Qwen3 EAGLE-3 layer (per-head q/k norms); the target's lm_head
        config.update(architectures=["Eagle3Qwen3ForCausalLM"], model_type="qwen3")
    if aux_ids:
        config["eagle_aux_hidden_state_layer_ids"] = aux_ids
    config.update(config_overrides or {})
    out.mkdir(parents=True, exist_ok=True)
    arrays = {k: mx.array(v.astype(np.float32) if v.dtype == np.float64 else v) for k, v in t.items()
              if k not in drop}
    mx.save_safetensors(str(out / "model.safetensors"), arrays)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return str(out)


def aux_states(target, tokens: list[int], aux_ids: tuple[int, ...]) -> mx.array:
    """The residual stream before each of `aux_ids`' layers (id n: after the last), concatenated
    [tokens, n x hidden], from mlx-lm's own forward of `target` (its layers hooked)."""
    layers = target.model.layers
    seen: dict[int, mx.array] = {}
    originals = list(layers)

    class Hooked:  # records the layer's input and output; anything else is the layer's
        def __init__(self, i, layer):
            self.i, self.layer = i, layer

        def __call__(self, x, *args, **kwargs):
            seen[self.i] = x
            seen[self.i + 1] = out = self.layer(x, *args, **kwargs)
            return out

        def __getattr__(self, name):
            return getattr(self.layer, name)

    layers[:] = [Hooked(i, layer) for i, layer in enumerate(originals)]
    try:
        target.model(mx.array(tokens)[None])
    finally:
        layers[:] = originals
    return mx.concatenate([seen[i][0] for i in aux_ids], axis=-1)


def _rms(x, w, eps=1e-5):
    return mx.fast.rms_norm(x, mx.array(w) if not isinstance(w, mx.array) else w, eps)


class Reference:
    """mlx-lm's target and the head in plain MLX ops (dense attention)."""

    def __init__(self, target_dir: str, head_dir: str, aux_ids: tuple[int, ...] | None = None):
        from mlx_lm.utils import load_model

        self.target, _ = load_model(Path(target_dir))
        self.target.set_dtype(mx.float32)
        self.config = json.loads((Path(head_dir) / "config.json").read_text())
        self.w = {k: v.astype(mx.float32) if v.dtype != mx.int64 and v.dtype != mx.bool_ else v
                  for k, v in mx.load(str(Path(head_dir) / "model.safetensors")).items()}
        n = len(self.target.model.layers)
        ids = aux_ids or self.config.get("eagle_aux_hidden_state_layer_ids") or (2, n // 2, n - 3)
        self.aux_ids = tuple(sorted(set(ids)))  # vLLM sorts and de-duplicates them
        c = self.config
        self.heads, self.kv_heads, self.hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]

    def aux(self, tokens: list[int]) -> mx.array:
        return aux_states(self.target, tokens, self.aux_ids)

    def layer(self, ids: list[int], g: mx.array, start: int, cache: list) -> mx.array:
        """The head's decoder layer over pairs (ids[j], g[j]) at positions start + j, its K/V appended to `cache`."""
        w, p = self.w, "midlayer."
        embed = w["embed_tokens.weight"] if "embed_tokens.weight" in w else self.target.model.embed_tokens.weight
        e = embed[mx.array(ids)]
        a = mx.concatenate([_rms(e, w[p + "input_layernorm.weight"]), _rms(g, w[p + "hidden_norm.weight"])], -1)
        m = a.shape[0]
        q = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(m, self.heads, self.hd)
        k = (a @ w[p + "self_attn.k_proj.weight"].T).reshape(m, self.kv_heads, self.hd)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(m, self.kv_heads, self.hd)
        if p + "self_attn.q_norm.weight" in w:
            q, k = _rms(q, w[p + "self_attn.q_norm.weight"]), _rms(k, w[p + "self_attn.k_norm.weight"])
        theta = self.config.get("rope_theta", 10000.0)
        q = mx.fast.rope(q.transpose(1, 0, 2)[None], self.hd, traditional=False, base=theta, scale=1.0, offset=start)
        k = mx.fast.rope(k.transpose(1, 0, 2)[None], self.hd, traditional=False, base=theta, scale=1.0, offset=start)
        cache.append((k[0], v.transpose(1, 0, 2)))
        keys = mx.concatenate([c[0] for c in cache], axis=1)  # [kv_heads, positions, hd]
        values = mx.concatenate([c[1] for c in cache], axis=1)
        rep = self.heads // self.kv_heads
        keys, values = mx.repeat(keys, rep, axis=0), mx.repeat(values, rep, axis=0)
        scores = (q[0] @ keys.transpose(0, 2, 1)) * self.hd ** -0.5  # [heads, m, positions]
        total = keys.shape[1]
        qpos = np.arange(total - m, total)[:, None]
        mask = np.where(np.arange(total)[None, :] <= qpos, 0.0, -np.inf).astype(np.float32)
        attn = mx.softmax(scores + mx.array(mask), axis=-1) @ values  # [heads, m, hd]
        h = g + attn.transpose(1, 0, 2).reshape(m, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"])
        r = (mx.sigmoid(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.gate_proj.weight"].T)
             * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        return h + r  # pre-norm: what vLLM feeds back

    def draft(self, m: mx.array) -> int:
        w = self.w
        head = w["lm_head.weight"] if "lm_head.weight" in w else self.target.lm_head.weight
        d = int(mx.argmax(_rms(m[-1:], w["norm.weight"]) @ head.T, axis=-1).item())
        return d + int(w["d2t"][d].item()) if "d2t" in w else d

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The head's k greedy drafts after `tokens` (the newest last), as vLLM's proposer runs it."""
        n = len(tokens)
        g = self.aux(tokens)[:n - 1] @ self.w["fc.weight"].T
        cache: list = []
        m = self.layer(tokens[1:], g, 0, cache)[-1:]  # pairs (t_{i+1}, fc(aux_i)) at i < n - 1
        out = []
        for j in range(k):
            out.append(self.draft(m))
            if j + 1 < k:
                m = self.layer([out[-1]], m, n - 1 + j, cache)
        return out

    def target_next(self, tokens: list[int], count: int) -> list[int]:
        """The target's greedy continuation (mlx-lm, whole sequence each step)."""
        tokens = list(tokens)
        for _ in range(count):
            logits = self.target(mx.array(tokens)[None])[0, -1]
            tokens.append(int(mx.argmax(logits).item()))
        return tokens[-count:]
