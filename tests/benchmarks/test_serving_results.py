"""The serving benchmark's results parser, roofline placement, tables and docs block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import serving_results as sr

DATA = Path(__file__).parent / "data"


@pytest.fixture
def bench_json() -> dict:
    # A real `vllm bench serve --save-result` file (vLLM 0.32, --metric-percentiles 50,99).
    return json.loads((DATA / "vllm_bench_serve_result.json").read_text())


def test_parse_real_vllm_bench_result(bench_json):
    run = sr.parse_bench_result(bench_json)
    assert run["completed"] == 4 and run["failed"] == 0 and run["max_concurrency"] == 8
    assert run["output_tok_s"] == pytest.approx(bench_json["output_throughput"])
    assert run["total_tok_s"] == pytest.approx(bench_json["total_token_throughput"])
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "p50", "p99"):
            assert run[f"{name}_{stat}_ms"] == pytest.approx(bench_json[f"{stat}_{name}_ms"])
    # Independent of the parser: throughput is tokens over the run's duration.
    assert run["output_tok_s"] == pytest.approx(run["total_output_tokens"] / run["duration_s"])


def test_parse_falls_back_to_median_and_counts_failures():
    run = sr.parse_bench_result({"completed": 3, "num_prompts": 5, "median_ttft_ms": 12.0,
                                 "output_throughput": 1.5})
    assert run["ttft_p50_ms"] == 12.0
    assert run["failed"] == 2
    assert run["tpot_mean_ms"] is None


ROOF = {"peak_bandwidth_gbs": 50.0, "peak_sgemm_gflops": 200.0,
        "model": {"params": 100_000_000, "weight_bytes": 400_000_000, "kv_bytes_per_token": 1000,
                  "matmul_params": 100_000_000}}


def _run(concurrency, tpot_ms, ttft_ms, completed=10):
    return {"system": "x", "completed": completed, "max_concurrency": concurrency,
            "total_input_tokens": 1000 * completed, "total_output_tokens": 100 * completed,
            "tpot_mean_ms": tpot_ms, "ttft_p50_ms": ttft_ms}


def test_roofline_decode_and_prefill_fractions():
    row = sr.roofline_row(_run(1, tpot_ms=20.0, ttft_ms=2000.0), ROOF, prefix_tokens=200)
    # Decode: 400 MB per step at 50 GB/s is 8 ms, so a 20 ms step is 40% of the bound.
    assert row["decode_tok_s"] == pytest.approx(50.0)
    assert row["decode_bound_weights_tok_s"] == pytest.approx(125.0)
    assert row["decode_frac_weights"] == pytest.approx(0.4)
    kv = 1 * (1000 + 50) * 1000
    assert row["decode_frac_weights_kv"] == pytest.approx((400e6 + kv) / 0.02 / 50e9)
    # Prefill: 800 new tokens * 2 * 1e8 params = 160 GFLOP in 2 s = 80 GFLOP/s, 40% of 200.
    assert row["prefill_tokens_computed"] == 800
    assert row["prefill_gflops"] == pytest.approx(80.0)
    assert row["prefill_frac_peak"] == pytest.approx(0.4)


def test_roofline_batches_decode_and_skips_prefill_above_concurrency_one():
    row = sr.roofline_row(_run(8, tpot_ms=40.0, ttft_ms=9000.0), ROOF, prefix_tokens=200)
    assert row["decode_tok_s"] == pytest.approx(200.0)
    assert row["decode_bound_weights_tok_s"] == pytest.approx(1000.0)
    assert row["decode_frac_weights"] == pytest.approx(0.2)  # one weight read per step, shared
    assert "prefill_gflops" not in row


def _report(runs):
    return {
        "meta": {"date": "2026-01-01 00:00 UTC", "cpu": "Test CPU", "cores": 2, "model_name": "M",
                 "num_prompts": 10, "dataset": {"prompt_tokens_mean": 1000, "prefix_tokens": 200,
                                                "output_tokens": 100},
                 "systems": [{"name": "a", "label": "System A"}, {"name": "b", "label": "System B"}]},
        "roofline": {**ROOF, "mlx_sgemm_gflops": 150.0, "numpy_copy_gbs": 50.0},
        "runs": runs,
        "roofline_rows": [sr.roofline_row(r, ROOF, 200) for r in runs if "error" not in r],
    }


def test_markdown_table_has_every_run_and_the_errors():
    ok = {**sr.parse_bench_result({"completed": 10, "num_prompts": 10, "max_concurrency": 1,
                                   "output_throughput": 12.345, "total_token_throughput": 130.0,
                                   "mean_ttft_ms": 900.0, "p50_ttft_ms": 850.0, "p99_ttft_ms": 1500.0,
                                   "mean_tpot_ms": 40.0, "p50_tpot_ms": 39.0, "p99_tpot_ms": 60.0,
                                   "total_input_tokens": 10000, "total_output_tokens": 1000}),
          "system": "a", "concurrency": 1, "load_before": 0.4}
    bad = {"system": "b", "concurrency": 8, "error": "TimeoutError: not ready"}
    text = sr.render_markdown(_report([ok, bad]))
    row = next(line for line in text.splitlines() if line.startswith("| System A | 1 |"))
    assert "| 12.3 | 130.0 | 900 | 850 | 1,500 | 40 | 39 | 60 | 10/0 |" in row
    assert "| System B | 8 |" in text and "error: TimeoutError: not ready" in text
    assert "Test CPU (2 cores)" in text and "### Roofline" in text
    assert "MLX+shim 150" in text and "numpy copy 50.0" in text
    header = next(line for line in text.splitlines() if line.startswith("| system | conc. | output"))
    assert header.count("|") == len(sr.COLUMNS) + 4


def test_update_docs_replaces_only_the_generated_block():
    doc = f"# T\n\nbefore\n{sr.DOCS_BEGIN}\nold table\n{sr.DOCS_END}\nafter\n"
    new = sr.update_docs(doc, "new table\n")
    assert new == f"# T\n\nbefore\n{sr.DOCS_BEGIN}\nnew table\n{sr.DOCS_END}\nafter\n"
    assert sr.update_docs(new, "new table\n") == new  # idempotent
    with pytest.raises(ValueError):
        sr.update_docs("# no markers\n", "x")
    # A --cap-isa run has a block of its own; the main one stays.
    begin, end = sr.docs_markers("avx2")
    both = new + f"{begin}\nold avx2\n{end}\n"
    assert sr.update_docs(both, "avx2 table\n", "avx2") == new + f"{begin}\navx2 table\n{end}\n"


def test_docs_page_carries_the_markers():
    doc = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
    text = doc.read_text()
    assert sr.DOCS_BEGIN in text and sr.DOCS_END in text
    assert all(m in text for m in sr.docs_markers("avx2"))
    assert "## Primitive micro-benchmark" in text


def test_prefill_flops_leave_out_the_lm_head():
    roof = {**ROOF, "model": {**ROOF["model"], "layer_params": 75_000_000}}
    row = sr.roofline_row(_run(1, tpot_ms=20.0, ttft_ms=2000.0), roof, prefix_tokens=200)
    assert row["prefill_gflops"] == pytest.approx(2 * 75e6 * 800 / 2.0 / 1e9)  # 60 GFLOP/s
    assert row["decode_frac_weights"] == pytest.approx(0.4)  # decode still reads every weight


def test_header_names_prompt_counts_per_level_and_the_revision():
    report = _report([])
    report["meta"].update(num_prompts=[8, 16], concurrency=[1, 8], plugin_revision="abc1234")
    text = sr.render_markdown(report)
    assert "8 prompts at concurrency 1, 16 prompts at concurrency 8" in text
    assert "(vllm-metal at `abc1234`)" in text
