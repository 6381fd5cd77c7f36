"""Qwen3-Next and Qwen3.5 multi-token prediction (vLLM's method "mtp" on
qwen3_next, qwen3_5, qwen3_5_moe: its Qwen3NextMTP, Qwen3_5MTP,
Qwen3_5MoeMTP): the checkpoint's `mtp.*` layer as the drafter. mlx-lm drops
these tensors at load (its sanitize); they are read here.

The layer (vLLM's Qwen3_5MultiTokenPredictor / Qwen3NextMultiTokenPredictor,
same weights, same arithmetic): for the pair (token t_{i+1}, the target's
final hidden state h_i) at position i,
x = fc([pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)]) --
nothing zeroed at position 0, unlike GLM's layer -- then one full-attention
decoder layer of the family (`mtp.layers.0`: gated attention with its own
paged KV cache, the family's MLP or MoE, run on mlx-lm's own block), then
`mtp.norm`; the draft is the argmax of the target's head (vLLM shares the
target's embedding and head) on that normed row, and pass j > 1 reads the
normed row back (the predictor's forward returns it). A Hugging Face
checkpoint stores these RMSNorms' weights as w for x * (1 + w) (vLLM's
GemmaRMSNorm): they are shifted by one, as mlx-lm shifts the target's.

Where the layer runs, its passes and its pending pairs are MtpDrafter's
(mtp.py). The target's linear-attention states are kept per draft position
by its Gated DeltaNet layers (models/draft_states.py).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from vllm_metal.models.loaded_model import LoadedModel, decoder_owner
from vllm_metal.speculative.mtp import MtpDrafter, _checkpoint_tensors, _Given

QWEN_MTP_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# The layer's modules beside its decoder block: ours -> the checkpoint's.
EXTRAS = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "shared_norm": "norm"}
BLOCK_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight")


def text_config(config: dict) -> dict:
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def qwen_mtp_layer_count(config: dict) -> int:
    """mtp_num_hidden_layers (qwen3_5) or num_nextn_predict_layers (qwen3_next)."""
    text = text_config(config)
    return int(text.get("mtp_num_hidden_layers") or text.get("num_nextn_predict_layers") or 0)


class QwenMtpDrafter(MtpDrafter):
    zero_first = False  # vLLM's Qwen MTP layers feed position 0's embedding as it is


def _hugging_face_layout(directory: Path, config: dict) -> bool:
    """The checkpoint stores Hugging Face's layout (Gemma-style norm weights
    w, convolution weights [C, 1, K]), not mlx-lm's (1 + w, [C, K, 1]):
    mlx-lm's own test for it (qwen3_5 sanitize), on a convolution weight."""
    import json

    index = directory / "model.safetensors.index.json"
    files = sorted({f for k, f in json.loads(index.read_text())["weight_map"].items() if "conv1d.weight" in k}) \
        if index.exists() else sorted(p.name for p in directory.glob("*.safetensors"))
    for name in files:
        for k, v in mx.load(str(directory / name)).items():
            if "conv1d.weight" in k:
                return v.shape[-1] != 1
    return False


def _stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Experts stored one by one (mlp.experts.{e}.{gate,up,down}_proj.weight) as mlx-lm's stacks
    (mlp.switch_mlp.*_proj.weight); fused (experts.gate_up_proj) or stacked ones are mlx-lm's sanitize's."""
    out = dict(weights)
    for name in ("gate_proj", "up_proj", "down_proj"):
        keys = sorted((k for k in weights if ".mlp.experts." in k and k.endswith(f".{name}.weight")
                       and k.split(".mlp.experts.")[1].split(".")[0].isdigit()),
                      key=lambda k: int(k.split(".mlp.experts.")[1].split(".")[0]))
        if keys:
            stacked = mx.stack([out.pop(k) for k in keys])
            out[keys[0].split(".mlp.experts.")[0] + f".mlp.switch_mlp.{name}.weight"] = stacked
    return out


def load_qwen_mtp(target: LoadedModel, model_dir: str, spec_config, dtype: str, dequantize: bool, fuse: bool,
                  norm_rope: bool) -> QwenMtpDrafter:
    """The checkpoint's first MTP layer (vLLM chains it for every draft)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from vllm_metal.formats.checkpoint import open_checkpoint
    from vllm_metal.models.loader import DTYPES, prepare_model

    checkpoint = open_checkpoint(model_dir)
    config = checkpoint.config
    family, text = config.get("model_type"), text_config(config)
    quantized = config.get("quantization") or config.get("quantization_config")
    if family not in QWEN_MTP_FAMILIES or not checkpoint.native or quantized or qwen_mtp_layer_count(config) < 1:
        kind = f"{'quantized ' if quantized else ''}{checkpoint.format}"
        raise ValueError(f"{model_dir}: no multi-token-prediction layer vllm-metal can run (a {family} {kind} "
                         f"checkpoint with {qwen_mtp_layer_count(config)} MTP layers; served: "
                         f"{list(QWEN_MTP_FAMILIES)} unquantized safetensors checkpoints)")
    directory = Path(checkpoint.source)
    tensors = _checkpoint_tensors(directory, "mtp.")
    shift = 1.0 if _hugging_face_layout(directory, config) else 0.0
    # One full-attention decoder layer of the family (mlx-lm: layer i is linear unless (i + 1) % interval
    # == 0) with a head of its own: the target's matrix, tied or not.
    one_text = {**text, "num_hidden_layers": 1, "full_attention_interval": 1, "tie_word_embeddings": False}
    if "layer_types" in one_text:
        one_text["layer_types"] = ["full_attention"]
    nested = text is not config
    one = {**config, "text_config": one_text, "tie_word_embeddings": False} if nested else one_text
    model_class, args_class = _get_classes(one)
    model = model_class(args_class.from_dict(one))
    raw = {f"model.layers.0.{k[len('mtp.layers.0.'):]}": v for k, v in tensors.items()
           if k.startswith("mtp.layers.0.")}
    raw = _stack_experts(raw)
    unshifted = {id(v) for k, v in raw.items() if k.endswith(BLOCK_NORMS) and v.ndim == 1}
    block = model.sanitize(raw)
    # Norms mlx-lm's sanitize left as they were (qwen3_5's shifts only beside a convolution weight).
    block = {k: v + shift if id(v) in unshifted else v for k, v in block.items()}
    prefix = "language_model.model.layers.0." if nested else "model.layers.0."
    own = decoder_owner(model)
    wanted = {k for k, _ in tree_flatten(own["model"].layers[0].parameters())}
    missing = sorted(wanted - {k[len(prefix):] for k in block if k.startswith(prefix)})
    if missing:
        raise ValueError(f"{model_dir}: its MTP layer lacks mtp.layers.0.{missing[0]}"
                         f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
    model.load_weights(list(block.items()), strict=False)
    hidden, eps = text["hidden_size"], text.get("rms_norm_eps", 1e-6)
    extras = {"enorm": nn.RMSNorm(hidden, eps=eps), "hnorm": nn.RMSNorm(hidden, eps=eps),
              "eh_proj": nn.Linear(2 * hidden, hidden, bias=False), "shared_norm": nn.RMSNorm(hidden, eps=eps)}
    for name, module in extras.items():
        key = f"mtp.{EXTRAS[name]}.weight"
        if key not in tensors:
            raise ValueError(f"{model_dir}: its MTP layer lacks {key}")
        module.weight = tensors[key] + (shift if isinstance(module, nn.RMSNorm) else 0.0)
        module.set_dtype(DTYPES[dtype])
    owner = decoder_owner(target.model)
    if "lm_head" in owner:  # the target's head (vLLM's MTP shares it, and the embedding)
        own["lm_head"] = owner["lm_head"]
    else:  # a tied head: the target's embedding matrix
        own["lm_head"].weight = owner["model"].embed_tokens.weight
    decoder = own["model"]
    decoder.embed_tokens, decoder.norm = _Given(), nn.Identity()
    block_model = prepare_model(model, one, dtype, dequantize, True, fuse, norm_rope)
    block_model.share_greedy_head(target)
    mx.eval([m.parameters() for m in extras.values()])
    block_model.weights_bytes += sum(v.nbytes for m in extras.values() for _, v in tree_flatten(m.parameters()))
    block_model.weights_bytes -= sum(v.nbytes for _, v in tree_flatten(own["lm_head"].parameters()))  # the target's
    return QwenMtpDrafter(block_model, owner["model"].embed_tokens, extras, spec_config.num_speculative_tokens,
                          spec_config.target_model_config.max_model_len, feeds_normed=True)
