"""`vllm-metal doctor` and the gate over vLLM's CUDA-only paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engine_helpers import engine, greedy

from vllm_metal.doctor import capabilities, cli
from vllm_metal.engine import cuda_gate

CUDA_EXTENSIONS = ("vllm._C", "vllm._moe_C", "vllm._flashmla_C", "vllm.vllm_flash_attn", "flash_attn",
                   "flashinfer", "deep_gemm", "vllm._custom_ops_C")


def doctor_json(*args, env=None) -> tuple[int, dict]:
    vllm_metal_cmd = Path(sys.executable).parent / "vllm-metal"
    out = subprocess.run([str(vllm_metal_cmd), "doctor", "--json", *args], capture_output=True, text=True,
                         env=dict(os.environ, **(env or {})), timeout=120)
    return out.returncode, json.loads(out.stdout)


def test_doctor_json_on_this_machine():
    rc, report = doctor_json(env={"VLLM_METAL_DEVICE": "cpu"})
    assert rc == 0 and report["can_serve"] and report["problems"] == []
    assert {"host", "mlx", "extension", "attention_path", "cuda_paths"} <= set(report)
    assert report["mlx"]["version"] == "0.32.4" and report["mlx"]["device"] == "cpu"
    assert report["extension"] == {"built_against_mlx": "0.32.4", "metal_kernels": False, "loaded": True}
    assert report["attention_path"]["name"] == "cpu" and report["attention_path"]["reason"]
    assert report["hybrid_state_writeback"]["mode"] == "inplace"
    assert report["gated_delta_path"]["name"] == "fused" and report["gated_delta_path"]["reason"]
    assert len(report["cuda_paths"]) == len(cuda_gate.CUDA_PATHS)
    assert report["lora"]["served"] and len(report["lora"]["formats"]) == 2
    assert all(p["status"] == {"warn": "inert", "error": "refused"}[p["if_requested"]] and p["reason"]
               and p["instead"] for p in report["cuda_paths"])
    assert report["pooling"]["served"] and "modernbert" in report["pooling"]["encoders"]
    assert {"kv_connector", "kv_offloading", "prompt_embeds"} <= {
        p["key"] for p in report["cuda_paths"] if p["status"] == "refused"}


def test_doctor_reports_the_cpu_kernels_isa():
    """The instruction set the CPU kernels run (and the host's, and a cap) is in
    the report: /proc/cpuinfo decides what the host has."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    host = "avx512" if "avx512f" in flags and "avx512bw" in flags else "avx2" if "avx2" in flags else "generic"
    _, report = doctor_json(env={"VLLM_METAL_DEVICE": "cpu", "VLLM_METAL_CPU_ISA": ""})
    screen = "avx512bf16" if host == "avx512" and "avx512_bf16" in flags else "avx2" if host == "avx2" else ""
    assert report["cpu_kernels"] == {"isa": host, "host_isa": host, "cap": None, "head_screen": screen}
    out = subprocess.run([sys.executable, "-m", "vllm_metal", "doctor"], capture_output=True, text=True,
                         env=dict(os.environ, VLLM_METAL_DEVICE="cpu", VLLM_METAL_CPU_ISA="generic"), timeout=120)
    assert f"cpu kernels generic builds (host {host}" in out.stdout
    assert (", capped by VLLM_METAL_CPU_ISA=generic)" in out.stdout) == (host != "generic")
    assert "greedy head screened" not in out.stdout  # the generic builds: the exact head
    out = subprocess.run([sys.executable, "-m", "vllm_metal", "doctor"], capture_output=True, text=True,
                         env=dict(os.environ, VLLM_METAL_DEVICE="cpu", VLLM_METAL_CPU_ISA=""), timeout=120)
    assert ("greedy head screened in bfloat16" in out.stdout) == bool(screen)


def test_doctor_text_and_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "vllm_metal", "doctor"], capture_output=True, text=True,
                         env=dict(os.environ, VLLM_METAL_DEVICE="cpu"), timeout=120)
    assert out.returncode == 0
    assert "attention   cpu:" in out.stdout and "CUDA graphs: inert" in out.stdout
    assert "gated delta fused:" in out.stdout
    assert "lora        served (--enable-lora): PEFT" in out.stdout and "kv_b_proj (absorbed at load)" in out.stdout


def test_doctor_fails_when_plugin_would_be_inactive():
    """vLLM's own CPU platform claims the host (VLLM_TARGET_DEVICE=cpu) and
    VLLM_METAL_DEVICE is unset: the plugin stays out, and the doctor says why."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_METAL_DEVICE"}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    out = subprocess.run([sys.executable, "-m", "vllm_metal", "doctor", "--json"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 1
    assert "vLLM's own cpu platform serves this host" in json.loads(out.stdout)["problems"][0]


def test_doctor_reports_mlx_mismatch(monkeypatch, capsys):
    monkeypatch.setattr(capabilities, "installed_mlx", lambda: "0.31.0")
    report = capabilities.capabilities()
    assert not report["can_serve"]
    assert any("built against MLX 0.32.4 but MLX 0.31.0 is installed" in p for p in report["problems"])
    assert report["attention_path"]["name"] is None
    assert cli.main(["doctor"]) == 1
    assert "cannot serve" in capsys.readouterr().out


def test_extension_refuses_mismatched_mlx(monkeypatch):
    from vllm_metal.native import extension

    monkeypatch.setattr(extension, "installed_mlx", lambda: "0.33.0")
    with pytest.raises(ImportError, match="built against MLX 0.32.4 but MLX 0.33.0 is installed"):
        extension.load_extension()


def engine_config(model_dir, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model_dir, max_model_len=512, **kwargs).create_engine_config()


@pytest.mark.parametrize("kwargs,message", [
    (dict(quantization="fp8"), r"--quantization fp8 .* asks for FP8 / NVFP4 .*CUDA-only.*Instead: serve MLX-quantized"),
    (dict(kv_cache_dtype="int8_per_token_head"), r"--kv-cache-dtype int8_per_token_head asks for quantized KV caches "
                                                 r"other than fp8"),
    (dict(speculative_config={"method": "ngram_gpu", "num_speculative_tokens": 2, "prompt_lookup_max": 3}),
     r"--speculative-config method 'ngram_gpu' asks for speculative proposers other than host n-gram, .*vllm-metal does not serve.*"
     r"Instead: n-gram speculation"),
    # Accepted by vLLM, and silently ignored by the MLX runner until refused:
    (dict(kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"}),
     r"--kv-transfer-config \(kv_connector=ExampleConnector\) asks for KV connectors"),
    (dict(kv_offloading_size=1.0), r"--kv-offloading-size 1.0 asks for KV-cache offloading"),
    (dict(enable_prompt_embeds=True), r"--enable-prompt-embeds asks for prompt embeddings"),
])
def test_result_changing_options_are_errors(model_dir, kwargs, message):
    with pytest.raises(Exception, match=message):
        engine_config(model_dir, **kwargs)


@pytest.mark.parametrize("kwargs,env,expect", [
    (dict(compilation_config={"cudagraph_mode": "FULL"}), {}, "CUDA graphs is inert"),
    (dict(compilation_config={"cudagraph_capture_sizes": [1, 2, 4]}), {}, "CUDA graphs is inert"),
    (dict(compilation_config={"mode": 3}), {}, "torch.compile / Inductor is inert"),
    (dict(attention_backend="FLASH_ATTN"), {}, "FlashAttention / FlashInfer / Triton attention backends is inert"),
    ({}, {"VLLM_DEEPEP_BUFFER_SIZE_MB": "64"}, "expert parallel"),
    ({}, {"VLLM_USE_FLASHINFER_SAMPLER": "1"}, "FlashInfer top-k/top-p sampler is inert"),
    ({}, {"VLLM_MARLIN_USE_ATOMIC_ADD": "1"}, "CUDA kernels is inert"),
])
def test_inert_options_warn_and_are_turned_off(model_dir, monkeypatch, kwargs, env, expect):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    warned = []
    monkeypatch.setattr(cuda_gate.logger, "warning", lambda msg, *a: warned.append(msg % a if a else msg))
    config = engine_config(model_dir, **kwargs)
    assert any(expect in w for w in warned), warned
    assert config.compilation_config.cudagraph_mode.name == "NONE"
    assert config.compilation_config.mode.name == "NONE"
    assert config.parallel_config.worker_cls == "vllm_metal.engine.worker.MetalWorker"


def test_engine_with_inert_options_serves_and_loads_no_cuda_extension(model_dir):
    with engine(model_dir, compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"},
                attention_backend="FLASHINFER") as llm:
        tokens, _ = greedy(llm, [[1, 2, 3, 4]], max_tokens=4)
    assert len(tokens[0]) == 4
    loaded = [m for m in sys.modules if m in CUDA_EXTENSIONS or m.startswith(("flashinfer", "flash_attn"))]
    assert loaded == []


def test_docs_table_is_generated_from_the_gate():
    from pathlib import Path

    assert set(cuda_gate.FLAGS) == {p.key for p in cuda_gate.CUDA_PATHS}
    text = (Path(__file__).resolve().parents[2] / "docs" / "capabilities.md").read_text()
    block = text.split("<!-- cuda-paths:begin")[1].split("-->", 1)[1].split("<!-- cuda-paths:end -->")[0]
    assert block.strip() == cuda_gate.markdown_table(), "regenerate: python -m vllm_metal.engine.cuda_gate"
