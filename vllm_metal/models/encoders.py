"""Encoder-only checkpoints (served with `--runner pooling`): which model
types, how a Hugging Face directory loads into the MLX modules, and one
packed step through them.

The encoder's own tensors go to the MLX module; whatever else the
checkpoint holds (a BERT pooler's dense layer, a classifier) is kept as
`head_weights` for the pooling head (pooling/heads.py). A checkpoint that
is pickle-only, misses a tensor, or carries tensors the model does not
define is refused naming the file or tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from vllm_metal.native import ops  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from vllm_metal.models.bert import BertEncoder, EncoderBatch, bert_weights  # noqa: E402
from vllm_metal.models.modernbert import ModernBertEncoder, modernbert_weights  # noqa: E402


@dataclass(frozen=True)
class EncoderFamily:
    notes: str
    prefixes: tuple[str, ...]  # the encoder's name prefix in *For... checkpoints
    position_offset: str | None = None  # config field whose value + 1 starts the positions (RoBERTa)
    architectures: tuple[str, ...] = ()  # (embedding model, sequence classifier) as checkpoints name them


ENCODERS: dict[str, EncoderFamily] = {
    "bert": EncoderFamily("absolute positions, token types (cross-encoder pairs), post-norm layers",
                          ("bert.",), architectures=("BertModel", "BertForSequenceClassification")),
    "roberta": EncoderFamily("positions start after the pad id", ("roberta.",), position_offset="pad_token_id",
                             architectures=("RobertaModel", "RobertaForSequenceClassification")),
    "xlm-roberta": EncoderFamily("RoBERTa's layout (BGE-M3's dense vectors)", ("roberta.",),
                                 position_offset="pad_token_id",
                                 architectures=("XLMRobertaModel", "XLMRobertaForSequenceClassification")),
    "modernbert": EncoderFamily("pre-norm, RoPE with global and local bases, local layers in a +-window, GeGLU",
                                ("model.",), architectures=("ModernBertModel", "ModernBertForSequenceClassification")),
}


def markdown_table() -> str:
    """docs/models.md's pooling table (regenerate: python -m vllm_metal.models.encoders)."""
    lines = ["| model_type | architectures | attention | served as | what its tests exercise |",
             "|---|---|---|---|---|"]
    for name in sorted(ENCODERS):
        f = ENCODERS[name]
        lines.append(f"| `{name}` | {', '.join(f'`{a}`' for a in f.architectures)} | bidirectional, no KV cache "
                     f"| embedder, classifier / cross-encoder | {f.notes} |")
    lines.append("| every decoder family above | `*ForCausalLM` with `--convert embed` / `--convert classify`, "
                 "`*ForSequenceClassification`, the bare decoder (`*Model` weights, as Qwen3-Embedding ships) "
                 "| causal, paged KV cache for prompts in flight | embedder (last-token pooling), classifier, "
                 "reranker (`classifier_from_token`) | each family's last-token vectors vs mlx-lm's forward, "
                 "in 16-token chunks |")
    return "\n".join(lines)


def is_encoder(model_type: str | None) -> bool:
    return model_type in ENCODERS


@dataclass
class EncoderModel:
    """A loaded encoder: `forward` maps a packed step of whole prompts to
    final hidden states; `head_weights` are the checkpoint's other tensors."""

    module: BertEncoder | ModernBertEncoder
    config: dict
    dtype: mx.Dtype
    model_type: str
    weights_bytes: int
    head_weights: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def hidden_size(self) -> int:
        return self.config["hidden_size"]

    @property
    def max_positions(self) -> int:
        """Longest prompt the position table covers (after RoBERTa's offset)."""
        return self.config["max_position_embeddings"] - self.module.position_offset

    @property
    def computes_rows_only(self) -> bool:
        """Whether forward(keep=...) exists: BERT-style layers (attention
        with no window, so a kept row's result does not depend on which rows
        are queried); ModernBERT's local layers have windows."""
        return isinstance(self.module, BertEncoder)

    def forward(self, token_ids: np.ndarray, cu_seqlens: np.ndarray,
                token_type_ids: np.ndarray | None = None, keep: np.ndarray | None = None) -> mx.array:
        """Packed whole prompts (int32 [tokens]; row s = tokens cu[s]:cu[s+1])
        -> lazy float32 [tokens, hidden]; with `keep` (one packed row per
        prompt; computes_rows_only models) float32 [prompts, hidden] of
        those rows, the last layer computed for them only."""
        lens = np.diff(cu_seqlens)
        positions = np.arange(int(cu_seqlens[-1]), dtype=np.int32) - np.repeat(cu_seqlens[:-1], lens)
        if int(lens.max()) > self.max_positions:
            raise ValueError(f"a prompt of {int(lens.max())} tokens is longer than the {self.max_positions} "
                             f"positions of {self.model_type}")
        types = None
        if token_type_ids is not None and self.module.type_vocab_size > 1:
            types = mx.array(token_type_ids.astype(np.int32))
        if keep is not None and (not self.computes_rows_only or len(keep) != len(lens)):
            raise ValueError(f"keep: one row per prompt of a BERT-style encoder ({self.model_type}, "
                             f"{len(lens)} prompts, {len(keep)} rows)")
        rows = mx.array(np.asarray(keep, np.int32)) if keep is not None else None
        h = self.module(mx.array(token_ids), mx.array(positions.astype(np.int32)), types, EncoderBatch(cu_seqlens),
                        **({"keep": rows} if rows is not None else {}))
        return h.astype(mx.float32)


def load_encoder(model_dir: str | Path, dtype: mx.Dtype = mx.float32) -> EncoderModel:
    path = Path(model_dir)
    config = json.loads((path / "config.json").read_text())
    model_type = config.get("model_type")
    family = ENCODERS.get(model_type)
    if family is None:
        raise NotImplementedError(f"encoder model type {model_type!r} is not served by vllm-metal "
                                  f"(served encoders: {', '.join(sorted(ENCODERS))})")
    kind = config.get("position_embedding_type", "absolute")
    if model_type != "modernbert" and kind != "absolute":
        raise NotImplementedError(f"{path}: position_embedding_type {kind!r} is not served (absolute positions "
                                  "only; Jina's rotary XLM-R variant is not)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        names = ", ".join(p.name for p in path.glob("*.bin")) or "none"
        raise ValueError(f"{path}: no *.safetensors weights (found: {names}); save the checkpoint with "
                         "safetensors (transformers' save_pretrained does by default)")
    hf: dict[str, mx.array] = {}
    for f in files:
        try:
            hf.update(mx.load(str(f)))
        except Exception as e:  # noqa: BLE001 -- a corrupt file: named
            raise ValueError(f"{f}: cannot read the safetensors file: {e}") from e
    for prefix in family.prefixes:
        hf = {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in hf.items()}
    try:
        if model_type == "modernbert":
            module = ModernBertEncoder(config)
            weights = modernbert_weights(hf, config["num_hidden_layers"])
        else:
            offset = config.get(family.position_offset, 0) + 1 if family.position_offset else 0
            module = BertEncoder(config, position_offset=offset)
            weights = bert_weights(hf, config["num_hidden_layers"])
            if "token_type_embeddings.weight" not in weights:
                weights["token_type_embeddings.weight"] = mx.zeros(module.token_type_embeddings.weight.shape)
    except KeyError as e:
        raise ValueError(f"{path}: the {model_type} checkpoint has no tensor {e.args[0]!r}") from e
    for name, w in weights.items():
        bad = not mx.all(mx.isfinite(w)).item()
        if bad:
            raise ValueError(f"{path}: tensor for {name} holds non-finite values")
    module.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=True)
    mx.eval(module.parameters())
    used = {k for k in hf if k.startswith(("embeddings.", "encoder.", "layers.", "final_norm."))}
    head = {k: np.array(v.astype(mx.float32)) for k, v in hf.items() if k not in used}
    nbytes = sum(v.nbytes for v in weights.values())
    return EncoderModel(module=module, config=config, dtype=dtype, model_type=model_type,
                        weights_bytes=nbytes, head_weights=head)


if __name__ == "__main__":
    print(markdown_table())
