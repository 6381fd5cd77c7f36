"""A draft model made from the target by keeping some of its layers (self-speculative
decoding by layer skipping, as in Zhang et al. 2023, "Draft & Verify"): the target's
embedding, final norm and head with a subset of its decoder layers, renumbered.

SmolLM2-135M is the smallest model of its family and the Hugging Face Hub is out of
reach here, so the speculative benchmark's draft-model runs (bench_speculative.py
--draft) use this: the same vocabulary by construction, any mlx-lm / vLLM loader
reads it, and its acceptance is measured, not assumed.

    python benchmarks/layer_skip_draft.py TARGET_DIR OUT_DIR --layers 0-5,26-29
"""

from __future__ import annotations

import argparse
import json
import zlib
import shutil
from pathlib import Path

COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
          "vocab.json", "merges.txt")


def parse_layers(spec: str) -> list[int]:
    """'0-5,26-29' -> [0, 1, 2, 3, 4, 5, 26, 27, 28, 29]."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    if not out or sorted(set(out)) != out:
        raise ValueError(f"layers {spec!r}: give increasing, distinct layer indices")
    return out


def make_draft(target: Path, out: Path, layers: list[int]) -> Path:
    """OUT: TARGET with only `layers` (renumbered 0..n-1); rebuilt when the layer list changes."""
    import mlx.core as mx

    stamp = out / "draft_stamp.json"
    text = (target / "config.json").read_text()
    want = {"target": str(target), "layers": layers, "config": zlib.crc32(text.encode())}  # a rebuilt target too
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return out
    config = json.loads(text)
    if layers[-1] >= config["num_hidden_layers"]:
        raise ValueError(f"layer {layers[-1]} is past the target's {config['num_hidden_layers']} layers")
    weights: dict = {}
    for f in sorted(target.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    new_index = {old: new for new, old in enumerate(layers)}
    kept = {}
    for name, value in weights.items():
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            if i not in new_index:
                continue
            name = ".".join(["model", "layers", str(new_index[i]), *name.split(".")[3:]])
        kept[name] = value
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), kept, metadata={"format": "mlx"})
    config["num_hidden_layers"] = len(layers)
    config.pop("num_nextn_predict_layers", None)  # a target's MTP layer (model.layers.{n}) is not kept
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in COPIED:
        if (target / name).exists():
            shutil.copy(target / name, out / name)
    stamp.write_text(json.dumps(want))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", required=True)
    args = ap.parse_args()
    print(make_draft(args.target, args.out, parse_layers(args.layers)))


if __name__ == "__main__":
    main()
