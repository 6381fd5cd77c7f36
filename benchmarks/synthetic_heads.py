"""Synthetic targets with the speculative drafters vllm-metal serves besides
GLM's MTP layer (benchmarks/synthetic_mtp.py), for bench_speculative.py
--method: random weights (the Hub is out of reach), about SmolLM2-135M's
compute per token (hidden 576, its 49,152-token vocabulary), damped so that
the target's next token follows mostly from its last one and the drafter,
built to copy that map, agrees with it on most first drafts. What they
measure is each method's machinery at a known acceptance, not a real
drafter's acceptance. The targets have SmolLM2's depth (30 layers; Qwen3.5
32, a multiple of its attention interval).

- deepseek_mtp: DeepSeek-V3 (latent attention, q LoRA, a dense first layer
  then MoE with a shared expert) and its MTP layer (add_mtp_layer, with
  DeepSeek's copies of the embedding and head).
- qwen3_5_mtp: a Qwen3.5 hybrid (Gated DeltaNet layers, every 4th gated full
  attention) and its `mtp.*` layer (fc close to [I | mix x R]).
- gemma4_assistant: a gemma4_text target (sliding / full layers, the last
  layers reading earlier layers' caches, per-layer inputs) and a
  `gemma4_assistant` checkpoint written by transformers' own classes, its
  head masked by ordered embeddings (centroids) as Gemma 4's assistants ship.
- eagle3: SmolLM2-135M's llama shape and an EAGLE-3 head (midlayer, fc over
  three aux layers, a 4,096-token draft vocabulary with d2t / t2d).

tests/speculative/*_model.py build the tiny versions of these with their
references; the builders here follow the same recipes at the benchmark's size.

    .venv/bin/python benchmarks/synthetic_heads.py METHOD OUT_DIR
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
from synthetic_mtp import TOKENIZER_FILES, add_mtp_layer

METHODS = ("deepseek_mtp", "qwen3_5_mtp", "gemma4_assistant", "eagle3")
COMMON = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, rms_norm_eps=1e-6,
              max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="float32")
DEEPSEEK = dict(COMMON, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=9, q_lora_rank=192, kv_lora_rank=128,
                qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, attention_bias=False,
                n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=384,
                first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="noaux_tc", norm_topk_prob=True,
                routed_scaling_factor=1.0, rope_theta=10000.0, rope_scaling=None)
QWEN3_5_TEXT = dict(COMMON, model_type="qwen3_5_text", num_hidden_layers=32, full_attention_interval=4,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_value_heads=8,
                    linear_num_key_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                    linear_conv_kernel_dim=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
GEMMA4 = dict(COMMON, model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], num_hidden_layers=30,
              num_attention_heads=8, head_dim=64, global_head_dim=128, num_key_value_heads=2,
              num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=10, sliding_window=512,
              sliding_window_pattern=6, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,
              hidden_size_per_layer_input=16, vocab_size_per_layer_input=49152, final_logit_softcapping=30.0,
              enable_moe_block=False,
              rope_parameters={"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                                  "rope_type": "proportional"},
                               "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
                                                     "rope_type": "default"}})
LLAMA = dict(COMMON, model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0)
# The drafters' damping and noise. Measured with the tests' references (tests/speculative/*_model.py,
# mlx-lm, 23 greedy positions after a random 12-token prompt, 2026-11-29), first draft / first two taken:
# deepseek_mtp 70% / 48% (damp 0.01, noise 0.003, mix 0.05: 48% / 17%), qwen3_5_mtp 78% / 57% (damp 0.01:
# 61% / 30%), gemma4_assistant 70% / 48% (damps 0.1: 22% / 9%), eagle3 70% / 43% (copy 1: 74% / 4%), each
# with 12 target layers. At SmolLM2-135M's depth (DeepSeek-V3 30 layers, Qwen3.5 32: an MTP layer then
# costs about what it costs beside a real target, whose 48-61 layers it follows) every block's damping
# adds up: damp 0.001 there (in the served engine, copy prompts, 3 drafts: deepseek_mtp 76% of drafts
# taken, against 57% at 0.003; qwen3_5_mtp 74% / 80% / 58% per depth); gemma4_assistant (30 layers, a
# third reading earlier layers' caches) damps 0.001 / 0.003: 60% of drafts, 75% / 76% / 87% per depth.
TUNING = {"deepseek_mtp": dict(damp=0.001, spread=0.02, noise=0.001, mix=0.02), "qwen3_5_mtp": dict(damp=0.001),
          "gemma4_assistant": dict(damp=0.001, assistant_damp=0.003, masked=(1024, 32)),
          "eagle3": dict(damp=0.002, spread=0.02, noise=0.1, copy=4.0)}
ASSISTANT_HIDDEN, RANK = 256, 192  # Gemma 4: the assistant's width; the target's embeddings' first RANK coordinates
DRAFT_VOCAB = 4096  # EAGLE-3's draft vocabulary (target ids 0 .. 4095, shuffled)


def random_weights(config: dict, seed: int, damp: float = 1.0) -> dict:
    """mlx-lm's own classes for `config`, random weights as tests/families.py draws them (unit-variance
    activations, peaked logits), every block's output projection scaled by `damp` -> {name: mx.array}."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(json.loads(json.dumps(config))))
    rng = np.random.default_rng(seed)
    out = {}
    for name, value in tree_flatten(model.parameters()):
        if value.ndim >= 2:
            w = rng.standard_normal(value.shape, dtype=np.float32) / np.float32(np.sqrt(value.shape[-1]))
            if "embed_tokens" in name or "lm_head" in name:
                w *= 4.0
            elif name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
                w *= damp
            out[name] = mx.array(w)
        else:
            out[name] = value + mx.array(0.05 * rng.standard_normal(value.shape).astype(np.float32))
    return out


def _save(out: Path, weights: dict, config: dict, tokenizer_dir: str) -> None:
    import mlx.core as mx

    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_dir) / name, out / name)


def build_deepseek(out: Path, tokenizer_dir: str, config: dict = DEEPSEEK, seed: int = 0, damp: float = 0.01,
                   spread: float = 0.05, noise: float = 0.003, mix: float = 0.05) -> str:
    full = {**config, "num_hidden_layers": config["num_hidden_layers"] + 1}  # the last one: the MTP layer
    _save(out, random_weights(full, seed), full, tokenizer_dir)
    return add_mtp_layer(out, seed=seed, damp=damp, copies=True, spread=spread, noise=noise, mix=mix)


def build_qwen3_5(out: Path, tokenizer_dir: str, text: dict = QWEN3_5_TEXT, seed: int = 0, damp: float = 0.01,
                  mix: float = 0.05, noise: float = 0.003, spread: float = 0.05) -> str:
    """As tests/speculative/qwen_mtp_model.build_qwen_mtp: one interval of layers more, the last (full
    attention) of them made `mtp.layers.0` with Qwen's mtp.fc and norms; an LM head of its own."""
    import mlx.core as mx

    layers, interval = text["num_hidden_layers"], text["full_attention_interval"]
    big = {**text, "num_hidden_layers": layers + interval}
    wrap = lambda t: {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForCausalLM"],  # noqa: E731
                      "torch_dtype": "float32", "tie_word_embeddings": False, "text_config": t}
    weights = random_weights(wrap(big), seed, damp)
    kept = qwen_mtp_layout(weights, "language_model.model.layers.", layers, layers + interval - 1,
                           text["hidden_size"], np.random.default_rng(seed + 1), spread, mix, noise)
    _save(out, kept, wrap({**text, "mtp_num_hidden_layers": 1}), tokenizer_dir)
    return str(out)


def qwen_mtp_layout(weights: dict, root: str, layers: int, index: int, hidden: int, rng, spread: float,
                    mix: float, noise: float) -> dict:
    """A model's weights with layers past `layers` dropped and layer `index` (under `root`) kept as
    Qwen's `mtp.layers.0`, with the MTP norms (weights 1 + spread x noise) and an `mtp.fc` that passes
    the next token's embedding through and mixes in `mix` of the hidden state (drawn from `rng`)."""
    import mlx.core as mx

    mtp, kept = f"{root}{index}.", {}
    for name, w in weights.items():
        if name.startswith(mtp):
            kept["mtp.layers.0." + name[len(mtp):]] = w
        elif not (name.startswith(root) and int(name[len(root):].split(".")[0]) >= layers):
            kept[name] = w
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        kept[f"mtp.{norm}.weight"] = mx.array((1 + spread * rng.standard_normal(hidden)).astype(np.float32))
    fc = np.concatenate([np.eye(hidden), mix * rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)], axis=1)
    kept["mtp.fc.weight"] = mx.array((fc + noise * rng.standard_normal(fc.shape)).astype(np.float32))
    return kept


def build_gemma4(out: Path, tokenizer_dir: str, config: dict = GEMMA4, seed: int = 0, damp: float = 0.1,
                 assistant_damp: float = 0.1, mix: float = 0.05, masked: tuple | None = (1024, 32),
                 hidden: int = ASSISTANT_HIDDEN, rank: int = RANK) -> tuple:
    """(target, assistant) as tests/speculative/gemma4_assistant_model.py builds them: the target's
    blocks damped through their post-norms, its embeddings in their first RANK coordinates; the
    assistant (out/assistant) copying that bigram through its pre_projection and head."""
    import mlx.core as mx

    w = random_weights(config, seed)
    post = ("post_attention_layernorm", "post_feedforward_layernorm", "post_per_layer_input_norm")
    w = {k: v * damp if any(p in k for p in post) else v for k, v in w.items()}
    embed = np.array(w["model.embed_tokens.weight"])
    embed[:, rank:] = 0
    w["model.embed_tokens.weight"] = mx.array(embed)
    clusters = None
    if masked is not None:  # the head's rows clustered (a centroid + a smaller own part), so that the
        # assistant's centroids can find the clusters holding the target's best tokens, as trained ones do
        rng = np.random.default_rng(seed + 2)
        vocab, n = config["vocab_size"], masked[0]
        order = rng.permutation(vocab)
        centroids = rng.standard_normal((n, config["hidden_size"])) * 4 / np.sqrt(config["hidden_size"])
        head = np.empty((vocab, config["hidden_size"]), np.float32)
        head[order] = np.repeat(centroids, vocab // n, axis=0) + 0.5 * np.array(w["lm_head.weight"])[order]
        w["lm_head.weight"] = mx.array(head)
        clusters = (order, centroids)
    _save(out / "target", w, config, tokenizer_dir)
    assistant = build_assistant(out / "assistant", config, w, assistant_damp, mix, masked, seed + 1, hidden,
                                clusters)
    return str(out / "target"), assistant


def build_assistant(out: Path, target: dict, tw: dict, damp: float, mix: float,
                    masked: tuple | None, seed: int, hidden: int = ASSISTANT_HIDDEN, clusters=None,
                    text: dict | None = None, top: dict | None = None) -> str:
    """A gemma4_assistant (transformers' own classes and save_pretrained) copying the target's bigram
    through the first `hidden` coordinates; clusters: (token order, centroids) of the target's head
    (else ordered_clusters of the assistant's own); text / top: config fields over the defaults (the
    text config's, the assistant config's; tests/speculative/gemma4_assistant_model.py's bad ones)."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    rng = np.random.default_rng(seed)
    text_config = dict(
        vocab_size=target["vocab_size"], hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=target["num_key_value_heads"], head_dim=target["head_dim"],
        global_head_dim=target["global_head_dim"], num_global_key_value_heads=target["num_global_key_value_heads"],
        attention_k_eq_v=target["attention_k_eq_v"], layer_types=["sliding_attention", "full_attention"],
        sliding_window=target["sliding_window"], rope_parameters=target["rope_parameters"],
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=30.0,
        rms_norm_eps=target["rms_norm_eps"], max_position_embeddings=target["max_position_embeddings"],
        **(text or {}))
    fields = dict(backbone_hidden_size=target["hidden_size"], **(top or {}))
    if masked is not None:
        fields.update(use_ordered_embeddings=True, num_centroids=masked[0], centroid_intermediate_top_k=masked[1])
    config = Gemma4AssistantConfig(text_config=text_config, **fields)
    config.architectures = ["Gemma4AssistantForCausalLM"]
    model = Gemma4AssistantForCausalLM(config)
    backbone = fields["backbone_hidden_size"]
    proj = np.eye(hidden, backbone)  # the embedding half of pre_projection: the first `hidden` coordinates
    head = np.array(tw["lm_head.weight"]) @ proj.T  # the target's head, seen through the map
    state = {}
    for name, value in model.state_dict().items():
        shape = tuple(value.shape)
        if name == "masked_embedding.token_ordering":
            v = rng.permutation(shape[0])
        elif name.endswith("layer_scalar"):
            v = 1 + 0.05 * rng.standard_normal(shape)
        elif len(shape) >= 2:
            v = rng.standard_normal(shape) / np.sqrt(shape[-1])
        else:
            v = 1 + 0.05 * rng.standard_normal(shape)
            if "post_attention_layernorm" in name or "post_feedforward_layernorm" in name:
                v = v * damp
        state[name] = v
    state["pre_projection.weight"] = np.concatenate(
        [proj / np.sqrt(backbone) * 4, mix * rng.standard_normal((hidden, backbone)) / np.sqrt(backbone)], axis=1)
    state["model.norm.weight"] = proj @ np.array(tw["model.norm.weight"])
    state["model.embed_tokens.weight"] = head + 0.01 * rng.standard_normal(head.shape)
    if "lm_head.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    if masked is not None:
        state["masked_embedding.token_ordering"], state["masked_embedding.centroids.weight"] = \
            (clusters[0], clusters[1] @ proj.T) if clusters else \
            ordered_clusters(state["model.embed_tokens.weight"], masked[0], rng)
    sd = model.state_dict()
    model.load_state_dict({k: torch.tensor(np.asarray(v), dtype=sd[k].dtype) for k, v in state.items()}, strict=True)
    model.save_pretrained(str(out), safe_serialization=True)
    return str(out)


def ordered_clusters(head: np.ndarray, clusters: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Token ordering and centroids (use_ordered_embeddings) whose top clusters tend to hold the
    head's best tokens: each of log2(clusters) random directions halves every group of tokens by
    their head rows' projection on it; a cluster's centroid sums its halves' signed directions."""
    levels = int(np.log2(clusters))
    directions = rng.standard_normal((levels, head.shape[1]))
    groups = [np.arange(head.shape[0])]
    for u in directions:
        split = []
        for g in groups:
            order = g[np.argsort(-(head[g] @ u), kind="stable")]
            split += [order[:len(g) // 2], order[len(g) // 2:]]
        groups = split
    signs = np.array([[1 - 2 * ((c >> (levels - 1 - i)) & 1) for i in range(levels)] for c in range(clusters)])
    return np.concatenate(groups), signs @ directions


def build_eagle3(out: Path, tokenizer_dir: str, config: dict = LLAMA, seed: int = 0, damp: float = 0.02,
                 spread: float = 0.1, noise: float = 0.35, copy: float = 1.0) -> tuple:
    """(target, head) as tests/speculative/eagle3_model.py builds them: the target's embeddings mostly in
    their first E = kv heads x head dim coordinates, its blocks writing those damped and the rest x spread,
    its head barely reading the rest and leaving tokens past DRAFT_VOCAB never argmax; the head's
    attention copies the input token's embedding (each position attends mostly to itself), `copy` times
    (above 1 it outweighs the fed-back hidden state: chained drafts follow the last draft)."""
    import mlx.core as mx

    w = random_weights(config, seed)
    hidden, heads, kv_heads, hd = (config[k] for k in ("hidden_size", "num_attention_heads",
                                                       "num_key_value_heads", "head_dim"))
    e_dims = kv_heads * hd
    for k in list(w):
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            rows = np.array(w[k])
            rows[:e_dims] *= damp
            rows[e_dims:] *= spread
            w[k] = mx.array(rows)
    e = np.array(w["model.embed_tokens.weight"])
    e[:, e_dims:] *= 0.1
    w["model.embed_tokens.weight"] = mx.array(e)
    lm = np.array(w["lm_head.weight"])
    lm[:, e_dims:] *= 0.1
    lm[DRAFT_VOCAB:] *= 0.05
    w["lm_head.weight"] = mx.array(lm)
    _save(out / "target", w, config, tokenizer_dir)
    rng = np.random.default_rng(seed + 1)
    rand = lambda r, c, s=1.0: rng.standard_normal((r, c)) * s / np.sqrt(c)  # noqa: E731
    rep, eye = heads // kv_heads, np.eye(hd)
    q, k, v = (rand(n * hd, 2 * hidden, noise) for n in (heads, kv_heads, kv_heads))
    for h in range(heads):  # query head h reads kv head h // rep: embedding coordinates of that group
        q[h * hd:(h + 1) * hd, (h // rep) * hd:(h // rep + 1) * hd] += 1.5 * eye
    for g in range(kv_heads):  # values: the token's embedding less the (normed) hidden state fed with it
        k[g * hd:(g + 1) * hd, g * hd:(g + 1) * hd] += 1.5 * eye
        v[g * hd:(g + 1) * hd, g * hd:(g + 1) * hd] += eye
        v[g * hd:(g + 1) * hd, hidden + g * hd:hidden + (g + 1) * hd] -= eye
    o = rand(hidden, heads * hd, noise)
    for h in range(heads):
        o[(h // rep) * hd:(h // rep + 1) * hd, h * hd:(h + 1) * hd] += copy * eye / rep
    inter = config["intermediate_size"]
    t = {"midlayer.self_attn.q_proj.weight": q, "midlayer.self_attn.k_proj.weight": k,
         "midlayer.self_attn.v_proj.weight": v, "midlayer.self_attn.o_proj.weight": o,
         "midlayer.mlp.gate_proj.weight": rand(inter, hidden), "midlayer.mlp.up_proj.weight": rand(inter, hidden),
         "midlayer.mlp.down_proj.weight": rand(hidden, inter, noise), "fc.weight": rand(hidden, 3 * hidden, noise)}
    # fc: the first aux state (about the token's embedding) at the size of the head's own output, so
    # that the first pass and the chained ones see alike inputs (a hidden state holding the last token)
    t["fc.weight"][:, :hidden] += copy / np.sqrt(np.mean(e ** 2)) * np.eye(hidden)
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        t[f"midlayer.{name}.weight"] = 1 + 0.05 * rng.standard_normal(hidden)
    t["norm.weight"] = np.array(w["model.norm.weight"])
    perm = rng.permutation(DRAFT_VOCAB)
    t["lm_head.weight"] = lm[perm]
    t["d2t"] = (perm - np.arange(DRAFT_VOCAB)).astype(np.int64)
    t2d = np.zeros(config["vocab_size"], bool)
    t2d[perm] = True
    t["t2d"] = t2d
    head_config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
                   "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                   "head_dim": hd, "num_hidden_layers": 1, "rms_norm_eps": config["rms_norm_eps"],
                   "vocab_size": config["vocab_size"], "rope_theta": config["rope_theta"],
                   "max_position_embeddings": config["max_position_embeddings"], "tie_word_embeddings": False,
                   "torch_dtype": "float32", "draft_vocab_size": DRAFT_VOCAB}
    (out / "head").mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "head" / "model.safetensors"),
                        {k: mx.array(a.astype(np.float32) if a.dtype == np.float64 else a) for k, a in t.items()})
    (out / "head" / "config.json").write_text(json.dumps(head_config, indent=1))
    return str(out / "target"), str(out / "head")


def build(method: str, out: Path, tokenizer_dir: str, configs: dict | None = None, **tuning) -> dict:
    """{"target": dir, "draft": dir or None} of `method` under `out` (built again only when what is asked
    changes, these builders included: the marker out/build.json). configs: {name: config fields over the
    benchmark's} (the tests' tiny sizes); tuning: over TUNING[method]."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: one of {', '.join(METHODS)}")
    tuning = {**TUNING[method], **tuning}
    source = hashlib.sha256(Path(__file__).read_bytes() + Path(add_mtp_layer.__code__.co_filename).read_bytes())
    marker = {"method": method, "configs": configs or {}, "tuning": tuning, "builders": source.hexdigest()[:16]}
    done = out / "build.json"
    if done.exists() and json.loads(done.read_text()).get("marker") == json.loads(json.dumps(marker)):
        return json.loads(done.read_text())["paths"]
    shutil.rmtree(out, ignore_errors=True)
    over = lambda name, base: {**base, **(configs or {}).get(name, {})}  # noqa: E731
    if method == "deepseek_mtp":
        paths = {"target": build_deepseek(out / "target", tokenizer_dir, over("deepseek", DEEPSEEK), **tuning),
                 "draft": None}
    elif method == "qwen3_5_mtp":
        paths = {"target": build_qwen3_5(out / "target", tokenizer_dir, over("qwen3_5", QWEN3_5_TEXT), **tuning),
                 "draft": None}
    elif method == "gemma4_assistant":
        target, draft = build_gemma4(out, tokenizer_dir, over("gemma4", GEMMA4), **tuning)
        paths = {"target": target, "draft": draft}
    else:
        target, draft = build_eagle3(out, tokenizer_dir, over("llama", LLAMA), **tuning)
        paths = {"target": target, "draft": draft}
    done.write_text(json.dumps({"marker": marker, "paths": paths}, indent=1))
    return paths


if __name__ == "__main__":
    from vllm_metal.formats.default_model import ensure_default_model

    print(build(sys.argv[1], Path(sys.argv[2]), ensure_default_model()))
