"""docs/models.md's table of real checkpoints: the generated block is the
renderer's output, every checkpoint is served, and a row checked by hand."""

from __future__ import annotations

from vllm_metal.doctor import checkpoint_table
from vllm_metal.models.registry import SERVED

GiB = 1 << 30


def test_docs_block_is_the_renderers_output():
    assert checkpoint_table.block() == checkpoint_table.render(), \
        "regenerate: python -m vllm_metal.doctor.checkpoint_table"


def test_the_checkpoints():
    entries = checkpoint_table.checkpoints()
    ids = [table["hub_id"] for table, _ in entries]
    assert len(ids) == len(set(ids))
    assert all(config["model_type"] in SERVED for _, config in entries)
    # the served families a Mac user most often brings, and each format
    assert {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3", "gemma3_text", "phi3"} <= \
        {config["model_type"] for _, config in entries}
    assert any(table.get("quant") == "q4_k_m" for table, _ in entries)
    assert any((config.get("quantization_config") or {}).get("quant_method") == "awq" for _, config in entries)


def test_a_row_by_hand():
    """Meta-Llama-3.1-8B-Instruct, MLX 4-bit group 64: every matrix quantized
    (4 bits + a bfloat16 scale and bias per 64), the norms in bfloat16; 32
    layers of 8 KV heads of 128: 128 KiB of K/V a token."""
    table, config = next(e for e in checkpoint_table.checkpoints()
                         if e[0]["hub_id"] == "mlx-community/Meta-Llama-3.1-8B-Instruct-4bit")
    quantized = 2 * 128256 * 4096 + 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)
    norms = 32 * 2 * 4096 + 4096
    metal = quantized // 2 + quantized // 64 * 4 + norms * 2
    cpu = (quantized + norms) * 2
    kv = 32768 * 32 * 2 * 8 * 128 * 2
    line, notes = checkpoint_table.row(table, config)
    assert line == (f"| `mlx-community/Meta-Llama-3.1-8B-Instruct-4bit` | `llama` (served) | MLX affine 4-bit, group 64 "
                    f"| {(quantized + norms) / 1e9:.2f} B | {metal / GiB:.2f} | {cpu / GiB:.2f} (bfloat16) | "
                    f"{kv / GiB:.2f} (32k, bfloat16) | {(metal + kv) / GiB:.2f} |")
    assert notes == []


def test_memory_docs_example_is_the_refusal():
    """docs/memory.md's refusal is the message the check gives for its example."""
    from pathlib import Path

    from vllm_metal.models.footprint import footprint
    from vllm_metal.native import fit

    table, config = next(e for e in checkpoint_table.checkpoints()
                         if e[0]["hub_id"] == "mlx-community/Meta-Llama-3.1-8B-Instruct-4bit")
    fp = footprint(config, device="gpu")
    result = fit.check(fp.packed, fp.layers, fp.plan(131072), fit.Device("gpu", 16 * GiB, 0.92),
                       label=table["hub_id"], weights_note=f"{fp.quant}, kept packed, the rest in {fp.dtype}",
                       smaller_weights=fp.four_bit, packed_weights=fp.packed)
    doc = (Path(checkpoint_table.__file__).parents[2] / "docs" / "memory.md").read_text()
    shown = doc.split("```\nValueError: ")[1].split("```")[0]
    assert " ".join(shown.split()) == result.message
