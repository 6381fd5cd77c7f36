"""Hybrid prefix caching: time to first token of a 2,048-token prompt that
shares a 1,536-token prefix with earlier requests (a prefix-cache hit: the
linear-attention state at the prefix's last block boundary is cached, vLLM's
"align" mode) against the same kind of prompt with nothing cached (a miss),
on the Qwen3.5-0.8B-shaped random hybrid of benchmarks/random_model.py,
float32, vLLM's default arguments (prefix caching on, chunked prefill, async
scheduling). Reported, not asserted.

    python benchmarks/bench_hybrid_prefix.py [--model hybrid-0.8b] [--repeats 3] [--out FILE]

How vLLM caches a hybrid's prefix: a request's state is kept at the block
boundaries where its prefill chunks end (the prompt's last full block, and
every block boundary decode crosses). A later prompt sharing only part of an
earlier prompt finds the attention blocks but no state there; vLLM then ends
that request's prefill chunk at the shared boundary (the "junction") so the
state is cached for the next one. So each hit is measured on the third
prompt of a family: P+A (miss), P+B (miss, checkpoints P), P+C (hit).
Results: docs/benchmarks.md#hybrid-prefix-caching.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from random_model import build_named

PREFIX, SUFFIX = 1536, 512


def cpu_busy_other() -> float:
    """Cores used by other processes over one second (a quiet machine reads ~0)."""
    import psutil

    me = {p.pid for p in [psutil.Process()] + psutil.Process().children(recursive=True)}
    procs = [p for p in psutil.process_iter() if p.pid not in me]
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(1.0)
    total = 0.0
    for p in procs:
        try:
            total += p.cpu_percent(None)
        except psutil.Error:
            pass
    return total / 100


def ttft(llm, prompt: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(temperature=0, max_tokens=1),
                       use_tqdm=False)[0]
    return time.perf_counter() - start, int(out.num_cached_tokens or 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="hybrid-0.8b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "hybrid" / "prefix_caching.json"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_METAL_DEVICE", "cpu")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import numpy as np
    from vllm import LLM

    model = build_named(args.model, Path.home() / ".cache" / "vllm-metal-bench" / "models" / f"{args.model}-fp32")
    rng = np.random.default_rng(0)

    def tokens(n):
        return rng.integers(1000, 40000, n).tolist()

    quiet_before = cpu_busy_other()
    llm = LLM(model, dtype="float32", max_model_len=4096, kv_cache_memory_bytes=2 << 30, seed=0)
    ttft(llm, tokens(64))  # first request: lazy set-up
    runs = []
    for _ in range(args.repeats):
        miss, miss_cached = ttft(llm, tokens(PREFIX + SUFFIX))
        prefix = tokens(PREFIX)
        first = ttft(llm, prefix + tokens(SUFFIX))
        junction = ttft(llm, prefix + tokens(SUFFIX))
        hit, hit_cached = ttft(llm, prefix + tokens(SUFFIX))
        runs.append(dict(miss_s=miss, miss_cached_tokens=miss_cached, first_s=first[0], junction_s=junction[0],
                         junction_cached_tokens=junction[1], hit_s=hit, hit_cached_tokens=hit_cached))
        print(json.dumps(runs[-1]), flush=True)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    mode = llm.llm_engine.vllm_config.cache_config.mamba_cache_mode
    quiet_after = cpu_busy_other()
    miss_med = statistics.median(r["miss_s"] for r in runs)
    hit_med = statistics.median(r["hit_s"] for r in runs)
    result = dict(model=args.model, prompt_tokens=PREFIX + SUFFIX, shared_prefix_tokens=PREFIX, block_size=block,
                  mamba_cache_mode=mode, runs=runs, miss_median_s=miss_med, hit_median_s=hit_med,
                  speedup=miss_med / hit_med, host=platform.processor() or platform.machine(),
                  cores=os.cpu_count(), other_cpu_cores_before=quiet_before, other_cpu_cores_after=quiet_after,
                  when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"TTFT of a {PREFIX + SUFFIX}-token prompt: miss {miss_med:.2f} s, hit on {PREFIX} shared tokens "
          f"{hit_med:.2f} s ({miss_med / hit_med:.2f}x); block size {block}, mode {mode}; {args.out}")
    sys.stdout.flush()
    os._exit(0)  # the in-process engine's threads


if __name__ == "__main__":
    main()
