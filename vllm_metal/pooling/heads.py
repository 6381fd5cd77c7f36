"""The pooler a pooling model answers with: vLLM's own (DispatchPooler and
its poolers, heads and activations, torch on the CPU), given the head
weights from the checkpoint. MLX computes the hidden states; vLLM's code
pools them, so `--pooler-config`, sentence-transformers' `1_Pooling` /
Dense / Normalize modules, matryoshka `dimensions` and the classify
activation mean exactly what they mean on vLLM's own backends.

What vLLM's model classes build, head by head:
- embed (BertModel, XLMRobertaModel, `--convert embed`): DispatchPooler.for_embedding.
- classify, decoder (`*ForSequenceClassification`, `--convert classify`):
  a `score` linear layer on the pooled state (vLLM's as_seq_cls_model),
  from the checkpoint's `score.weight`, or from two rows of the LM head
  (`classifier_from_token` + `method`, Qwen3-Reranker's hf_overrides).
- classify, BERT: vLLM's BertPooler (CLS, dense, tanh) then `classifier`.
- classify, (XLM-)RoBERTa: vLLM's RobertaClassificationHead (dense, tanh, out_proj).
- classify, ModernBERT: vLLM's ModernBertPooler (the config's classifier
  pooling, dense, GELU, LayerNorm) then `classifier`.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_metal.models.encoders import ENCODERS
from vllm_metal.pooling.checkpoint import SPECIAL

KINDS = ("embed", "classify")


class PoolingModelError(ValueError):
    """A pooling checkpoint vllm-metal cannot serve (named, with why)."""


# Checkpoint architectures served natively (no --convert): the plain
# embedding models and sequence classifiers; the SPECIAL ones are refused by name.
EMBED_SUFFIXES = ("Model",)
CLASSIFY_SUFFIXES = ("ForSequenceClassification",)


def pooling_kind(model_config) -> str:
    """'embed' or 'classify', as vLLM resolved the checkpoint and --convert."""
    convert = getattr(model_config, "convert_type", "none")
    if convert in KINDS:
        return convert
    arch = (model_config.architectures or [""])[0]
    if not any(s in arch for s in SPECIAL):
        if arch.endswith(CLASSIFY_SUFFIXES):
            return "classify"
        if arch.endswith(EMBED_SUFFIXES) or arch.endswith("ForCausalLM"):
            return "embed"
    raise PoolingModelError(f"vllm-metal cannot serve {arch} with --runner pooling: served are embedding models "
                            "(*Model checkpoints, or a *ForCausalLM with --convert embed) and sequence "
                            "classifiers (*ForSequenceClassification, or --convert classify); token classifiers, "
                            "multi-vector (ColBERT) and sparse (SPLADE, BGE-M3 sparse) heads are not served")


def _linear(weight: np.ndarray, bias: np.ndarray | None, dtype: torch.dtype) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(weight)))
        if bias is not None:
            layer.bias.copy_(torch.from_numpy(np.ascontiguousarray(bias)))
    return layer.eval()


def _take(weights: dict[str, np.ndarray], name: str, where: str) -> np.ndarray:
    if name not in weights:
        raise PoolingModelError(f"{where}: the checkpoint has no {name} (the classifier head)")
    return weights[name]


def decoder_score_weight(model_config, weights: dict[str, np.ndarray], head_rows) -> tuple[np.ndarray, np.ndarray | None]:
    """A decoder classifier's `score` layer: the checkpoint's, or built
    from LM-head rows as vLLM's as_seq_cls_model does (`head_rows(ids)` ->
    [len(ids), hidden] float32)."""
    hf = model_config.hf_config
    text = hf.get_text_config()
    tokens = getattr(hf, "classifier_from_token", getattr(text, "classifier_from_token", None))
    method = getattr(hf, "method", getattr(text, "method", None))
    where = model_config.model
    if tokens is None:
        if method is not None:
            raise PoolingModelError(f"{where}: method={method!r} needs classifier_from_token")
        return _take(weights, "score.weight", where), weights.get("score.bias")
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(model_config.tokenizer, revision=model_config.tokenizer_revision,
                              tokenizer_mode=model_config.tokenizer_mode,
                              trust_remote_code=model_config.trust_remote_code)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    unknown = [t for t, i in zip(tokens, ids) if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise PoolingModelError(f"{where}: classifier_from_token {unknown} are not tokens of the tokenizer")
    rows = head_rows(ids).astype(np.float32)
    if method == "from_2_way_softmax":  # one logit: yes - no (sigmoid = the 2-way softmax's "yes")
        if len(ids) != 2:
            raise PoolingModelError(f"{where}: from_2_way_softmax needs 2 classifier_from_token, got {tokens}")
        return rows[1:2] - rows[0:1], None
    return rows, None  # no_post_processing (or no method): one logit per token


def build_pooler(vllm_config, kind: str, model_type: str, weights: dict[str, np.ndarray], head_rows=None):
    """vLLM's DispatchPooler for this checkpoint (see the module docstring);
    `weights`: the checkpoint's tensors outside the encoder/decoder (head)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.pooler import DispatchPooler

    model_config = vllm_config.model_config
    pooler_config = model_config.pooler_config
    dtype = model_config.head_dtype
    where = model_config.model
    with set_current_vllm_config(vllm_config):
        if kind == "embed":
            return DispatchPooler.for_embedding(pooler_config)
        if model_type not in ENCODERS:  # a decoder family
            weight, bias = decoder_score_weight(model_config, weights, head_rows)
            return DispatchPooler.for_seq_cls(pooler_config, classifier=_linear(weight, bias, dtype))
        if model_type == "bert":
            from vllm.model_executor.models.bert import BertPooler

            pooling = BertPooler(model_config)
            pooling.dense = _linear(_take(weights, "pooler.dense.weight", where),
                                    _take(weights, "pooler.dense.bias", where), dtype)
            classifier = _linear(_take(weights, "classifier.weight", where),
                                 _take(weights, "classifier.bias", where), dtype)
            return DispatchPooler.for_seq_cls(pooler_config, pooling=pooling, classifier=classifier)
        if model_type == "modernbert":
            from vllm.model_executor.models.modernbert import ModernBertPooler

            pooling = ModernBertPooler(model_config)
            pooling.dense = _linear(_take(weights, "head.dense.weight", where), weights.get("head.dense.bias"),
                                    dtype)
            with torch.no_grad():
                pooling.norm.weight.copy_(torch.from_numpy(_take(weights, "head.norm.weight", where)))
                if pooling.norm.bias is not None:
                    pooling.norm.bias.copy_(torch.from_numpy(_take(weights, "head.norm.bias", where)))
            classifier = _linear(_take(weights, "classifier.weight", where), weights.get("classifier.bias"), dtype)
            return DispatchPooler.for_seq_cls(pooler_config, pooling=pooling.eval(), classifier=classifier)
        from vllm.model_executor.models.roberta import RobertaClassificationHead

        head = RobertaClassificationHead(model_config)
        head.dense = _linear(_take(weights, "classifier.dense.weight", where),
                             _take(weights, "classifier.dense.bias", where), dtype)
        head.out_proj = _linear(_take(weights, "classifier.out_proj.weight", where),
                                _take(weights, "classifier.out_proj.bias", where), dtype)
        return DispatchPooler.for_seq_cls(pooler_config, classifier=head.eval())
