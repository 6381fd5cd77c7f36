"""Embeddings per second, side by side in one run: vllm-metal, vLLM's CPU
backend and sentence-transformers (torch CPU).

Models (random weights, float32, built here with transformers' classes):
  bert-base   BERT-base's shape (12 layers, 768 wide, 12 heads; position
              table widened to 1040 for the 1024-token inputs), CLS pooling
              + normalization from a sentence-transformers config
  qwen3-0.6b  Qwen3-0.6B's shape (28 layers, 1024 wide, 16 / 8 heads of 128,
              vocab 151936), saved as Qwen3-Embedding ships (bare decoder,
              last-token pooling + normalization)
Inputs: random token ids, every prompt new (no prefix-cache hits), lengths
32 / 256 / 1024, batches of 1 (one prompt per call, one after another) and
32 (32 prompts per call). The vLLM systems run the offline API
(`LLM.embed` of token prompts, vLLM's defaults otherwise); sentence-
transformers runs its model's forward on the same ids (what `encode` does
after tokenizing). Each point: one warm-up call of the same shape, then
calls until ~`--tokens` tokens are embedded (at least one call).

    .venv/bin/python benchmarks/bench_pooling.py             # ~25 min here
    .venv/bin/python benchmarks/bench_pooling.py --quick     # smoke run, nothing written

Results: benchmarks/results/pooling/pooling.json (raw), the table in
docs/benchmarks.md (generated block `pooling`). Setup once:
`bash benchmarks/setup_peers.sh` (vLLM's CPU venv, sentence-transformers for it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BEGIN, END = "<!-- BEGIN GENERATED: pooling -->", "<!-- END GENERATED: pooling -->"
SYSTEMS = ("vllm-metal", "vllm-cpu", "sentence-transformers")
MODELS = ("bert-base", "qwen3-0.6b")


# ---- inside each system's own Python ------------------------------------------------

def _busy_and_own() -> tuple[float, float]:
    """(machine busy CPU s, this process's CPU s): foreign load while measuring."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        busy = (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")
    except OSError:
        busy = 0.0
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system


def worker(system: str, model: str, lens: list[int], batches: list[int], tokens: int, vocab: int) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(0)
    if system == "sentence-transformers":
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(os.cpu_count() or 1)
        st = SentenceTransformer(model, device="cpu")

        def embed(prompts):
            ids = torch.tensor(np.array(prompts), dtype=torch.long)
            with torch.inference_mode():
                return st({"input_ids": ids, "attention_mask": torch.ones_like(ids)})["sentence_embedding"]
    else:
        from vllm import LLM
        from vllm.inputs import TokensPrompt

        # vLLM's CPU backend reserves --gpu-memory-utilization of the machine unless the cache
        # is sized (as bench_serving.py sizes it); vllm-metal sizes a pooling model's own.
        extra = {"kv_cache_memory_bytes": 4 << 30} if system == "vllm-cpu" else {}
        llm = LLM(model, runner="pooling", dtype="float32", max_model_len=max(lens) + 16, seed=0, **extra)

        def embed(prompts):
            return llm.embed([TokensPrompt(prompt_token_ids=p) for p in prompts], use_tqdm=False)

    def prompts(batch, length):
        return rng.integers(5, vocab, (batch, length)).tolist()

    results = []
    for length in lens:
        for batch in batches:
            embed(prompts(batch, length))  # warm-up (its prompts are never reused)
            calls = max(1, math.ceil(tokens / (batch * length)))
            batches_in = [prompts(batch, length) for _ in range(calls)]
            before, t0 = _busy_and_own(), time.perf_counter()
            for p in batches_in:
                embed(p)
            wall = time.perf_counter() - t0
            after = _busy_and_own()
            foreign = max(after[0] - before[0] - (after[1] - before[1]), 0.0) / wall
            results.append({"len": length, "batch": batch, "calls": calls, "wall_s": wall,
                            "embeddings_per_s": calls * batch / wall, "foreign_cores": foreign})
            print(f"[{system} {Path(model).name}] len {length} batch {batch}: "
                  f"{results[-1]['embeddings_per_s']:.2f} emb/s", file=sys.stderr, flush=True)
    return results


# ---- the driver -------------------------------------------------------------

def make_models(root: Path, tokenizer_dir: Path) -> dict[str, Path]:
    """The two random checkpoints (built once, reused)."""
    import shutil

    import torch
    import transformers

    out = {}
    specs = {
        "bert-base": ("BertModel", transformers.BertConfig(
            vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
            intermediate_size=3072, max_position_embeddings=1040), "cls"),
        "qwen3-0.6b": ("Qwen3Model", transformers.Qwen3Config(
            vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, intermediate_size=3072, max_position_embeddings=40960,
            tie_word_embeddings=True, rope_theta=1_000_000), "lasttoken"),
    }
    for name, (cls, config, pooling) in specs.items():
        path = root / name
        out[name] = path
        if (path / "modules.json").exists():
            continue
        torch.manual_seed(0)
        kwargs = {"add_pooling_layer": False} if cls == "BertModel" else {}
        getattr(transformers, cls)(config, **kwargs).eval().save_pretrained(str(path))
        if cls == "Qwen3Model":
            cfg = json.loads((path / "config.json").read_text())
            cfg["architectures"] = ["Qwen3ForCausalLM"]  # as Qwen3-Embedding's config.json says
            (path / "config.json").write_text(json.dumps(cfg, indent=1))
        for f in tokenizer_dir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                shutil.copy(f, path / f.name)
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "2_Normalize").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": config.hidden_size, "pooling_mode": pooling}))
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 1040}))
    return out


def system_command(system: str, bench_home: Path) -> tuple[list[str], dict]:
    import bench_serving as bs

    me = [str(Path(__file__).resolve()), "--worker", system]
    if system == "vllm-metal":
        return [sys.executable, *me], {}
    env = dict(bs.SYSTEMS["vllm-cpu"].env)
    if bs.vllm_cpu_preload():
        env["LD_PRELOAD"] = ":".join(bs.vllm_cpu_preload())
    if system == "sentence-transformers":
        env = {"PYTHONPATH": str(bench_home / "lib" / "sentence-transformers")}
    return [str(bs.VLLM_CPU_PYTHON), *me], env


def render(report: dict) -> str:
    m = report["meta"]
    runs = [r for r in report["runs"] if "error" not in r]
    lines = [f"Run {m['date']} on {m['cpu']} ({m['isa']}, {m['cores']} cores), plugin {m['plugin_revision']}; "
             "random float32 models, random token ids (every prompt new), offline APIs; "
             "raw: `benchmarks/results/pooling/pooling.json`.", "",
             "| model | tokens per input | batch | " + " | ".join(f"{s} emb/s" for s in SYSTEMS)
             + " | vllm-metal vs best peer | foreign cores (max) |",
             "|---|---:|---:|" + "---:|" * len(SYSTEMS) + "---:|---:|"]
    points = sorted({(r["model"], p["len"], p["batch"]) for r in runs for p in r["points"]},
                    key=lambda k: (MODELS.index(k[0]), k[1], k[2]))
    for model, length, batch in points:
        values, foreign = {}, 0.0
        for r in runs:
            for p in r["points"]:
                if r["model"] == model and p["len"] == length and p["batch"] == batch:
                    values[r["system"]] = p["embeddings_per_s"]
                    foreign = max(foreign, p["foreign_cores"])
        peers = [v for s, v in values.items() if s != "vllm-metal"]
        ratio = f"{values['vllm-metal'] / max(peers):.2f}x" if "vllm-metal" in values and peers else ""
        cells = " | ".join(f"{values[s]:.2f}" if s in values else "-" for s in SYSTEMS)
        lines.append(f"| {model} | {length} | {batch} | {cells} | {ratio} | {foreign:.2f} |")
    failed = [r for r in report["runs"] if "error" in r]
    lines += [f"\nFailed: {r['system']} {r['model']}: {r['error']}" for r in failed]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=380, help=argparse.SUPPRESS)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--lens", type=int, nargs="+", default=[32, 256, 1024])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens embedded per point (at least one call)")
    ap.add_argument("--quick", action="store_true", help="smoke run (bert-base, 32 tokens); nothing written")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "pooling" / "pooling.json")
    ap.add_argument("--docs", type=Path, default=HERE.parent / "docs" / "benchmarks.md")
    ap.add_argument("--render-only", type=Path, metavar="POOLING_JSON", help="rewrite the docs table from a JSON")
    args = ap.parse_args(argv)
    if args.worker:
        if args.worker == "vllm-metal":
            os.environ.setdefault("VLLM_METAL_DEVICE", "cpu")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        print(json.dumps(worker(args.worker, str(args.model), args.lens, args.batches, args.tokens, args.vocab)))
        return 0
    import bench_serving as bs

    if args.render_only:
        bs.write_block(args.docs, render(json.loads(args.render_only.read_text())), BEGIN, END)
        return 0

    if args.quick:
        args.models, args.lens, args.tokens = "bert-base", [32], 256
    started = dt.datetime.now().astimezone()
    from vllm_metal.formats.default_model import ensure_default_model

    models = make_models(bs.BENCH_HOME / "models" / "pooling", Path(ensure_default_model()))
    vocab = {"bert-base": 30000, "qwen3-0.6b": 49000}
    runs = []
    for name in [m for m in args.models.split(",") if m]:
        for system in [s for s in args.systems.split(",") if s]:
            cmd, env = system_command(system, bs.BENCH_HOME)
            cmd += ["--model", str(models[name]), "--lens", *map(str, args.lens), "--batches",
                    *map(str, args.batches), "--tokens", str(args.tokens), "--vocab", str(vocab[name])]
            record = {"system": system, "model": name, "command": shlex.join(cmd), "env": env}
            t0 = time.monotonic()
            proc = subprocess.run(cmd, env=bs.clean_env(env), capture_output=True, text=True)
            record["wall_s"] = time.monotonic() - t0
            if proc.returncode != 0:
                record["error"] = f"exit {proc.returncode}: {proc.stderr[-1500:]}"
                print(f"[{system} {name}] FAILED: {record['error']}", flush=True)
            else:
                record["points"] = json.loads(proc.stdout.strip().splitlines()[-1])
            runs.append(record)
    meta = bs.run_meta("benchmarks/bench_pooling.py", list(argv or sys.argv[1:]), started)
    meta.update({"models": {k: str(v) for k, v in models.items()}, "lens": args.lens, "batches": args.batches,
                 "tokens_per_point": args.tokens})
    report = {"meta": meta, "runs": runs}
    table = render(report)
    print(table)
    if not args.quick:
        bs.publish(report, table, args.out, args.docs, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
