"""Where an engine step's time goes (issue 15's step profile), reported not
asserted. One command:

    python benchmarks/profile_step.py [--model DIR] [--context 1024] [--reps 5] [--json PATH]

For a model (default: the embedded SmolLM2-135M, float32 as served on the
CPU) and three cases -- decode at batch 1, decode at batch 8 (each row with
`--context` tokens already cached) and a `--context`-token prefill -- the
median of `--reps` steps (after 2 warm-ups), split into:

- prep: the step's inputs from the scheduled rows (`build_step_inputs`,
  what the model runner does per step on the host; vLLM's own scheduler and
  output processing are not included);
- graph: building the step's lazy graph (`LoadedModel.forward`, no eval);
- eval: `mx.eval` of the logits and the written caches, and within it, by op
  class, *estimated* by timing each class alone on the step's real shapes:
  matmul (every linear layer but the head: x @ W.T with the step's rows),
  attention (the paged-attention primitive of every layer, with the step's
  block tables and lengths), logits (the final norm and output head on the
  rows sampled), and the rest (element-wise, norms, RoPE, cache writes,
  residuals: eval minus the three). The residual is printed: a negative rest
  means the classes overlap or ran faster alone;
- sample: greedy argmax over the vocabulary and the tokens to host ints.

Host work = prep + graph + sample; the issue's target is < 5% of a batch-8
decode step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from vllm_metal import ops  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from vllm_metal.models.loader import load_model  # noqa: E402
from vllm_metal.step_inputs import ScheduledRow, build_step_inputs  # noqa: E402

BLOCK = 16
PHASES = ("prep", "graph", "eval", "matmul", "attention", "logits", "rest", "sample", "total")


def median_ms(fn, reps: int) -> float:
    times = []
    for i in range(reps + 2):
        start = time.perf_counter()
        fn()
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class Profiler:
    def __init__(self, model_dir: str, context: int, reps: int):
        # As the model runner loads it: quantized weights expanded on MLX's CPU device.
        self.loaded = load_model(model_dir, dtype="float32",
                                 dequantize=mx.default_device().type == mx.DeviceType.cpu)
        self.context, self.reps = context, reps
        self.rng = np.random.default_rng(0)
        vocab = self.loaded.logits(mx.zeros((1, self.hidden_size()))).shape[-1]
        self.vocab = vocab

    def hidden_size(self) -> int:
        return int(self.loaded.model.model.embed_tokens.weight.shape[1])

    def rows(self, batch: int, new: int, cached: int) -> list[ScheduledRow]:
        per_row = -(-(cached + new + self.reps + 4) // BLOCK)
        return [ScheduledRow(self.rng.integers(100, self.vocab - 1, new).tolist(), cached,
                             [list(range(1 + r * per_row, 1 + (r + 1) * per_row))]) for r in range(batch)]

    def case(self, batch: int, new: int, cached: int) -> dict:
        loaded = self.loaded
        per_row = -(-(cached + new + self.reps + 4) // BLOCK)
        layers = loaded.num_layers
        kv = loaded.allocate_kv(1 + batch * per_row, [BLOCK], [0] * layers)
        rows = self.rows(batch, new, cached)
        sample_rows = np.cumsum([len(r.token_ids) for r in rows]) - 1
        if cached:  # fill the cache as a prefill would (values do not matter for timing)
            fill = [ScheduledRow(self.rng.integers(100, self.vocab - 1, cached).tolist(), 0, r.block_ids)
                    for r in rows]
            mx.eval(loaded.forward(kv, build_step_inputs(fill, [BLOCK]), np.arange(1)), kv.arrays())

        out: dict[str, float] = {}
        out["prep"] = median_ms(lambda: build_step_inputs(rows, [BLOCK]), self.reps)
        inputs = build_step_inputs(rows, [BLOCK])
        graph, evals, samples, totals = [], [], [], []
        for i in range(self.reps + 2):
            t0 = time.perf_counter()
            logits = loaded.forward(kv, inputs, sample_rows)
            t1 = time.perf_counter()
            mx.eval(logits, kv.arrays())
            t2 = time.perf_counter()
            mx.argmax(logits, axis=-1).tolist()
            t3 = time.perf_counter()
            if i >= 2:
                graph.append((t1 - t0) * 1e3)
                evals.append((t2 - t1) * 1e3)
                samples.append((t3 - t2) * 1e3)
                totals.append((t3 - t0) * 1e3)
        out["graph"], out["eval"], out["sample"] = map(statistics.median, (graph, evals, samples))
        out["total"] = out["prep"] + statistics.median(totals)

        tokens = len(inputs.token_ids)
        linears = [m for name, m in loaded.model.model.named_modules()
                   if isinstance(m, nn.Linear) and "lm_head" not in name]
        xs = {}
        for m in linears:
            k = m.weight.shape[1]
            if k not in xs:
                xs[k] = mx.random.normal((tokens, k))
        mx.eval(list(xs.values()))
        out["matmul"] = median_ms(lambda: mx.eval([xs[m.weight.shape[1]] @ m.weight.T for m in linears]), self.reps)

        tables, seq_lens, cu = (mx.array(a) for a in (inputs.block_tables[0], inputs.seq_lens, inputs.cu_seqlens_q))
        specs = [s for s in loaded.layer_kv if s.layout != "state"]
        heads = getattr(loaded.model.model.layers[0].self_attn, "n_heads", None) or \
            loaded.model.args.num_attention_heads
        qs = [mx.random.normal((tokens, heads, s.head_dim)) for s in specs]
        mx.eval(qs)
        attn_inputs = [(q, kv.keys[i], kv.values[i]) for i, q in zip(range(layers), qs)]
        out["attention"] = median_ms(lambda: mx.eval([
            ops.paged_attention(q, k, v, tables, seq_lens, cu, scale=1.0 / np.sqrt(q.shape[-1]))
            for q, k, v in attn_inputs]), self.reps)

        hidden = mx.random.normal((len(sample_rows), self.hidden_size()))
        mx.eval(hidden)
        out["logits"] = median_ms(lambda: mx.eval(loaded.logits(hidden)), self.reps)
        out["rest"] = out["eval"] - out["matmul"] - out["attention"] - out["logits"]
        return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="MLX model directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per decode row; prefill length")
    ap.add_argument("--batch", type=int, default=8, help="rows of the batched decode case")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.model is None:
        from vllm_metal.default_model import ensure_default_model
        args.model = str(ensure_default_model())
    prof = Profiler(args.model, args.context, args.reps)
    cases = {"decode, batch 1": prof.case(1, 1, args.context),
             f"decode, batch {args.batch}": prof.case(args.batch, 1, args.context),
             f"prefill, {args.context} tokens": prof.case(1, args.context, 0)}
    print(f"model {args.model}, MLX {mx.__version__} on {mx.default_device()}, median of {args.reps} steps; "
          "ms (% of the step)\n")
    print("| case | " + " | ".join(PHASES) + " |")
    print("|---|" + "---:|" * len(PHASES))
    for name, r in cases.items():
        cells = [f"{r[p]:.1f}" if p == "total" else f"{r[p]:.1f} ({100 * r[p] / r['total']:.0f}%)" for p in PHASES]
        print(f"| {name} | " + " | ".join(cells) + " |")
    batched = cases[f"decode, batch {args.batch}"]
    host = batched["prep"] + batched["graph"] + batched["sample"]
    print(f"\nhost work (prep + graph + sample) in the batch-{args.batch} decode step: {host:.1f} ms = "
          f"{100 * host / batched['total']:.1f}% (target < 5%)")
    result = {"model": args.model, "context": args.context, "reps": args.reps, "cases": cases}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
