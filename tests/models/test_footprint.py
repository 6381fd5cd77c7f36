"""doctor/footprint.py: a checkpoint's memory from its config alone. Against
hand computations on tiny configs written here, llama.cpp's published file
size for a real GGUF, and, for every served family, the bytes and caches of
the same model really loaded from its files."""

from __future__ import annotations

import json

import pytest
from families import FAMILIES, build

from vllm_metal.models.footprint import DTYPE_BYTES, footprint, layer_caches, serving_dtype, use_more_bits
from vllm_metal.models.registry import quant_format

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
        "vocab_size": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "max_position_embeddings": 4096}
# Its matrices: embedding and head 1024 x 256; per layer q, o 256 x 256, k, v 128 x 256,
# gate, up 512 x 256, down 256 x 512. Norms: two per layer and the final one, 256 each.
DECODER = 2 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 512 * 256)
EDGES = 2 * 1024 * 256
NORMS = 2 * 2 * 256 + 256


def test_quantized_weights_packed_on_metal_expanded_on_cpu():
    config = {**TINY, "quantization": {"group_size": 64, "bits": 4}}
    quantized = DECODER + EDGES
    gpu = footprint(config, device="gpu")
    assert gpu.served and gpu.dtype == "bfloat16" and gpu.params == quantized + NORMS
    # 4 bits a weight, a bfloat16 scale and bias per 64, the norms in bfloat16
    assert gpu.packed == quantized // 2 + (quantized // 64) * 2 * 2 + NORMS * 2
    # the CPU device serves a bfloat16 checkpoint in bfloat16: expanded to it
    cpu = footprint(config, device="cpu")
    assert cpu.dtype == "bfloat16" and cpu.expanded == (quantized + NORMS) * 2
    # a float32 checkpoint: float32 on the CPU device, bfloat16 on Metal (vLLM's "auto")
    f32 = {**config, "torch_dtype": "float32"}
    assert footprint(f32, device="cpu").expanded == (quantized + NORMS) * 4
    assert footprint(f32, device="gpu").dtype == "bfloat16"
    # float: both the same
    plain = footprint(TINY, device="gpu")
    assert plain.packed == plain.expanded == (quantized + NORMS) * 2
    # a requested quantization: 8-bit, group 64
    assert footprint(TINY, device="gpu", quant="8bit").packed == quantized + (quantized // 64) * 4 + NORMS * 2
    with pytest.raises(ValueError, match="--quant"):
        footprint(TINY, quant="2.5bit")


def test_kv_layers_and_windows():
    config = {**TINY, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 128}
    fp = footprint(config)
    assert [(c.kv_heads, c.head_dim, c.window) for c in fp.layers] == [(2, 64, 128), (2, 64, None)]
    assert fp.windows == [128] and not fp.hybrid
    # On Metal and on MLX's CPU device alike the platform leaves vLLM's hybrid manager on for it:
    # the windowed layer holds cdiv(min(window - 1 + in flight, length), block) + 1 blocks.
    cpu = footprint(config, device="cpu")
    assert cpu.hybrid_manager and fp.hybrid_manager
    window_blocks = -(-(128 - 1 + 2 * 2048) // 16) + 1
    for f in (fp, cpu):
        row = 2 * 2 * 64 * DTYPE_BYTES[f.dtype]  # K and V x 2 heads x 64
        assert f.kv_bytes(32768) == row * (32768 + window_blocks * 16)
    # An 8-bit cache keeps its windows planned as full (no in-place 8-bit write to share arrays with).
    assert fp.kv_bytes(32768, "fp8") == 2 * 2 * 2 * 64 * 32768
    # With the manager off (--disable-hybrid-kv-cache-manager) vLLM plans the windowed layer as full
    # beside a full one: 2 layers x K, V x 2 heads x 64.
    assert fp.kv_bytes(32768, hybrid_manager=False) == 2 * 2 * 2 * 64 * 2 * 32768
    assert fp.kv_bytes(32768, "fp8", hybrid_manager=False) == 2 * 2 * 2 * 64 * 32768


def test_awq_keeps_embedding_and_head_in_float():
    config = {**TINY, "torch_dtype": "float16",
              "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm",
                                      "zero_point": True}}
    fp = footprint(config)
    assert fp.dtype == "float16" and fp.quant.startswith("AWQ 4-bit, group 64")
    assert fp.packed == DECODER // 2 + (DECODER // 64) * 4 + (EDGES + NORMS) * 2


def test_tied_head_is_not_counted():
    """gemma3_text builds an LM head and drops it when the checkpoint has none."""
    config = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 1000,
              "sliding_window": 32, "sliding_window_pattern": 2, "torch_dtype": "bfloat16"}
    layer = 64 * 64 * 2 + 32 * 64 * 2 + 3 * 128 * 64 + 4 * 64 + 2 * 16  # q, o; k, v; MLP; 4 norms; q/k norms
    fp = footprint(config)
    assert fp.params == 1000 * 64 + 2 * layer + 64
    assert [c.window for c in fp.layers] == [32, None]


def test_unserved_family_is_named():
    fp = footprint({"model_type": "falcon_h1", "hidden_size": 64})
    assert not fp.served and "'falcon_h1' is not served" in fp.reason and fp.layers == []


def test_serving_dtype():
    assert serving_dtype({"torch_dtype": "float16"}, "gpu") == "float16"
    assert serving_dtype({"torch_dtype": "float32"}, "gpu") == "bfloat16"
    assert serving_dtype({}, "cpu") == "float32"
    assert serving_dtype({"text_config": {"dtype": "bfloat16"}}, "cpu") == "bfloat16"
    assert serving_dtype({"torch_dtype": "bfloat16"}, "cpu", "float32") == "float32"


QWEN3_8B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000, "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}


def test_gguf_q4_k_m_as_llama_cpp_writes_it_and_vllm_metal_loads_it():
    """Qwen3-8B-Q4_K_M.gguf (Qwen/Qwen3-8B-GGUF, 5.03 GB as published): the
    head Q6_K, attn_v and ffn_down Q6_K on llama.cpp's use_more_bits layers,
    the rest Q4_K; norms F32. Loaded: Q4_K as MLX 4-bit and Q6_K as 8-bit,
    groups of 32 with bfloat16 scales and biases."""
    assert [i for i in range(36) if use_more_bits(i, 36)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30,
                                                               31, 32, 33, 34, 35]
    embed, q, kv, mlp = 151936 * 4096, 4096 * 4096, 1024 * 4096, 12288 * 4096
    more = 18  # layers whose v and down are Q6_K
    q4k = embed + 36 * (2 * q + kv + 2 * mlp) + (36 - more) * (kv + mlp)
    q6k = embed + more * (kv + mlp)
    norms = 36 * (2 * 4096 + 2 * 128) + 4096
    file_bytes = q4k * 144 // 256 + q6k * 210 // 256 + norms * 4  # GGML block sizes: 144 and 210 bytes / 256
    assert abs(file_bytes / 5.03e9 - 1) < 0.005
    fp = footprint(QWEN3_8B, device="gpu", quant="q4_k_m")
    assert fp.params == q4k + q6k + norms
    assert fp.packed == q4k // 2 + q4k // 32 * 4 + q6k + q6k // 32 * 4 + norms * 2


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_as_really_loaded(model_type, model_dir, tmp_path):
    """The same tiny model written to files and loaded by the loader (lazily):
    the weights' bytes kept quantized in bfloat16 and expanded in float32,
    and every layer's cache, are the footprint's."""
    from vllm_metal.models.loader import load_model

    bits, group, mixed = quant_format(model_type)
    for quantized in (False, True):
        path = build(model_type, tmp_path / str(quantized), model_dir, bits=bits if quantized else None,
                     group_size=group, mixed=mixed)
        config = json.loads((tmp_path / str(quantized) / "config.json").read_text())
        for dtype, expand in (("bfloat16", False), ("float32", True)):
            loaded = load_model(path, dtype=dtype, dequantize=expand, materialize=False)
            fp = footprint(config, dtype=dtype)
            assert fp.weights(expand) == loaded.weights_bytes, (model_type, quantized, dtype)
            assert fp.layers == layer_caches(loaded), (model_type, quantized)
