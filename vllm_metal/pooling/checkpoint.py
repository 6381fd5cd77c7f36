"""How a checkpoint would be served as a pooling model, from its files
alone (config.json, sentence-transformers' modules.json / 1_Pooling): what
`vllm-metal doctor --model` says. Reads no weights."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_metal.pooling.serving_config import ENCODER_TYPES

# Pooling architectures with heads vLLM builds specially (token classifiers,
# multi-vector, sparse, masked-LM, reward): not served here.
SPECIAL = ("ColBERT", "Splade", "BgeM3", "ForTokenClassification", "ForMaskedLM", "Reward")


def st_pooling(path: Path) -> dict | None:
    """sentence-transformers' pooling mode and normalization, if the checkpoint has them."""
    try:
        modules = json.loads((path / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    pooling = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    mode = None
    if pooling is not None:
        try:
            cfg = json.loads((path / pooling.get("path", "") / "config.json").read_text())
        except (OSError, ValueError):
            cfg = {}
        names = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_lasttoken": "last", "pooling_mode_max_tokens": "max"}
        mode = cfg.get("pooling_mode") or next((v for k, v in names.items() if cfg.get(k)), None)
    return {"pooling": mode, "normalize": normalize}


def describe(model_dir: str | Path) -> dict:
    """{"kind": "embed" | "classify" | None, "served": bool, "how": words,
    "encoder": bool, "made_for_pooling": bool}."""
    path = Path(model_dir)
    config = json.loads((path / "config.json").read_text())
    arch = (config.get("architectures") or [""])[0]
    model_type = config.get("model_type")
    st = st_pooling(path)
    encoder = model_type in ENCODER_TYPES
    # made for pooling (a classifier, a sentence-transformers model), not a generator converted
    out = {"kind": None, "served": False, "encoder": encoder, "how": "",
           "made_for_pooling": arch.endswith("ForSequenceClassification") or st is not None}
    if any(s in arch for s in SPECIAL):
        out["how"] = f"{arch}: token classifiers, multi-vector and sparse heads are not served as pooling models"
        return out
    kind = "classify" if arch.endswith("ForSequenceClassification") else "embed"
    out["kind"] = kind
    st_words = (f"; sentence-transformers pooling {st['pooling']}" + (", normalized" if st["normalize"] else "")
                if st else "")
    if encoder:
        problems = []
        if config.get("position_embedding_type", "absolute") != "absolute" and model_type != "modernbert":
            problems.append(f"position_embedding_type {config['position_embedding_type']!r}")
        from vllm_metal.models.bert import ACTIVATIONS

        act = config.get("hidden_activation" if model_type == "modernbert" else "hidden_act", "gelu")
        if act not in ACTIVATIONS:
            problems.append(f"activation {act!r}")
        if problems:
            out["how"] = f"encoder {model_type} with {', '.join(problems)} is not served"
            return out
        out.update(served=True, how=f"an encoder ({model_type}, bidirectional, no KV cache) served as "
                   f"{'a classifier / reranker' if kind == 'classify' else 'an embedding model'} "
                   f"(vLLM picks --runner pooling for {arch}){st_words}")
        return out
    if kind == "classify":
        labels = config.get("num_labels") or len(config.get("id2label") or {}) or "?"
        out.update(served=True, how=f"a decoder classifier / reranker ({labels} labels, the score head on the "
                   f"last token; vLLM picks --runner pooling for {arch})")
    elif st:
        out.update(served=True, how=f"an embedding model: serve with --runner pooling{st_words}")
    else:
        out.update(served=True, how="a generation model; also served as an embedder with --runner pooling "
                   "--convert embed (last-token pooling, normalized) or a classifier with --convert classify "
                   "(needs a score head or classifier_from_token in --hf-overrides)")
    return out
