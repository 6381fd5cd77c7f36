"""The error vllm-metal adds where a GGML type is re-quantized to MLX affine
(formats/gguf_quants.py REQUANT_BITS): relative RMS of (served - the file's
own values) over the file's values, per type, on 1M random valid blocks
(every quantization level equally likely: no encoder of ours decides the
data). Writes benchmarks/results/gguf/requant_loss.json; docs/checkpoints.md
quotes it, and REQUANT_LOSS in gguf_quants.py bounds it (tests check Q6_K).

    .venv/bin/python benchmarks/gguf_requant_loss.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_metal.native import ops  # noqa: E402,F401  (fast BLAS before mlx)

import gguf  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from vllm_metal.formats import gguf_quants  # noqa: E402

# Where a type keeps its float16 super-block scales: (offset from the start
# or, negative, from the end of the block, count).
F16_FIELDS = {"Q6_K": (-2, 1), "Q3_K": (-2, 1), "Q2_K": (-4, 2)}
VALUES = 1 << 20


def random_blocks(type_name: str, rng) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (VALUES // block, size), dtype=np.uint8)
    start, count = F16_FIELDS.get(type_name, (0, 1))
    start = start % size
    header = np.abs(rng.normal(0.01, 0.002, (len(raw), count))).astype(np.float16)
    raw[:, start:start + 2 * count] = header.view(np.uint8)
    return raw


def measure(type_name: str, rng) -> dict:
    raw = random_blocks(type_name, rng)
    rows = VALUES // 4096
    data = raw.reshape(rows, -1)
    values = gguf_quants.dequantize(data, type_name, (rows, 4096))
    finite = np.isfinite(values).all(axis=1) & (np.abs(values).max(axis=1) < 1e3)
    data, values = data[finite], values[finite]
    q, s, b = gguf_quants.requantize(data, type_name, values.shape)
    served = np.array(mx.dequantize(mx.array(q), mx.array(s), mx.array(b), group_size=gguf_quants.GROUP,
                                    bits=gguf_quants.REQUANT_BITS[type_name]))
    rel = float(np.sqrt(((served - values) ** 2).mean() / (values ** 2).mean()))
    return {"type": type_name, "mlx_bits": gguf_quants.REQUANT_BITS[type_name], "rows": int(finite.sum()),
            "relative_rms_error": rel, "bound": gguf_quants.REQUANT_LOSS[type_name]}


def main() -> None:
    rng = np.random.default_rng(0)
    results = [measure(t, rng) for t in sorted(gguf_quants.REQUANT_BITS)]
    out = Path(__file__).resolve().parent / "results" / "gguf" / "requant_loss.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    for r in results:
        flag = "" if r["relative_rms_error"] <= r["bound"] else "  OVER THE STATED BOUND"
        print(f"{r['type']:8} -> MLX {r['mlx_bits']}-bit: {100 * r['relative_rms_error']:.3f}% "
              f"(bound {100 * r['bound']:.2f}%){flag}")


if __name__ == "__main__":
    main()
