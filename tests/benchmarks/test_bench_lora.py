"""benchmarks/bench_lora.py's table: overhead per system against its own base run."""

from __future__ import annotations

import bench_lora


def run(system, mode, concurrency, tok_s):
    return {"system": system, "mode": mode, "adapters_used": bench_lora.MODES[mode], "concurrency": concurrency,
            "output_tok_s": tok_s, "ttft_p50_ms": 100.0, "tpot_p50_ms": 10.0, "foreign_cores": 0.0}


def test_overhead_is_against_the_same_systems_base():
    report = {"meta": {"date": "d", "cpu": "c", "isa": "avx2", "cores": 2, "plugin_revision": "r",
                       "dataset": {"num_prompts": 4, "prompt_tokens_mean": 500.0}, "output_len": 64},
              "runs": [run("vllm-metal", "base", 8, 50.0), run("vllm-metal", "lora-4", 8, 45.0),
                       run("vllm-cpu", "base", 8, 80.0), run("vllm-cpu", "lora-1", 8, 20.0),
                       {"system": "vllm-cpu", "mode": "lora-2", "concurrency": 8, "error": "RuntimeError: x"}]}
    table = bench_lora.render(report)
    assert "| vllm-metal | 4 | 8 | 45.00 | 100 | 10.0 | +10.0% | 0.00 |" in table
    assert "| vllm-cpu | 1 | 8 | 20.00 | 100 | 10.0 | +75.0% | 0.00 |" in table
    assert "(avx2, 2 cores)" in table and "Failed: vllm-cpu lora-2 c=8: RuntimeError: x" in table
