"""The hybrid models' state write-back ablation (VLLM_METAL_STATE_WRITEBACK):
decode-step time with the linear-attention states written back in place
(MLX donates the pools to the scatter) against copied (every step copies
every state pool), for batch sizes and state-pool sizes (slots = block ids
of the KV cache). It runs the step the model runner evaluates
(`LoadedModel.forward` on a packed batch), not a server. Reported, not asserted.

    python benchmarks/bench_hybrid_state.py [--model hybrid-0.8b] [--slots 32 183] [--batch 1 8]

The model is a random-weight hybrid of benchmarks/random_model.py (default:
Qwen3.5-0.8B's shape, float32). Results: docs/benchmarks.md#hybrid-models.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from vllm_metal.native import ops  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from random_model import build_named  # noqa: E402
from vllm_metal.models.loader import load_model  # noqa: E402
from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs  # noqa: E402

CONTEXT = 512  # tokens already in each row's cache
STATE_BLOCK = 4096  # the state group's block size: one block covers a whole request (vLLM: max_model_len)


def step_ms(loaded, kv, batch: int, block: int, steps: int) -> float:
    """Median ms of a decode step for `batch` rows, each with CONTEXT tokens."""
    per_row = -(-(CONTEXT + steps + 1) // block)
    rng = np.random.default_rng(0)
    times = []
    for s in range(steps + 2):  # two warm-up steps
        rows = [ScheduledRow([int(rng.integers(100, 40000))], CONTEXT + s,
                             [list(range(1 + r * per_row, 1 + (r + 1) * per_row)), [1 + r]])
                for r in range(batch)]
        inputs = build_step_inputs(rows, [block, STATE_BLOCK])
        start = time.perf_counter()
        logits = loaded.forward(kv, inputs, np.arange(batch))
        mx.eval(logits, kv.arrays())
        times.append(time.perf_counter() - start)
    return float(np.median(times[2:])) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="hybrid-0.8b")
    parser.add_argument("--slots", type=int, nargs="+", default=[32, 183])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "vllm-metal-bench-models"))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    loaded = load_model(build_named(args.model, Path(args.dir) / args.model), dtype="float32")
    block = 128
    # Group 0: attention (block ids for every row's context); group 1: the
    # state slots (one per row). Every layer of a kind in its group.
    layer_group = [1 if kv.layout == "state" else 0 for kv in loaded.layer_kv]
    rows = []
    for slots in args.slots:
        for batch in args.batch:
            per_row = -(-(CONTEXT + args.steps + 3) // block)
            kv = loaded.allocate_kv(max(slots, 1 + batch * per_row), [block, STATE_BLOCK], layer_group)
            state_bytes = sum(a.nbytes for i, s in enumerate(loaded.layer_kv) if s.layout == "state"
                              for a in (kv.keys[i], kv.values[i]) if a is not None)
            first = next(i for i, s in enumerate(loaded.layer_kv) if s.layout == "state")
            result = {"slots": kv.keys[first].shape[0],
                      "batch": batch, "state_pool_mib": state_bytes / 2**20}
            for mode in ("inplace", "copy"):
                os.environ["VLLM_METAL_STATE_WRITEBACK"] = mode
                result[f"{mode}_ms"] = step_ms(loaded, kv, batch, block, args.steps)
            os.environ.pop("VLLM_METAL_STATE_WRITEBACK")
            rows.append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
            del kv
    print("| state slots | state pools (MiB) | batch | in place ms/step | copy ms/step | copy / in place |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['slots']} | {r['state_pool_mib']:.0f} | {r['batch']} | {r['inplace_ms']:.0f} | "
              f"{r['copy_ms']:.0f} | {r['copy_ms'] / r['inplace_ms']:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
