"""Writes a float32 Hugging Face checkpoint dequantized from an MLX-quantized model dir.

vLLM's CPU backend cannot load MLX-quantized safetensors, so every system in the
serving benchmark is served this one float32 copy: the same weights everywhere.
For llama, mlx-lm's parameter names are transformers' LlamaForCausalLM names, so
the dequantized tensors are saved as they are. The output carries a stamp (source
weights hash + converter version) and is only rebuilt when that changes.

    python benchmarks/convert_fp32.py SRC_DIR OUT_DIR [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

CONVERTER_VERSION = 1
STAMP_FILE = "fp32_stamp.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "tokenizer.model")


def _weights_digest(src: Path) -> str:
    h = hashlib.sha256()
    for path in sorted([*src.glob("*.safetensors"), *src.glob("*.gguf")]):
        h.update(path.name.encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


def fp32_config(config: dict) -> dict:
    """The source config without quantization, declaring float32."""
    out = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    out["torch_dtype"] = "float32"
    out.pop("dtype", None)
    return out


def convert(src: Path, out: Path, force: bool = False) -> Path:
    """Dequantizes `src` into `out` (if stale) and returns `out`."""
    src, out = Path(src), Path(out)
    stamp = {"converter_version": CONVERTER_VERSION, "source": str(src.resolve()),
             "source_weights_sha256": _weights_digest(src)}
    stamp_path = out / STAMP_FILE
    if not force and stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        return out

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model, load_model

    from vllm_metal.formats.checkpoint import build_model, open_checkpoint

    checkpoint = open_checkpoint(src)  # an MLX directory, or the default model's GGUF
    model = load_model(src, lazy=False)[0] if checkpoint.native else build_model(checkpoint)[0]
    model = dequantize_model(model)
    weights = {name: value.astype(mx.float32) for name, value in tree_flatten(model.parameters())}
    mx.eval(weights)

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps(fp32_config(config), indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, tmp / name)
    (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="MLX model directory (e.g. `python -m vllm_metal.formats.default_model`)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    print(convert(args.src, args.out, args.force))


if __name__ == "__main__":
    sys.exit(main())
