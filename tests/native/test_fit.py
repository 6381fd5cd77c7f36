"""native/fit.py: whether the weights and one request of --max-model-len fit,
against hand computations (the expected bytes are written out here, not taken
from the module)."""

from __future__ import annotations

import pytest

from vllm_metal.native import fit
from vllm_metal.native.memory import CPU_DEFAULT_KV_CAP_BYTES

GiB, MiB = 1 << 30, 1 << 20
# A Llama-3.1-8B-shaped cache: 32 layers of 8 KV heads of 128, bfloat16: K and V
# rows of 256 bytes each -> 4096 bytes a token per layer, 131072 over the layers.
PER_TOKEN = 32 * 2 * 8 * 128 * 2
NULL_BLOCK = 16 * PER_TOKEN  # vLLM's null block, one block id over every layer: 2 MiB


def llama_layers(window=None, n=32):
    return [fit.LayerCache(kv_heads=8, head_dim=128, window=window) for _ in range(n)]


def metal(total_gib, utilization=0.9, explicit=None):
    return fit.Device("gpu", int(total_gib * GiB), utilization, explicit)


def test_kv_bytes_of_full_attention_layers():
    plan = fit.Plan(max_model_len=32768)
    assert fit.kv_bytes(llama_layers(), plan) == 32768 * PER_TOKEN == 4 * GiB
    # a length that is not a whole block: rounded up to blocks of 16
    assert fit.kv_bytes(llama_layers(), plan, 1000) == 1008 * PER_TOKEN


def test_fits_and_does_not_fit_on_metal():
    # A 16 GiB working set (a 24 GB Mac), vLLM's 0.9, 8 GiB of weights: 6.4 GiB for the cache.
    available = int(0.9 * 16 * GiB) - 8 * GiB
    ok = fit.check(8 * GiB, llama_layers(), fit.Plan(max_model_len=32768), metal(16))
    assert ok.fits and ok.available == available and ok.kv_needed == 4 * GiB + NULL_BLOCK
    bad = fit.check(8 * GiB, llama_layers(), fit.Plan(max_model_len=65536), metal(16), label="llama-8b",
                    weights_note="MLX affine 4-bit, group 64, kept packed, the rest bfloat16")
    assert not bad.fits and bad.kv_needed == 8 * GiB + NULL_BLOCK
    longest = (available - NULL_BLOCK) // PER_TOKEN // 16 * 16  # whole blocks
    assert longest == 52400
    assert f"--max-model-len {longest} (the longest that fits)" in bad.fixes
    assert bad.message.startswith("vllm-metal: llama-8b does not fit: one request of --max-model-len 65536 needs "
                                  "8.00 GiB of KV cache (32 layers, --kv-cache-dtype auto), and "
                                  "--gpu-memory-utilization 0.90 x 16.00 GiB (Metal's recommended working set) = "
                                  "14.40 GiB, less 8.00 GiB of weights (MLX affine 4-bit, group 64, kept packed, the "
                                  "rest bfloat16), leaves 6.40 GiB. To serve it: --max-model-len 52400")
    # 8-bit K/V halve the cache: 4 GiB + a 1 MiB null block fit in 6.4 GiB
    assert "--kv-cache-dtype fp8 (8-bit: 4.00 GiB for --max-model-len 65536)" in bad.fixes
    # the longest that fits does fit, one block more does not
    assert fit.check(8 * GiB, llama_layers(), fit.Plan(max_model_len=longest), metal(16)).fits
    assert not fit.check(8 * GiB, llama_layers(), fit.Plan(max_model_len=longest + 16), metal(16)).fits


def test_gpu_memory_utilization_is_honoured_and_named():
    # 48 GiB working set (a 64 GB Mac), 8 GiB weights, 128k context: 16 GiB + the null block.
    plan = fit.Plan(max_model_len=131072)
    assert fit.kv_bytes(llama_layers(), plan) == 16 * GiB
    half = fit.check(8 * GiB, llama_layers(), plan, metal(48, 0.5))
    assert not half.fits and half.available == 24 * GiB - 8 * GiB
    # (8 GiB + 16 GiB + 2 MiB) / 48 GiB = 0.50004: the next hundredth
    assert "--gpu-memory-utilization 0.51" in half.fixes
    assert fit.check(8 * GiB, llama_layers(), plan, metal(48, 0.51)).fits
    assert fit.check(8 * GiB, llama_layers(), plan, metal(48, 0.9)).fits


def test_windowed_layers_sized_to_their_window():
    """A model whose every attention layer attends within 4096 tokens needs,
    for any length, window - 1 + the in-flight tokens rounded up to blocks,
    plus one block: so it fits at 128k where full layers would need 16 GiB."""
    plan = fit.Plan(max_model_len=131072, in_flight_tokens=2048)
    blocks = -(-(4096 - 1 + 2048) // 16) + 1  # cdiv(6143, 16) + 1 = 385
    assert blocks == 385
    assert fit.kv_bytes(llama_layers(window=4096), plan) == blocks * 16 * PER_TOKEN
    device = metal(16)
    assert fit.check(8 * GiB, llama_layers(window=4096), plan, device).fits
    assert not fit.check(8 * GiB, llama_layers(), plan, device).fits
    # Short contexts: min(window - 1 + in flight, max_model_len) tokens
    assert fit.kv_bytes(llama_layers(window=4096), fit.Plan(max_model_len=1000, in_flight_tokens=2048)) == \
        (63 + 1) * 16 * PER_TOKEN


def test_mixed_windows_are_planned_as_full_without_the_hybrid_manager():
    """A full-attention layer beside windowed ones (Gemma 3's pattern): with
    vLLM's hybrid KV-cache manager off (--disable-hybrid-kv-cache-manager;
    the platform leaves it on for sliding-window models, on Metal and MLX's
    CPU device alike) vLLM plans every layer as full attention."""
    layers = [fit.LayerCache(kv_heads=8, head_dim=128, window=None if i % 6 == 5 else 1024) for i in range(48)]
    per_layer = 2 * 8 * 128 * 2
    plan = fit.Plan(max_model_len=32768)
    assert not fit.windows_kept(layers, hybrid_manager=False)
    assert fit.kv_bytes(layers, plan) == 48 * 32768 * per_layer  # 12 GiB
    kept = fit.Plan(max_model_len=32768, hybrid_manager=True, in_flight_tokens=4096)
    window_blocks = -(-(1024 - 1 + 4096) // 16) + 1
    assert fit.kv_bytes(layers, kept) == 8 * 32768 * per_layer + 40 * window_blocks * 16 * per_layer
    assert fit.windows_kept([fit.LayerCache(kv_heads=1, head_dim=64, window=512)] * 3, hybrid_manager=False)


def test_explicit_kv_cache_memory_bytes_is_the_judge():
    plan = fit.Plan(max_model_len=65536)  # 8 GiB + the null block
    # utilization alone would leave 6.4 GiB; the user's 10 GiB is what vLLM gets
    assert fit.check(8 * GiB, llama_layers(), plan, metal(16, explicit=10 * GiB)).fits
    small = fit.check(8 * GiB, llama_layers(), plan, metal(64, explicit=GiB))
    assert not small.fits and small.available == GiB
    assert "--kv-cache-memory-bytes 1073741824 gives it 1.00 GiB" in small.message
    assert f"--max-model-len {(GiB - NULL_BLOCK) // PER_TOKEN // 16 * 16} (the longest that fits)" in small.fixes
    assert not any(f.startswith("--gpu-memory-utilization") for f in small.fixes)
    needed_mib = -(-(8 * GiB + NULL_BLOCK) // MiB) * MiB
    assert f"--kv-cache-memory-bytes {needed_mib} (8.00 GiB)" in small.fixes


def test_cpu_device_budget_is_capped():
    """On MLX's CPU device the cache gets at most CPU_DEFAULT_KV_CAP_BYTES
    unless --kv-cache-memory-bytes says otherwise; utilization cannot help."""
    cpu = fit.Device("cpu", 64 * GiB, 0.9)
    plan = fit.Plan(max_model_len=65536)
    r = fit.check(2 * GiB, llama_layers(), plan, cpu)
    assert not r.fits and r.available == CPU_DEFAULT_KV_CAP_BYTES == 4 * GiB
    assert "(the CPU device's default cap; --kv-cache-memory-bytes sets any size)" in r.message
    assert "RAM" in r.message
    assert not any(f.startswith("--gpu-memory-utilization") for f in r.fixes)
    assert f"--max-model-len {(4 * GiB - NULL_BLOCK) // PER_TOKEN // 16 * 16} (the longest that fits)" in r.fixes
    assert any(f.startswith("--kv-cache-memory-bytes") for f in r.fixes)
    assert fit.check(2 * GiB, llama_layers(), plan, fit.Device("cpu", 64 * GiB, 0.9, 9 * GiB)).fits
    # a small machine: utilization x RAM less the weights is below the cap
    small = fit.check(2 * GiB, llama_layers(), fit.Plan(max_model_len=8192), fit.Device("cpu", 4 * GiB, 0.9))
    assert small.available == int(0.9 * 4 * GiB) - 2 * GiB


def test_weights_alone_do_not_fit():
    r = fit.check(15 * GiB, llama_layers(), fit.Plan(max_model_len=8192), metal(16), label="a 27B model",
                  smaller_weights=5 * GiB)
    assert not r.fits
    assert "its weights take 15.00 GiB" in r.message and "= 14.40 GiB leaves nothing for the KV cache" in r.message
    assert "a smaller quantization (a 4-bit build takes about 5.00 GiB)" in r.fixes
    # (15 GiB + 1 GiB + 2 MiB) / 16 GiB > 1: no utilization can help
    assert not any(f.startswith("--gpu-memory-utilization") for f in r.fixes)
    # expanded on the CPU device, but packed it fits: VLLM_METAL_DEQUANTIZE=0 is named
    cpu = fit.check(30 * GiB, llama_layers(), fit.Plan(max_model_len=8192), fit.Device("cpu", 32 * GiB, 0.9),
                    packed_weights=8 * GiB, smaller_weights=8 * GiB)
    assert not cpu.fits and cpu.fixes[0].startswith("VLLM_METAL_DEQUANTIZE=0 (the quantized weights kept packed: "
                                                    "8.00 GiB")
    assert not any("smaller quantization" in f for f in cpu.fixes)  # it is 4-bit already


def test_eight_bit_and_latent_and_state_layers():
    # fp8: one byte per value; fp8_per_token_head: each row also carries a float32 scale
    assert fit.LayerCache(kv_heads=8, head_dim=128).token_bytes("fp8", 2) == 2 * 8 * 128
    assert fit.LayerCache(kv_heads=8, head_dim=128).token_bytes("fp8_per_token_head", 2) == 2 * 8 * (128 + 4)
    assert fit.LayerCache(kv_heads=8, head_dim=128).token_bytes("auto", 4) == 2 * 8 * 128 * 4
    # MLA: one latent row of kv_lora_rank + rope dims (DeepSeek-V3: 512 + 64) per token, no V
    latent = [fit.LayerCache(kv_heads=1, head_dim=576, rows=1)] * 61
    assert fit.kv_bytes(latent, fit.Plan(max_model_len=4096)) == 61 * 4096 * 576 * 2
    r = fit.check(GiB, latent, fit.Plan(max_model_len=131072), metal(8))
    assert not any("fp8" in f for f in r.fixes)  # MLA keeps its cache in the model dtype
    # linear attention: a fixed state per request, twice under prefix caching's align mode
    state = fit.LayerCache(state_bytes=3 * MiB)
    attention = fit.LayerCache(kv_heads=2, head_dim=256)
    layers = [state, state, state, attention]
    for length in (1024, 65536):
        expected = 3 * 3 * MiB + length * 2 * 2 * 256 * 2
        assert fit.kv_bytes(layers, fit.Plan(max_model_len=length, hybrid_manager=True)) == expected
    assert fit.kv_bytes([state], fit.Plan(max_model_len=1024, align=True)) == 6 * MiB


def test_auto_length_and_shared_ranks():
    plan = fit.Plan(max_model_len=131072)
    # --max-model-len -1: vLLM picks the longest that fits; only the weights are judged
    assert fit.check(8 * GiB, llama_layers(), plan, metal(16), auto_length=True).fits
    # two ranks: each holds half the weights and half the cache
    r = fit.check(16 * GiB, llama_layers(), plan, metal(24), share=2)
    assert r.weights == 8 * GiB and r.kv_needed == (16 * GiB + NULL_BLOCK) // 2
    assert r.fits and r.available == int(0.9 * 24 * GiB) - 8 * GiB  # 13.6 GiB for 8 GiB + 1 MiB


def test_eight_bit_names_are_the_served_ones():
    from vllm_metal.native import kv_quant

    assert set(fit.EIGHT_BIT_KV) == set(kv_quant.FORMATS)
    assert fit.ROW_SCALE_BYTES == kv_quant.SCALE_BYTES


@pytest.mark.parametrize("dtype,size", [("auto", 2), ("fp8_e5m2", 1)])
def test_row_bytes(dtype, size):
    assert fit.kv_row_bytes(dtype, 64, 2) == 64 * size
