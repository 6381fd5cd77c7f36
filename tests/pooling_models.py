"""Tiny random-weight pooling checkpoints built with transformers' own
classes (save_pretrained), offline tokenizers, and float64 torch references
of the same weights (the pooling tests' independent reference).

- BERT / XLM-RoBERTa / ModernBERT encoders, as embedders with sentence-
  transformers pooling configs (modules.json, 1_Pooling, 2_Normalize) and
  as sequence classifiers (cross-encoders), with a WordPiece tokenizer built
  with `tokenizers` (pairs get token types 0 / 1, as BERT's do).
- Qwen3 decoders: an embedder saved as Qwen3-Embedding is (the bare
  Qwen3Model, architectures Qwen3ForCausalLM, last-token pooling), a
  Qwen3ForSequenceClassification classifier, and a causal LM served as a
  Qwen3-Reranker (yes/no logits through hf_overrides), with the embedded
  SmolLM2 tokenizer.

Weights are drawn wider than transformers' init (unit-variance
activations, classifier heads 4x) so that different texts give clearly
different vectors and scores.
"""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import numpy as np
import torch

WORDS = ("the a an of to and in is it that for on with as was at by be this are from or have not but what all "
         "were when we there can your which their if do will each about how up out them then she many some so "
         "these would other into has more her two like him see time could no make than first been its who now "
         "people my made over did down only way find use may water long little very after words called just "
         "where most know get through back much before go good new write our used me man too any day same right "
         "look think also around another came come work three word must because does part even place well such "
         "here take why things help put years different away again off went old number great tell men say small "
         "every found still between name should home big give air line set own under read last never us left end "
         "along while might next sound below saw something thought both few those always looked show large often "
         "together asked house world going want school important until form food keep children feet land side "
         "without boy once animals life enough took sometimes four head above kind began almost live page got "
         "earth need far hand high year mother light parts country father let night following picture being study "
         "second eyes soon times story boys since white days ever paper hard near sentence better best across "
         "during today others however sure means knew try told young miles sun ways thing whole hear example heard "
         "several change answer room sea against top turned learn point city play toward five using himself "
         "usually money seen car morning given yes").split()

# Texts every test draws from: different lengths, shared words (similar, not equal, vectors).
TEXTS = ["the sun is white and the sea is blue",
         "a boy saw the car",
         "what is the capital of the country where people speak many words",
         "water",
         "the mother and father asked the children to keep the house",
         "animals need food water and air to live on the earth"]


def bert_tokenizer(out: Path) -> Path:
    """A WordPiece tokenizer of ~380 tokens, saved as transformers loads it."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    # id 1 is never produced: RoBERTa's pad id, whose positions HF's reference counts from.
    specials = ["[PAD]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = specials + list(string.ascii_lowercase) + list(string.punctuation) + \
        ["##" + c for c in string.ascii_lowercase] + list(dict.fromkeys(WORDS))
    vocab = {t: i for i, t in enumerate(pieces)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 3), ("[SEP]", 4)])
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                                   cls_token="[CLS]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    fast.save_pretrained(str(out))
    return out


def _scale(model: torch.nn.Module, seed: int) -> None:
    """Matrices drawn at std 1 / sqrt(fan_in) (unit-ish activations; heads
    4x), norms and biases near their defaults."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                # heads 4x wider: scores spread well apart (rankings are then well defined)
                wide = 4.0 if name.startswith(("classifier", "score")) else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * (wide / np.sqrt(p.shape[-1])))
            elif "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1 + 0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def sentence_transformers_files(out: Path, pooling: str, normalize: bool, dim: int) -> None:
    """modules.json (+ 1_Pooling/config.json, 2_Normalize) as sentence-transformers saves them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir(exist_ok=True)
    modes = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken"}
    config = {"word_embedding_dimension": dim, **{v: k == pooling for k, v in modes.items()}}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(config))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))


ENCODER_CLASSES = {
    # model_type: (config class, embedding model class, classifier class, extra config)
    "bert": ("BertConfig", "BertModel", "BertForSequenceClassification", {}),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", "XLMRobertaForSequenceClassification",
                    {"pad_token_id": 1, "bos_token_id": 3, "eos_token_id": 4, "type_vocab_size": 1,
                     "max_position_embeddings": 130}),  # 128 positions after the pad id, as XLM-R's 514 = 512 + 2
    # local windows of +-4 tokens, every second layer global: the windows matter in these texts
    "modernbert": ("ModernBertConfig", "ModernBertModel", "ModernBertForSequenceClassification",
                   {"bos_token_id": 3, "eos_token_id": 4, "cls_token_id": 3, "sep_token_id": 4,
                    "local_attention": 8, "global_attn_every_n_layers": 2, "classifier_pooling": "mean"}),
}


def build_encoder(out: Path, model_type: str = "bert", kind: str = "embed", pooling: str | None = "mean",
                  normalize: bool = True, num_labels: int = 1, seed: int = 0, hidden: int = 64, layers: int = 3):
    """A tiny encoder checkpoint in `out` (tokenizer included); returns
    (path, the torch model in float64 for references)."""
    import transformers

    config_name, embed_name, cls_name, extra = ENCODER_CLASSES[model_type]
    out.mkdir(parents=True, exist_ok=True)
    bert_tokenizer(out)
    config = getattr(transformers, config_name)(
        vocab_size=400, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=2 * hidden, num_labels=num_labels, **{"pad_token_id": 0, "max_position_embeddings": 128, **extra})
    if kind == "embed":
        kwargs = {} if model_type == "modernbert" else {"add_pooling_layer": False}
        model = getattr(transformers, embed_name)(config, **kwargs)
    else:
        model = getattr(transformers, cls_name)(config)
    _scale(model, seed)
    model.eval().save_pretrained(str(out))
    if model_type == "xlm-roberta":  # as XLM-R checkpoints (BGE-M3's) state it; vLLM 0.33 reads it
        cfg = json.loads((out / "config.json").read_text())
        cfg["position_embedding_type"] = "absolute"
        (out / "config.json").write_text(json.dumps(cfg, indent=1))
    if kind == "embed" and pooling is not None:
        sentence_transformers_files(out, pooling, normalize, hidden)
    return str(out), model.double()


def build_qwen3(out: Path, tokenizer_dir: str, kind: str = "embed", num_labels: int = 1, seed: int = 0,
                st_pooling: bool = True, matryoshka: bool = False):
    """A tiny Qwen3 pooling checkpoint: kind "embed" (the bare decoder, as
    Qwen3-Embedding ships: last-token pooling, normalized), "classify"
    (Qwen3ForSequenceClassification), "causal" (a Qwen3ForCausalLM, for
    --convert or the reranker's hf_overrides). Returns (path, float64 torch model)."""
    import transformers

    config = transformers.Qwen3Config(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                      max_position_embeddings=512, tie_word_embeddings=kind != "classify",
                                      num_labels=num_labels, pad_token_id=0)
    cls = {"embed": "Qwen3Model", "classify": "Qwen3ForSequenceClassification", "causal": "Qwen3ForCausalLM"}[kind]
    model = getattr(transformers, cls)(config)
    _scale(model, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(str(out))
    cfg = json.loads((out / "config.json").read_text())
    if kind == "embed":
        cfg["architectures"] = ["Qwen3ForCausalLM"]  # as Qwen3-Embedding's config.json says
        if st_pooling:
            sentence_transformers_files(out, "last", True, 64)
    if matryoshka:
        cfg["is_matryoshka"] = True
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return str(out), model.double()


# ---- references ---------------------------------------------------------

def hidden_states(model, ids: list[int], token_type_ids: list[int] | None = None) -> torch.Tensor:
    """Final hidden states [len, hidden] of a float64 transformers model."""
    base = getattr(model, "base_model", model)
    kwargs = {"token_type_ids": torch.tensor([token_type_ids])} if token_type_ids is not None else {}
    with torch.no_grad():
        return base(torch.tensor([ids]), **kwargs).last_hidden_state[0]


def embedding(model, ids: list[int], pooling: str, normalize: bool = True, dims: int | None = None) -> np.ndarray:
    h = hidden_states(model, ids)
    v = {"cls": h[0], "mean": h.mean(0), "last": h[-1]}[pooling]
    if dims is not None:
        v = v[:dims]
    if normalize:
        v = v / v.norm()
    return v.numpy()


def classifier_logits(model, ids: list[int], token_type_ids: list[int] | None = None) -> np.ndarray:
    """The transformers classifier's own logits (last non-pad token for decoders)."""
    kwargs = {"token_type_ids": torch.tensor([token_type_ids])} if token_type_ids is not None else {}
    with torch.no_grad():
        return model(torch.tensor([ids]), **kwargs).logits[0].numpy()


def activate(logits: np.ndarray) -> np.ndarray:
    """vLLM's classify activation: sigmoid for one label, softmax otherwise."""
    if logits.shape[-1] == 1:
        return 1 / (1 + np.exp(-logits))
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
