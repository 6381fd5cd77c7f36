"""Per-step host milliseconds of a vLLM engine, split by phase (in-process).

Runs vLLM's own engine (`vllm.LLM`, in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0)
over `--requests` greedy requests of `--input-len` random tokens and
`--output-len` generated ones, at most `--concurrency` at a time, and times
what one engine step spends in each of vLLM's phases by wrapping the engine's
own objects (their code unchanged): the scheduler (`schedule`,
`update_from_output`), the executor (`execute_model` -- which on vllm-metal
includes waiting for the previous step's evaluation -- and `sample_tokens`),
and the output processor (`process_outputs`: detokenization, request
outputs). With vllm-metal it also reads the runner's own split of its host
work (runner prep, graph building, sampling on the host) from timers around
the runner's methods. Works with vLLM 0.32 and 0.33, so it runs in vLLM's CPU
backend's venv too (benchmarks/bench_overhead.py runs it in both).

    python benchmarks/step_phases.py MODEL_DIR --concurrency 64 --json OUT

It also times each step from one step's output reaching the scheduler to the
next's (`step_kinds` in the JSON: decode-only steps by rows, steps with prompt
tokens by their scheduled tokens), which says where a run's time goes, e.g. the
sonnet benchmark's concurrency-8 run (`--concurrency 8 --requests 16
--input-len 835 --output-len 128`, SmolLM2's float32 directory) in both
systems' venvs (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

from step_kinds import step_kinds

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

if __name__ == "__main__":  # our engine on the malloc a served one runs on (vLLM CPU's venv: unchanged)
    import served_malloc

    served_malloc.reexec()


def timed(obj, name: str, label: str, acc: dict, counts: dict) -> None:
    """Wraps obj.name (an instance attribute shadowing the method) with a timer."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            acc[label] += time.perf_counter() - start
            counts[label] += 1

    setattr(obj, name, wrapper)


def record_steps(scheduler, finished: list) -> None:
    """Stamps each step when its output reaches the scheduler (update_from_output,
    which gets the step's SchedulerOutput): one step's time is the gap since the
    previous one's, whether the engine overlaps steps (async scheduling) or not."""
    inner = scheduler.update_from_output

    def wrapper(scheduler_output, *args, **kwargs):
        out = inner(scheduler_output, *args, **kwargs)
        tokens = scheduler_output.num_scheduled_tokens
        finished.append((time.perf_counter(), scheduler_output.total_num_scheduled_tokens, len(tokens),
                         sum(1 for n in tokens.values() if n == 1)))
        return out

    scheduler.update_from_output = wrapper


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, help="default: 4 x concurrency")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="the scheduler's token budget a step (2048: what `vllm serve` gets on a CPU)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)

    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    requests = args.requests or 4 * args.concurrency
    rng = np.random.default_rng(0)
    prompts = [TokensPrompt(prompt_token_ids=rng.integers(100, 40000, args.input_len).tolist())
               for _ in range(requests)]
    llm = LLM(args.model, dtype="float32", max_model_len=2048, kv_cache_memory_bytes=args.kv_cache_bytes,
              max_num_seqs=args.concurrency, max_num_batched_tokens=args.max_num_batched_tokens, seed=0,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    acc: dict = collections.defaultdict(float)
    counts: dict = collections.defaultdict(int)
    timed(core.scheduler, "schedule", "schedule", acc, counts)
    timed(core.scheduler, "update_from_output", "update_from_output", acc, counts)
    timed(core.model_executor, "execute_model", "execute_model", acc, counts)
    timed(core.model_executor, "sample_tokens", "sample_tokens", acc, counts)
    timed(engine.output_processor, "process_outputs", "process_outputs", acc, counts)
    runner = getattr(getattr(core.model_executor, "driver_worker", None), "worker", None)
    runner = getattr(runner, "model_runner", None)
    metal = type(runner).__name__ == "MetalModelRunner"
    if metal:  # the runner's own host work (its methods, wrapped the same way)
        timed(runner.mlx_model, "forward", "runner_graph", acc, counts)
        timed(runner.batch, "update", "runner_batch_update", acc, counts)
    finished: list = []  # (time a step's output reached the scheduler, its tokens, its rows, its decode rows)
    record_steps(core.scheduler, finished)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:args.concurrency], params, use_tqdm=False)  # warm-up
    acc.clear()
    counts.clear()
    finished.clear()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    steps = counts["schedule"]
    result = {
        "system": "vllm-metal" if metal else "vllm-cpu",
        "concurrency": args.concurrency, "requests": requests, "input_len": args.input_len,
        "output_len": args.output_len, "wall_s": wall, "steps": steps,
        "output_tok_s": requests * args.output_len / wall,
        "ms_per_step": {k: 1e3 * v / max(steps, 1) for k, v in sorted(acc.items())},
        "calls": dict(sorted(counts.items())),
        "step_kinds": step_kinds(finished, start),
    }
    if metal:
        from vllm_metal.native.allocator import engine_allocator

        result["malloc"] = engine_allocator()
        result["steps_sampled_in_graph"] = runner.steps_sampled_in_graph
        result["tokens_fed"] = runner.tokens_fed
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
