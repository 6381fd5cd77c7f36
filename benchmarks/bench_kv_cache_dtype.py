"""The sonnet serving benchmark at concurrency 8 with a fixed KV-cache budget,
float32 cache against `--kv-cache-dtype fp8`, side by side in one run:
output tok/s, latencies, and how many requests of the benchmark's length
(1024 prompt + 128 output tokens) the budget holds, read from vLLM's own
startup line ("Maximum concurrency for N tokens per request: Xx").

The budget (`--kv-cache-bytes`, default 160 MiB) holds fewer than 8 such
requests in float32 (46 KiB per token for SmolLM2-135M) and more than 8 in
8-bit: the float32 server queues requests the 8-bit one runs at once.

    .venv/bin/python benchmarks/bench_kv_cache_dtype.py

Results: benchmarks/results/kv_cache/serving.json (raw), the table in
docs/benchmarks.md (generated block `kv-cache-serving`). Uses bench_serving's
server launch, dataset and client (the model as bench_serving serves it:
the embedded model, float32).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_serving as bs  # noqa: E402
import convert_fp32  # noqa: E402
import sonnet_dataset  # noqa: E402

BEGIN, END = "<!-- BEGIN GENERATED: kv-cache-serving -->", "<!-- END GENERATED: kv-cache-serving -->"
SYSTEMS = {"vllm-metal": "float32 cache", "vllm-metal-fp8": "fp8 (E4M3) cache"}
CAPACITY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def capacity(log: str) -> dict | None:
    """The tokens the server's KV cache holds (vLLM's startup line: its maximum
    concurrency at max_model_len tokens per request)."""
    m = CAPACITY.search(Path(log).read_text(errors="replace")) if Path(log).exists() else None
    if not m:
        return None
    per_request = int(m.group(1).replace(",", ""))
    return {"max_model_len": per_request, "concurrency": float(m.group(2)),
            "tokens": float(m.group(2)) * per_request}


def render(report: dict) -> str:
    meta = report["meta"]
    lines = [f"{meta['date']}, {meta['cpu']} ({meta['isa']}), {meta['cores']} cores, commit "
             f"`{meta['plugin_revision']}`; SmolLM2-135M float32, sonnet prompts ({report['input_len']} + "
             f"{report['output_len']} tokens), concurrency {report['concurrency']}, {report['num_prompts']} prompts, "
             f"--kv-cache-memory-bytes {report['kv_cache_bytes'] >> 20} MiB.", "",
             f"| KV cache | tokens the cache holds | {report['input_len'] + report['output_len']}-token requests it holds "
             "| output tok/s | TTFT p50 (ms) | TPOT p50 (ms) | foreign cores |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for run in report["runs"]:
        if "error" in run:
            lines.append(f"| {SYSTEMS[run['system']]} | failed: {run['error']} | | | | | |")
            continue
        tokens = run["capacity"]["tokens"]
        lines.append(f"| {SYSTEMS[run['system']]} | {tokens:,.0f} | "
                     f"{tokens / (report['input_len'] + report['output_len']):.1f} | {run['output_tok_s']:.1f} | "
                     f"{run['ttft_p50_ms']:.0f} | {run['tpot_p50_ms']:.1f} | {run['foreign_cores']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-cache-bytes", type=int, default=160 << 20)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "kv_cache" / "serving.json")
    ap.add_argument("--docs", type=Path, default=HERE.parent / "docs" / "benchmarks.md")
    ap.add_argument("--render-only", type=Path)
    args = ap.parse_args(argv)
    if args.render_only:
        bs.write_block(args.docs, render(json.loads(args.render_only.read_text())), BEGIN, END)
        return 0
    from vllm_metal.formats.default_model import ensure_default_model

    bs.SYSTEMS["vllm-metal-fp8"] = bs.System("vllm-metal-fp8", "vllm-metal, fp8 KV cache",
                                             {"VLLM_METAL_DEVICE": "cpu"}, ["--kv-cache-dtype", "fp8"])
    started = dt.datetime.now().astimezone()
    run_dir = bs.BENCH_HOME / "runs" / ("kv-" + started.strftime("%Y%m%d-%H%M%S"))
    run_dir.mkdir(parents=True, exist_ok=True)
    source = Path(ensure_default_model())
    model_dir = convert_fp32.convert(source, bs.BENCH_HOME / "models" / f"{source.name}-fp32")
    tokenizer = sonnet_dataset.load_tokenizer(str(model_dir))
    lines = sonnet_dataset.load_lines()
    prompts = sonnet_dataset.build_prompts(tokenizer, lines, input_len=args.input_len, output_len=args.output_len,
                                           prefix_len=200, num_prompts=args.num_prompts, seed=0)
    warmup = sonnet_dataset.build_prompts(tokenizer, lines, input_len=args.input_len, output_len=16,
                                          prefix_len=200, num_prompts=2, seed=1_000_003)
    dataset = run_dir / "prompts.jsonl"
    sonnet_dataset.write_jsonl(prompts, dataset)
    serve_args = argparse.Namespace(kv_cache_bytes=args.kv_cache_bytes, vllm_cpu_preload=False, start_timeout=900,
                                    warmup_tokens=16, run_timeout=3600)
    runs = []
    for system in SYSTEMS:
        run = bs.run_one(system, args.concurrency, args.num_prompts, serve_args, str(model_dir), model_dir,
                         dataset, warmup, run_dir)
        run["capacity"] = capacity(run["log"])
        runs.append(run)
    report = {"meta": bs.run_meta("benchmarks/bench_kv_cache_dtype.py", list(argv or sys.argv[1:]), started),
              "kv_cache_bytes": args.kv_cache_bytes, "concurrency": args.concurrency,
              "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "runs": runs}
    table = render(report)
    bs.publish(report, table, args.out, args.docs, BEGIN, END)
    print(table)
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
