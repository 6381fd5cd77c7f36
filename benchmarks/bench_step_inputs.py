"""Host cost of one decode step's inputs (token ids, positions, block tables,
slot mappings) by batch size: tables rebuilt from the requests' block lists
against the persistent batch's incrementally kept tables
(vllm_metal.engine.block_tables). No model, no MLX.

    .venv/bin/python benchmarks/bench_step_inputs.py
"""

from __future__ import annotations

import argparse
import time

from vllm_metal.engine.block_tables import BlockTables
from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs

BLOCK = 16


def per_call_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):  # best of 5 rounds: the least disturbed by other work
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    print("| batch | context | tables from lists (ms) | kept tables (ms) |")
    print("|---:|---:|---:|---:|")
    for batch, context in [(1, 1152), (8, 1152), (64, 1152), (256, 2048)]:
        per_row = -(-(context + 1) // BLOCK)
        ids = [[list(range(1 + r * per_row, 1 + (r + 1) * per_row))] for r in range(batch)]
        from_lists = [ScheduledRow([5], context, ids[r]) for r in range(batch)]
        kept, bare = BlockTables(), [ScheduledRow([5], context) for _ in range(batch)]
        for r in range(batch):
            kept.set_row(r, ids[r])
        a = per_call_ms(lambda: build_step_inputs(from_lists, [BLOCK]), args.reps)
        b = per_call_ms(lambda: build_step_inputs(bare, [BLOCK], tables=kept.view(batch)), args.reps)
        print(f"| {batch} | {context} | {a:.3f} | {b:.3f} |")


if __name__ == "__main__":
    main()
