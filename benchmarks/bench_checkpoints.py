"""Load time and resident memory of the default model (SmolLM2-135M-Instruct)
from its GGUF (Q4_1, Q8_0 embedding: what `vllm serve` reads) and from the
MLX-format copy of the same weights (model.safetensors), side by side in one
run. Each load runs in a fresh process (`--child`): the model as the runner
loads it (`load_model`, weights evaluated), kept quantized (as Metal serves
it) and expanded to float32 (as the CPU device serves it); the time from the
call to evaluated weights, the weights' bytes, and the process's resident
set before and after (VmRSS). Three runs per point, the median.

    .venv/bin/python benchmarks/bench_checkpoints.py

Results: benchmarks/results/checkpoints/checkpoints.json (raw), the table in
docs/benchmarks.md (generated block `checkpoints`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

BEGIN, END = "<!-- BEGIN GENERATED: checkpoints -->", "<!-- END GENERATED: checkpoints -->"
RUNS = 3


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def child(path: str, dequantize: bool) -> dict:
    from vllm_metal.native import ops  # noqa: F401  (fast BLAS before mlx)
    from vllm_metal.models.loader import load_model

    import gguf  # noqa: F401  (every module either path imports, imported before measuring)
    import mlx.core as mx  # noqa: F401
    import mlx_lm.utils  # noqa: F401

    from vllm_metal.formats import awq_gptq, gguf_checkpoint  # noqa: F401

    before = _rss()
    start = time.perf_counter()
    loaded = load_model(path, dtype="float32", dequantize=dequantize)
    seconds = time.perf_counter() - start
    return {"load_s": seconds, "weights_bytes": loaded.weights_bytes, "rss_before": before, "rss_after": _rss()}


def measure(path: str, dequantize: bool) -> dict:
    runs = []
    for _ in range(RUNS):
        out = subprocess.run([sys.executable, __file__, "--child", path, "--dequantize", str(int(dequantize))],
                             capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {**median, "runs": runs}


def render(report: dict) -> str:
    meta = report["meta"]
    lines = [f"{meta['date']}, {meta['cpu']} ({meta['isa']}), {meta['cores']} cores, commit "
             f"`{meta['plugin_revision']}`; median of {RUNS} fresh processes. Load: `load_model` to evaluated "
             "weights (imports excluded). RSS: the process's resident set after the load minus before it.",
             "", "| checkpoint | weights as | load (s) | weights (MiB) | RSS added (MiB) |", "|---|---|---:|---:|---:|"]
    for row in report["rows"]:
        lines.append(f"| {row['format']} | {row['as']} | {row['load_s']:.2f} | {row['weights_bytes'] / 2**20:.1f} | "
                     f"{(row['rss_after'] - row['rss_before']) / 2**20:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--dequantize", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "checkpoints" / "checkpoints.json")
    ap.add_argument("--docs", type=Path, default=HERE.parent / "docs" / "benchmarks.md")
    ap.add_argument("--render-only", type=Path, help="re-render the docs block from a raw JSON file")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, bool(args.dequantize))))
        return 0
    import bench_serving as bs

    if args.render_only:
        bs.write_block(args.docs, render(json.loads(args.render_only.read_text())), BEGIN, END)
        return 0
    from vllm_metal.formats.default_model import ensure_default_model, export_mlx

    started = dt.datetime.now().astimezone()
    gguf_dir = ensure_default_model()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        mlx_dir = export_mlx(gguf_dir, Path(tmp) / "mlx")
        for fmt, path in (("GGUF (Q4_1, Q8_0 embedding)", gguf_dir), ("MLX format (same weights)", mlx_dir)):
            for dequantize, words in ((False, "kept quantized (Metal)"), (True, "float32 (CPU device)")):
                row = {"format": fmt, "as": words, **measure(path, dequantize)}
                rows.append(row)
                print(f"{fmt:30} {words:24} load {row['load_s']:.2f} s, weights {row['weights_bytes'] / 2**20:.1f} "
                      f"MiB, RSS +{(row['rss_after'] - row['rss_before']) / 2**20:.1f} MiB", flush=True)
    report = {"meta": bs.run_meta("benchmarks/bench_checkpoints.py", list(argv or sys.argv[1:]), started),
              "rows": rows}
    table = render(report)
    bs.publish(report, table, args.out, args.docs, BEGIN, END)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
