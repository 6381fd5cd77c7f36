"""Random-weight models of realistic shapes for the benchmarks (the Hugging Face
Hub is unreachable here, so a benchmark that needs a bigger model than the
embedded SmolLM2 builds one): mlx-lm's own `Model` for a config, weights drawn
so activations stay unit-variance and logits are peaked (greedy decoding is
well defined), saved as an mlx-lm directory with the embedded tokenizer.

    python benchmarks/random_model.py llama-1gib OUT_DIR   # prints OUT_DIR

Timing a forward does not depend on the values of the weights; only the shapes
(and dtype / quantization) matter.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from vllm_metal.native import ops  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# SmolLM2's llama family with enough KV per token that a 32k-token prefix is
# 1 GiB of float32 K/V (4 layers x 8 KV heads x 128 x 2 x 4 bytes = 32 KiB a
# token), and as little attention compute as that allows (no GQA sharing).
SHAPES: dict[str, dict] = {
    # benchmarks/bench_overhead.py: a llama whose forward costs next to nothing
    # (4 layers of hidden 128; head_dim 32, the least vLLM's CPU backend runs),
    # with SmolLM2's 49k vocabulary, so what a step costs is the engine around it.
    "llama-tiny": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=4096, rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=True,
        vocab_size=49152, bos_token_id=1, eos_token_id=2, torch_dtype="float32"),
    # benchmarks/bench_overhead.py --shape llama-null: the serving ceiling, a llama whose forward
    # is as close to free as both engines allow (1 layer of hidden 32, one head of 32; the same
    # vocabulary and tokenizer, so detokenizing and streaming cost what they cost for any model):
    # what a step costs there is the engine, vLLM's API server and the client alone.
    "llama-null": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=4096, rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=True,
        vocab_size=49152, bos_token_id=1, eos_token_id=2, torch_dtype="float32"),
    # benchmarks/bench_pipeline.py: a llama of ~0.25B parameters (16 layers of
    # hidden 1024, GQA 16/4), about 1 GiB of float32 weights: one decode step
    # reads it all, so compute is far from negligible next to the links.
    "llama-pipeline": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=1024, intermediate_size=2816,
        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=True,
        vocab_size=49152, bos_token_id=1, eos_token_id=2, torch_dtype="float32"),
    "llama-1gib": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=1024, intermediate_size=2816,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=33024, rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=True,
        vocab_size=49152, bos_token_id=1, eos_token_id=2, torch_dtype="float32"),
    # A hybrid of Qwen3.5-0.8B's text shape (its published config: 24 layers,
    # every 4th full attention with 8 query / 2 KV heads of 256 and partial
    # RoPE, the others Gated DeltaNet with 16 key / 16 value heads of 128 and
    # a kernel-4 convolution; hidden 1024, dense MLP 3584, 248,320-token tied
    # vocabulary: ~0.75B parameters), built as mlx-lm's qwen3_next with no
    # experts, whose layers compute the same as Qwen3.5's (they differ only in
    # how the input projections are split).
    "hybrid-0.8b": dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=1024,
        intermediate_size=3584, num_hidden_layers=24, full_attention_interval=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=0, num_experts_per_tok=0, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=0, shared_expert_intermediate_size=0, norm_topk_prob=True, rms_norm_eps=1e-6,
        vocab_size=248320, rope_theta=1e7, rope_scaling=None, max_position_embeddings=32768,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, torch_dtype="float32"),
}


def build(config: dict, out: Path, tokenizer_dir: str, seed: int = 0) -> str:
    """Writes a random-weight model of `config` to `out` (once; an existing
    directory with the same config is reused); returns its path."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes

    out = Path(out)
    if (out / "config.json").exists() and json.loads((out / "config.json").read_text()) == config:
        return str(out)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(seed)
    params = {}
    for name, value in tree_flatten(model.parameters()):
        if value.ndim >= 2:  # matrices: unit-variance activations; peaked logits
            w = rng.standard_normal(value.shape, dtype=np.float32) / np.sqrt(value.shape[-1])
            params[name] = mx.array(w * (4.0 if "embed_tokens" in name or "lm_head" in name else 1.0))
        else:  # norms, biases, per-head constants: near their defaults
            params[name] = value + mx.array(0.05 * rng.standard_normal(value.shape).astype(np.float32))
    model.update(tree_unflatten(list(params.items())))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_dir) / name, out / name)
    (out / "config.json").write_text(json.dumps(config, indent=1))  # last: marks the directory complete
    return str(out)


def build_named(shape: str, out: Path) -> str:
    from vllm_metal.formats.default_model import ensure_default_model

    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")
    return build(SHAPES[shape], out, ensure_default_model())


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(build_named(sys.argv[1], Path(sys.argv[2])))
