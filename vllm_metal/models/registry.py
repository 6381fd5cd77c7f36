"""Which mlx-lm model families vllm-metal serves: only those a parity test
proves against mlx-lm's own forward (tests/plugin/test_model_families.py).

A family outside this table may load and answer -- silently wrong where its
mlx-lm code adds what the paged adapter does not reproduce (logit softcaps,
logit scaling, per-layer sliding windows, extra norms). So it is refused at
load, with the family named and the served ones listed, never served on trust.
"""

from __future__ import annotations

# model_type -> what the parity test covers.
SERVED: dict[str, str] = {
    "llama": "float32, bfloat16, float16, MLX 4-bit (the embedded SmolLM2); linear / llama3 / yarn "
             "RoPE pass the per-token position probe, dynamic-NTK RoPE is refused",
    "mistral": "float32",
    "qwen2": "float32, q/k/v biases",
    "qwen3": "float32, q/k norms",
}


class UnservedModelError(NotImplementedError):
    pass


def check_served(model_type: str | None) -> None:
    if model_type in SERVED:
        return
    raise UnservedModelError(
        f"model type {model_type!r} is not served by vllm-metal yet: no parity test proves the paged "
        f"path against mlx-lm for it, and serving it unproven risks silently wrong answers (a dropped "
        f"softcap, logit scale or sliding window). Served: {', '.join(sorted(SERVED))}.")
