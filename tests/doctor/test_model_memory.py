"""`vllm-metal doctor --model CONFIG`: a model's memory from a bare config."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_metal.doctor import cli
from vllm_metal.doctor.model_memory import config_only, memory_report

GiB = 1 << 30
# A Llama-3.1-8B-shaped config, MLX 4-bit: 32 layers of 8 KV heads of 128.
LLAMA_8B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
            "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
            "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
            "quantization": {"group_size": 64, "bits": 4}}
KV_32K = 32768 * 32 * 2 * 8 * 128 * 2  # 4 GiB in bfloat16
NORMS = 32 * 2 * 4096 + 4096
QUANTIZED = 2 * 128256 * 4096 + 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)


def test_a_config_alone(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    assert config_only(tmp_path) == tmp_path / "config.json"
    assert config_only(tmp_path / "config.json") == tmp_path / "config.json"
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert config_only(tmp_path) is None  # a checkpoint: the load-time checks run instead


def test_memory_report_with_metal_faked():
    # a 24 GB Mac's recommended working set: about 16 GiB
    r = memory_report(LLAMA_8B, device="gpu", total=16 * GiB)
    metal = QUANTIZED // 2 + QUANTIZED // 64 * 4 + NORMS * 2
    assert r["served"] and r["weights"]["metal_bytes"] == metal
    assert r["weights"]["cpu_bytes"] == (QUANTIZED + NORMS) * 2  # expanded to bfloat16
    assert r["kv_cache"]["metal_bytes"] == KV_32K and r["kv_cache"]["tokens"] == 32768
    assert r["here"]["fits"] and r["here"]["available_bytes"] == int(0.92 * 16 * GiB) - metal
    # 128k: 16 GiB of cache do not fit beside the weights in 16 GiB
    r = memory_report(LLAMA_8B, device="gpu", total=16 * GiB, max_model_len=131072)
    assert not r["here"]["fits"] and "--max-model-len" in r["here"]["message"]
    # 8-bit K/V: half the cache
    assert memory_report(LLAMA_8B, device="gpu", total=16 * GiB, cache_dtype="fp8")["kv_cache"]["metal_bytes"] \
        == KV_32K // 2


def run_doctor(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_metal", "doctor", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "VLLM_METAL_DEVICE": "cpu"})


def test_doctor_on_a_bare_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in LLAMA_8B.items() if k != "quantization"}))  # the float model
    out = run_doctor("--model", str(tmp_path), "--quant", "4bit")
    lines = out.stdout.splitlines()
    assert lines[0] == "model       llama: served: 32 layers, 8 KV heads of 128"
    assert lines[1].startswith("format      MLX affine 4-bit, group 64 (requested); 8.03 B parameters")
    metal = QUANTIZED // 2 + QUANTIZED // 64 * 4 + NORMS * 2
    assert f"weights {metal / GiB:.2f} GiB on Metal" in lines[2]
    assert "one request of 32768 tokens: 4.00 GiB on Metal" in out.stdout
    assert "(from the config alone, not run)" in out.stdout
    # JSON, another context, 8-bit K/V
    out = run_doctor("--model", str(path), "--json", "--max-model-len", "8192", "--kv-cache-dtype", "fp8")
    report = json.loads(out.stdout)
    assert report["kv_cache"]["metal_bytes"] == 8192 * 32 * 2 * 8 * 128 and report["parameters"] == \
        QUANTIZED + NORMS
    assert report["weights"]["metal_bytes"] == (QUANTIZED + NORMS) * 2  # float: no --quant
    assert out.returncode == (0 if report["here"]["fits"] else 1)


def test_doctor_names_an_unserved_family_and_bad_input(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "falcon_h1", "hidden_size": 64}))
    assert cli.main(["doctor", "--model", str(path)]) == 1
    assert "falcon_h1: refused: model type 'falcon_h1' is not served by vllm-metal yet" in capsys.readouterr().out
    assert cli.main(["doctor", "--model", str(path), "--quant", "3.5bit"]) == 2
    assert "--quant '3.5bit'" in capsys.readouterr().err


@pytest.mark.parametrize("quant", ["q4_k_m", "q8_0", "8bit"])
def test_requested_quantizations(quant):
    r = memory_report(LLAMA_8B | {"quantization": None}, quant=quant, device="gpu", total=64 * GiB)
    assert r["quantization"].lower().startswith(("gguf " + quant, "mlx affine 8-bit"))
    assert r["here"]["fits"]
