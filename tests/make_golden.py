"""Writes golden_tokens.json: mlx-lm's own greedy generation on the embedded
model (weights expanded to float32, contiguous KV cache), for the golden test.

    python tests/make_golden.py      # regenerate after changing the model
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_metal.native import ops  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Once upon a time,",
    "def fibonacci(n):",
    "List three colors:",
    "Explain photosynthesis in simple terms. Photosynthesis is the process",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "In 1492, Columbus " + "sailed the ocean blue and " * 20,
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate: " * 30,
]
NUM_TOKENS = 32


def mlx_lm_greedy(model_dir: str, prompt_ids: list[list[int]], num_tokens: int = NUM_TOKENS):
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import dequantize_model, load_model

    model, _ = load_model(Path(model_dir))
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    result = []
    for ids in prompt_ids:
        steps = generate_step(mx.array(ids), model, max_tokens=num_tokens,
                              sampler=lambda logits: mx.argmax(logits, axis=-1))
        result.append([int(token) for token, _ in steps])
    return result


def main():
    from transformers import AutoTokenizer

    import tempfile

    from vllm_metal.formats.default_model import ensure_default_model, export_mlx

    model_dir = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    with tempfile.TemporaryDirectory() as tmp:  # mlx-lm's own loader reads the MLX format
        outputs = mlx_lm_greedy(export_mlx(model_dir, tmp), prompt_ids)
    golden = [dict(prompt=p, prompt_ids=i, greedy_ids=o) for p, i, o in zip(PROMPTS, prompt_ids, outputs)]
    (Path(__file__).parent / "golden_tokens.json").write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    main()
