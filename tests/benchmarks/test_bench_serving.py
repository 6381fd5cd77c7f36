"""The serving benchmark's command lines and per-server request fields (no servers started)."""

from __future__ import annotations

import json

import bench_serving as bs


def test_every_vllm_system_serves_the_same_model_config():
    commands = {s: bs.server_command(s, "/m", 1234, 1 << 30, preload=False) for s in bs.SYSTEMS}
    for system in ("vllm-metal", "vllm-metal-sync", "vllm-cpu"):
        cmd, _ = commands[system]
        joined = " ".join(cmd)
        assert "--dtype float32" in joined and "--max-model-len 2048" in joined
        assert f"--kv-cache-memory-bytes {1 << 30}" in joined and "--port 1234" in joined
    assert commands["vllm-metal"][1] == {"VLLM_METAL_DEVICE": "cpu"}
    assert commands["vllm-metal-sync"][1]["VLLM_METAL_SYNC_PER_LAYER"] == "1"
    cpu_cmd, cpu_env = commands["vllm-cpu"]
    assert cpu_cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cpu_env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and "LD_PRELOAD" not in cpu_env
    for system in ("vllm-metal-ngram", "vllm-cpu-ngram"):  # the same speculative config on both servers
        cmd, env = commands[system]
        assert cmd[-2:] == ["--speculative-config", json.dumps(bs.NGRAM_CONFIG)]
        assert env == commands[system.removesuffix("-ngram")][1]
        assert cmd[:-2] == commands[system.removesuffix("-ngram")][0]
    mlx_cmd, _ = commands["mlx-lm"]
    assert mlx_cmd[1].endswith("mlx_lm_server.py") and mlx_cmd[2:4] == ["--model", "/m"]


def test_server_env_drops_the_callers_plugin_settings(monkeypatch):
    monkeypatch.setenv("VLLM_METAL_SYNC_PER_LAYER", "1")
    monkeypatch.setenv("VLLM_METAL_DEVICE", "cpu")
    env = bs.clean_env({})
    assert not any(k.startswith("VLLM_METAL_") for k in env)
    assert bs.clean_env({"VLLM_METAL_DEVICE": "cpu"})["VLLM_METAL_DEVICE"] == "cpu"


def test_mlx_lm_gets_eos_suppressed_and_vllm_servers_nothing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert bs.eos_token_ids(tmp_path) == [2, 7]
    body = bs.extra_body("mlx-lm", tmp_path)
    assert body["logit_bias"] == {"2": -1e9, "7": -1e9}
    assert body["logprobs"] is False and body["repetition_penalty"] == 0.0
    assert bs.extra_body("vllm-metal", tmp_path) == {} == bs.extra_body("vllm-cpu", tmp_path)


def test_bench_command_uses_vllms_client_on_the_custom_dataset(tmp_path):
    cmd = bs.bench_command("http://127.0.0.1:9", "/m", tmp_path / "p.jsonl", 16, 8, tmp_path, "r.json",
                           {"logprobs": False})
    joined = " ".join(cmd)
    assert cmd[cmd.index("bench") + 1] == "serve"
    for flag in ("--dataset-name custom", "--skip-chat-template", "--custom-output-len -1",
                 "--disable-shuffle", "--num-prompts 16", "--max-concurrency 8", "--ignore-eos",
                 "--temperature 0", "--metric-percentiles 50,99", "--save-result"):
        assert flag in joined
    assert json.loads(cmd[cmd.index("--extra-body") + 1]) == {"logprobs": False}


def test_cap_isa_makes_every_system_run_its_avx2_code(tmp_path, monkeypatch):
    """--cap-isa avx2 (an AVX2-only host, on an AVX-512 one): each system's environment
    names its AVX2 code, and vLLM CPU's sitecustomize answers torch's AVX-512 questions no."""
    import subprocess
    import sys

    monkeypatch.setattr(bs, "BENCH_HOME", tmp_path)
    envs = {s: bs.server_command(s, "/m", 1234, 1 << 30, preload=False, cap="avx2")[1] for s in bs.SYSTEMS}
    assert envs["vllm-metal"] == {"VLLM_METAL_DEVICE": "cpu", "VLLM_METAL_CPU_ISA": "avx2",
                                  "OPENBLAS_CORETYPE": "Haswell"}
    assert envs["vllm-metal-sync"]["VLLM_METAL_CPU_ISA"] == "avx2"
    assert envs["mlx-lm"] == {"OPENBLAS_CORETYPE": "Haswell"}
    cpu = envs["vllm-cpu"]
    assert cpu["ATEN_CPU_CAPABILITY"] == "avx2" and cpu["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    probe = subprocess.run([sys.executable, "-c", "import torch.cpu; print(torch.cpu._is_avx512_supported(), "
                            "torch.cpu._is_avx512_bf16_supported())"], capture_output=True, text=True,
                           env=bs.clean_env({"PYTHONPATH": cpu["PYTHONPATH"]}), check=True)
    assert probe.stdout.split() == ["False", "False"]
    assert bs.server_command("vllm-metal", "/m", 1, 1, preload=False)[1] == {"VLLM_METAL_DEVICE": "cpu"}


def test_kernel_isa_reports_the_cap():
    got = bs.kernel_isa({"VLLM_METAL_CPU_ISA": "generic", "OPENBLAS_CORETYPE": "Haswell"})
    assert got["isa"] == "generic" and got["cap"] == "generic" and got["openblas_coretype"] == "Haswell"
    assert got["host_isa"] in ("generic", "avx2", "avx512")
