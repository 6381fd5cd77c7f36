"""Encoder attention: a dense MLX path vs the paged-attention primitive.

For BERT-base's attention (12 heads of 64, float32) over packed steps of
whole prompts (half the prompts at full length, half at half length: the
padding the dense path pays is real), one layer's attention as
  dense       gather rows into [sequences, longest] + MLX's fused SDPA with a
              key mask + scatter back (the path first written for encoders)
  paged       what models/bert.py runs: the step's K/V laid out as 16-token
              blocks + ops.paged_attention(causal=False)
  paged-causal the primitive's causal mode on the same blocks (half the
              score work: how close the non-causal mode comes to it)
The decision in docs/pooling.md rests on these numbers.

    .venv/bin/python benchmarks/bench_encoder_attention.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vllm_metal.native import ops

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from vllm_metal.models.bert import EncoderBatch, attention  # noqa: E402

HEADS, DIM, BLOCK = 12, 64, 16
CASES = [(32, 32), (32, 256), (8, 1024), (1, 1024), (2, 1024)]  # (sequences, longest prompt)


def timeit(fn, min_time=1.0, min_reps=3):
    fn()
    reps, start = 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - start < min_time:
        fn()
        reps += 1
    return (time.perf_counter() - start) / reps


def dense_attention(q, k, v, cu: np.ndarray, scale: float) -> mx.array:
    """Padded [sequences, longest] rows through mx.fast.scaled_dot_product_attention."""
    lens = np.diff(cu)
    longest, n, t = int(lens.max()), len(lens), int(cu[-1])
    j = np.arange(longest)[None, :]
    real = j < lens[:, None]
    index = mx.array(np.where(real, cu[:-1, None] + j, t).reshape(-1).astype(np.int32))
    valid = mx.array(np.flatnonzero(real.reshape(-1)).astype(np.int32))
    mask = mx.array(real[:, None, None, :])

    def pad(x):
        x = mx.concatenate([x, mx.zeros((1, *x.shape[1:]), dtype=x.dtype)])[index]
        return x.reshape(n, longest, *x.shape[1:]).transpose(0, 2, 1, 3)

    out = mx.fast.scaled_dot_product_attention(pad(q), pad(k), pad(v), scale=scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(n * longest, -1)[valid]


def case(num_seqs: int, longest: int, rng) -> dict:
    lens = np.array([longest if i % 2 == 0 else max(longest // 2, 1) for i in range(num_seqs)], np.int32)
    cu = np.zeros(num_seqs + 1, np.int32)
    np.cumsum(lens, out=cu[1:])
    t = int(cu[-1])
    q, k, v = (mx.array(rng.standard_normal((t, HEADS, DIM), np.float32)) for _ in range(3))
    mx.eval(q, k, v)
    batch = EncoderBatch(cu)
    scale = DIM ** -0.5
    dense = timeit(lambda: mx.eval(dense_attention(q, k, v, cu, scale)))
    paged = timeit(lambda: mx.eval(attention(q, batch.cache(k), batch.cache(v), batch, scale)))
    kc, vc = batch.cache(k), batch.cache(v)
    mx.eval(kc, vc)
    causal = timeit(lambda: mx.eval(ops.paged_attention(q, kc, vc, batch.block_tables, batch.seq_lens,
                                                        batch.cu_seqlens, scale=scale)))
    return {"sequences": num_seqs, "longest": longest, "tokens": t, "dense_ms": 1e3 * dense,
            "paged_ms": 1e3 * paged, "paged_causal_ms": 1e3 * causal}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(0)
    rows = [case(s, n, rng) for s, n in CASES]
    print("| prompts x longest (half at half length) | tokens | dense ms | paged, non-causal ms (shipped) "
          "| paged, causal ms | dense / paged |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['sequences']} x {r['longest']} | {r['tokens']} | {r['dense_ms']:.1f} | {r['paged_ms']:.1f} | "
              f"{r['paged_causal_ms']:.1f} | {r['dense_ms'] / r['paged_ms']:.1f}x |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"heads": HEADS, "head_dim": DIM, "dtype": "float32", "rows": rows},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
