"""What an 8-bit KV cache (`--kv-cache-dtype fp8` = fp8_e4m3, `fp8_e5m2`,
`fp8_per_token_head`) does to the model: next-token distributions with the 8-bit cache against the
float32 cache, teacher-forced over 2048-token contexts (the sonnet text from
two starting lines), through the paged path the runner serves
(`LoadedModel.forward`, 256-token chunks: every later chunk reads the
earlier ones from the cache). Per position: KL(float || 8-bit) in nats and
whether the top-1 token agrees; per run: the text's perplexity.

Models: the embedded SmolLM2-135M-Instruct (llama, trained weights, served
from its GGUF), and the same weights through the qwen3 family's code (q/k
RMS norms on every head, norm weights 1: keys of unit RMS per head; the
trained weights are not trained for it, so its perplexity is high, but the
cache sees qwen3's key statistics).

    .venv/bin/python benchmarks/kv_cache_quality.py

Results: benchmarks/results/kv_cache/quality.json (raw), the table in
docs/benchmarks.md (generated block `kv-cache-quality`); docs/checkpoints.md
quotes it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

BEGIN, END = "<!-- BEGIN GENERATED: kv-cache-quality -->", "<!-- END GENERATED: kv-cache-quality -->"
FORMATS = ("fp8_e4m3", "fp8_e5m2", "fp8_per_token_head")
CONTEXT, CHUNK, BLOCK = 2048, 256, 16


def score(loaded, tokens: list[int], kv_cache_dtype: str):
    """float64 log-softmax rows predicting tokens[1:], teacher-forced in chunks."""
    import mlx.core as mx
    import numpy as np

    from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs

    windows = sorted(set(loaded.sliding_windows), key=lambda w: w or 0)
    layer_group = [windows.index(w) for w in loaded.sliding_windows]
    kv = loaded.allocate_kv(len(tokens) // BLOCK + 2, [BLOCK] * len(windows), layer_group, kv_cache_dtype)
    blocks = list(range(1, kv.keys[0].shape[0]))
    rows = []
    for done in range(0, len(tokens) - 1, CHUNK):
        new = tokens[done:min(done + CHUNK, len(tokens) - 1)]
        inputs = build_step_inputs([ScheduledRow(new, done, [blocks] * len(windows))], [BLOCK] * len(windows))
        logits = loaded.forward(kv, inputs, np.arange(len(new)))
        mx.eval(logits, kv.keys, kv.values)
        lp = np.array(logits).astype(np.float64)
        lp -= lp.max(axis=-1, keepdims=True)
        rows.append(lp - np.log(np.exp(lp).sum(axis=-1, keepdims=True)))
    return np.concatenate(rows)


def compare(loaded, tokens: list[int]) -> dict:
    import numpy as np

    base = score(loaded, tokens, "auto")
    targets = np.array(tokens[1:])
    out = {"perplexity_float": float(np.exp(-base[np.arange(len(targets)), targets].mean()))}
    for fmt in FORMATS:
        got = score(loaded, tokens, fmt)
        kl = (np.exp(base) * (base - got)).sum(axis=-1)
        out[fmt] = {"kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()),
                    "top1_agreement": float((base.argmax(-1) == got.argmax(-1)).mean()),
                    "perplexity": float(np.exp(-got[np.arange(len(targets)), targets].mean()))}
    return out


def qwen3_variant(model_dir: str, out: Path) -> str:
    """The default model's weights (float32) as a qwen3 checkpoint."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model

    from vllm_metal.formats.checkpoint import build_model, open_checkpoint

    model, config = build_model(open_checkpoint(model_dir))
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(dequantize_model(model).parameters())}
    config = {k: v for k, v in json.loads((Path(model_dir) / "config.json").read_text()).items()}
    config.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], torch_dtype="float32")
    for i in range(config["num_hidden_layers"]):
        for norm in ("q_norm", "k_norm"):
            weights[f"model.layers.{i}.self_attn.{norm}.weight"] = mx.ones((config["head_dim"],))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_dir) / name, out / name)
    return str(out)


def render(report: dict) -> str:
    meta = report["meta"]
    lines = [f"{meta['date']}, {meta['cpu']} ({meta['isa']}), commit `{meta['plugin_revision']}`: "
             f"{len(report['contexts'])} contexts of {CONTEXT} tokens each, teacher-forced in {CHUNK}-token chunks; "
             "KL(float32 cache || 8-bit cache) of the next-token distributions, nats.", "",
             "| model | cache | KL mean | KL p99 | KL max | top-1 agrees | perplexity (float32 cache) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for model, runs in report["results"].items():
        for fmt in FORMATS:
            vals = [r[fmt] for r in runs]
            mean = lambda k: sum(v[k] for v in vals) / len(vals)  # noqa: E731
            ppl = sum(r["perplexity_float"] for r in runs) / len(runs)
            lines.append(f"| {model} | {fmt} | {mean('kl_mean'):.4f} | {mean('kl_p99'):.3f} | "
                         f"{max(v['kl_max'] for v in vals):.3f} | {100 * mean('top1_agreement'):.1f}% | "
                         f"{mean('perplexity'):.2f} ({ppl:.2f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "results" / "kv_cache" / "quality.json")
    ap.add_argument("--docs", type=Path, default=HERE.parent / "docs" / "benchmarks.md")
    ap.add_argument("--render-only", type=Path)
    args = ap.parse_args(argv)
    import bench_serving as bs

    if args.render_only:
        bs.write_block(args.docs, render(json.loads(args.render_only.read_text())), BEGIN, END)
        return 0
    import sonnet_dataset
    from transformers import AutoTokenizer

    from vllm_metal.formats.default_model import ensure_default_model
    from vllm_metal.models.loader import load_model

    started = dt.datetime.now().astimezone()
    model_dir = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lines = sonnet_dataset.load_lines()
    contexts = []
    for start in (0, len(lines) // 2):
        ids = tokenizer("".join(lines[start:] + lines[:start])).input_ids
        contexts.append(ids[:CONTEXT])
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in (("SmolLM2-135M (llama, GGUF)", model_dir),
                           ("SmolLM2-135M weights as qwen3", qwen3_variant(model_dir, Path(tmp) / "qwen3"))):
            loaded = load_model(path, dtype="float32", dequantize=True)
            results[name] = [compare(loaded, c) for c in contexts]
            print(name, json.dumps(results[name]), flush=True)
    report = {"meta": bs.run_meta("benchmarks/kv_cache_quality.py", list(argv or sys.argv[1:]), started),
              "contexts": [len(c) for c in contexts], "results": results}
    table = render(report)
    bs.publish(report, table, args.out, args.docs, BEGIN, END)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
