"""Decode attention alone: one step's paged attention over every layer, on
MLX's CPU device, with the caches streamed from memory (each sequence its own
blocks, as served) or kept in cache (every sequence reading the same blocks):
the difference is what streaming the KV costs on top of the kernel's compute.

Default shape: SmolLM2-135M's (30 layers, 9 query heads over 3 KV heads of 64,
16-token blocks) at the sonnet benchmark's context (1,152 tokens), batch 8.

    .venv/bin/python benchmarks/attention_decode.py [--batch 8] [--context 1152] [--reps 20] [--head-major]
"""

from __future__ import annotations

import argparse
import json
import time

import vllm_metal.native.ops as ops  # noqa: I001  (arms the BLAS shim before mlx.core)
import mlx.core as mx
import numpy as np


def run(batch: int, context: int, layers: int, heads: int, kv_heads: int, dim: int, block: int, reps: int,
        shared: bool, head_major: bool = False) -> float:
    """Median ms of one step's attention over `layers` layers. head_major: each
    block's rows stored KV head by KV head ([blocks, kv_heads, block, dim] in
    memory), handed to the kernel as a [blocks, block, kv_heads, dim] view (it
    reads the strides): what a head-major cache layout would give the reads."""
    per_seq = context // block + 1
    blocks = batch * per_seq + 1
    rng = np.random.default_rng(0)
    shape = (blocks, kv_heads, block, dim) if head_major else (blocks, block, kv_heads, dim)
    caches = [tuple(mx.array(rng.standard_normal(shape).astype(np.float32)) for _ in range(2))
              for _ in range(layers)]
    if head_major:
        mx.eval(caches)
        caches = [tuple(c.swapaxes(1, 2) for c in kv) for kv in caches]
    ids = np.tile(np.arange(per_seq), (batch, 1)) if shared else np.arange(batch * per_seq).reshape(batch, -1)
    tables = mx.array(ids.astype(np.int32) + 1)
    seq_lens = mx.array(np.full(batch, context, np.int32))
    cu = mx.array(np.arange(batch + 1, dtype=np.int32))
    q = mx.array(rng.standard_normal((batch, heads, dim)).astype(np.float32))
    mx.eval([c for kv in caches for c in kv], tables, seq_lens, cu, q)

    def step():
        mx.eval([ops.paged_attention(q, k, v, tables, seq_lens, cu, scale=dim ** -0.5) for k, v in caches])

    for _ in range(3):
        step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1152)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--head-major", action="store_true",
                    help="store each block's rows KV head by KV head (the kernel reads the strides)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    mx.set_default_device(mx.cpu)
    shape = dict(batch=args.batch, context=args.context, layers=args.layers, heads=args.heads,
                 kv_heads=args.kv_heads, dim=args.dim, block=args.block, head_major=args.head_major)
    kv_bytes = 2 * args.layers * args.batch * args.context * args.kv_heads * args.dim * 4
    out = dict(shape, kv_mb=kv_bytes / 1e6,
               streamed_ms=run(**shape, reps=args.reps, shared=False),
               cached_ms=run(**shape, reps=args.reps, shared=True))
    layout = ", head-major blocks" if args.head_major else ""
    print(f"batch {args.batch}, {args.context}-token contexts{layout}, {args.layers} layers "
          f"({out['kv_mb']:.0f} MB of KV): "
          f"{out['streamed_ms']:.2f} ms streamed from memory, {out['cached_ms']:.2f} ms with the blocks cached")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
