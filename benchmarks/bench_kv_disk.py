"""The disk KV cache (docs/kv_disk.md): save and load throughput, time to first token
of a restored prompt against a full recompute, direct against staged writes, and this
disk's sequential write speed, measured in the same run. Reported, not asserted.

For each context length: an engine without the connector prefills the prompt (the
recompute TTFT); an engine with the connector on an empty directory prefills it and
saves its blocks (the save); a NEW engine on that directory restores it (the load and
the restored TTFT). Greedy first tokens are checked equal. Then the same payload is
written with block_file.write_block_file from per-block views (direct) and after
concatenating it into one buffer (staged), and a dd-style write gives the disk's speed.

    python benchmarks/bench_kv_disk.py [--tokens 2048 8000] [--model llama-1gib] [--dir DIR] [--json OUT]

The default model (SmolLM2-135M) takes at most 8192 positions: 8000 is the "8k" point.
`--model llama-1gib` builds a random-weight llama (benchmarks/random_model.py) with
32 KiB of K/V per token, so a 32k-token prefix is a 1 GiB payload.
Results and their reading: docs/benchmarks.md#disk-kv-cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_METAL_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm_metal.native import ops  # noqa: E402,F401  (fast BLAS before mlx)

import numpy as np  # noqa: E402

from vllm_metal.kv import block_file  # noqa: E402
from vllm_metal.kv.connector_config import transfer_config_dict  # noqa: E402

BLOCK = 16


def dd_write(directory: Path, nbytes: int) -> float:
    """Sequential write + fsync of nbytes in 8 MiB chunks: bytes/s."""
    chunk = np.random.default_rng(0).integers(0, 255, 8 << 20, np.uint8)
    path = directory / "dd.bin"
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        written = 0
        while written < nbytes:
            written += f.write(chunk)
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return written / elapsed


def write_blocks(directory: Path, blocks: list[list[np.ndarray]], staged: bool) -> float:
    """Writes each block file from its per-layer views (direct) or from one
    concatenated copy of the payload (staged): seconds."""
    payload = sum(a.nbytes for a in blocks[0])
    start = time.perf_counter()
    for i, arrays in enumerate(blocks):
        meta = block_file.BlockMeta("ab" * 32, f"{i:064x}", BLOCK, payload)
        chunks = [np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])] if staged else arrays
        block_file.write_block_file(directory / f"{'s' if staged else 'd'}{i}.kvblock", meta, chunks, tmp_id=i)
    return time.perf_counter() - start


def kv_shape(model_dir: str) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a llama-family model directory."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"], heads, head_dim


def measure(model_dir: str, tokens: int, directory: Path) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(tokens)
    # (the warm-up request's 2 blocks are on disk too; the stats below count the timed request only)
    prompt = rng.integers(100, 40000, tokens).tolist()
    warm = rng.integers(100, 40000, 40).tolist()
    params = SamplingParams(temperature=0, max_tokens=1)
    layers, heads, head_dim = kv_shape(model_dir)
    engine_args = dict(dtype="float32", max_model_len=tokens + 64, seed=0, max_num_batched_tokens=tokens + 64,
                       kv_cache_memory_bytes=(tokens // BLOCK + 16) * layers * 2 * BLOCK * heads * head_dim * 4)

    def ttft(**extra):
        llm = LLM(model_dir, **engine_args, **extra)
        try:
            llm.generate([TokensPrompt(prompt_token_ids=warm)], params, use_tqdm=False)  # first-request set-up
            llm.reset_prefix_cache()
            core = llm.llm_engine.engine_core.engine_core
            connector = core.model_executor.driver_worker.worker.model_runner.kv_connector
            if connector is not None:
                connector.fence()
                before = dict(connector.stats)
            start = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
            elapsed = time.perf_counter() - start
            stats = {}
            if connector is not None:
                connector.fence()  # the saves behind the step are written
                stats = {k: v - before[k] for k, v in connector.stats.items()}  # the timed request's only
            return elapsed, list(out.outputs[0].token_ids), out.num_cached_tokens, stats
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm

    kv_dir = directory / f"kv{tokens}"
    kv_config = dict(kv_transfer_config=transfer_config_dict(str(kv_dir)))
    recompute_s, ref, _, _ = ttft()
    saving_s, first, _, save_stats = ttft(**kv_config)
    restored_s, again, cached, load_stats = ttft(**kv_config)
    files = sorted(kv_dir.glob("*.kvblock"))
    total = sum(f.stat().st_size for f in files)

    sample = [[rng.standard_normal((BLOCK, heads, head_dim), dtype=np.float32) for _ in range(2 * layers)]
              for _ in range(len(files))]
    scratch = directory / f"writes{tokens}"
    scratch.mkdir()
    direct, staged = [], []
    for _ in range(3):  # alternating, best of three: the disk's speed drifts
        for staged_write, times in ((False, direct), (True, staged)):
            times.append(write_blocks(scratch, sample, staged=staged_write))
            for f in scratch.iterdir():
                f.unlink()
    direct_s, staged_s = min(direct), min(staged)
    shutil.rmtree(scratch)
    gb = 1e9
    return dict(
        model=Path(model_dir).name, tokens=tokens, files=len(files), bytes=total, same_first_token=ref == first == again,
        cached_tokens=cached,
        recompute_ttft_ms=recompute_s * 1e3, ttft_while_saving_ms=saving_s * 1e3, restored_ttft_ms=restored_s * 1e3,
        save_ms=save_stats["save_s"] * 1e3, save_gb_s=save_stats["bytes_saved"] / gb / max(save_stats["save_s"], 1e-9),
        load_ms=load_stats["load_s"] * 1e3, load_gb_s=load_stats["bytes_loaded"] / gb / max(load_stats["load_s"], 1e-9),
        direct_write_ms=direct_s * 1e3, staged_write_ms=staged_s * 1e3,
        dd_write_gb_s=dd_write(directory, max(total, 256 << 20)) / gb,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8000])
    parser.add_argument("--model", default="default",
                        help="'default' (SmolLM2-135M) or a shape of benchmarks/random_model.py (llama-1gib)")
    parser.add_argument("--dir", help="where the block files go (default: a temporary directory)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    from vllm_metal.formats.default_model import ensure_default_model

    base = Path(args.dir or tempfile.mkdtemp(prefix="kv-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    if args.model == "default":
        model_dir = ensure_default_model()
    else:
        from random_model import build_named

        model_dir = build_named(args.model, base / args.model)
    rows = []
    try:
        for tokens in args.tokens:
            rows.append(measure(model_dir, tokens, base))
            print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    print("| model | tokens | files | MB | recompute TTFT ms | restored TTFT ms | save ms (GB/s) | load ms (GB/s) | "
          "direct / staged write ms | dd GB/s | same token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['tokens']} | {r['files']} | {r['bytes'] / 1e6:.0f} | {r['recompute_ttft_ms']:.0f} | "
              f"{r['restored_ttft_ms']:.0f} | {r['save_ms']:.0f} ({r['save_gb_s']:.2f}) | "
              f"{r['load_ms']:.0f} ({r['load_gb_s']:.2f}) | {r['direct_write_ms']:.0f} / {r['staged_write_ms']:.0f} | "
              f"{r['dd_write_gb_s']:.2f} | {r['same_first_token']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
