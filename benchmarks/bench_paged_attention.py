"""Benchmarks the paged-attention primitive on MLX's CPU device (reported, not asserted).

Prints, for decode and prefill shapes, the time per call and the effective KV
bytes read per second beside this machine's measured memory-copy bandwidth,
then a 28-layer write+read graph evaluated once vs with an eval per layer.

`--tiles` instead times the CPU kernel per shape class (decode at batch 1 and
8, short, speculative decoding's verify rows, prefill) for head dims 64, 128 and 256 in float32, sweeping the
prefill rows per tile: the measurements behind the table in
csrc/cpu/paged_attention_tiles.h. `--ext PATH` loads another build of the
extension (e.g. the previous kernel) to compare.

`--decode-stream` times decode as a model step runs it: 30 layers' caches of
their own (8 sequences x 1024 tokens, SmolLM2's 9/3 heads x 64, float32: the
KV comes from memory, not cache), with blocks in order and shuffled, then the
same calls with every block table pointing at one block (the kernel's compute
alone) and numpy reading the same bytes (the memory alone).

    python benchmarks/bench_paged_attention.py [--quick] [--json out.json]
    python benchmarks/bench_paged_attention.py --tiles [--ext old/_ext.so] [--json out.json]
    python benchmarks/bench_paged_attention.py --decode-stream [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time


def _load_ext_override():
    """--ext PATH: import that build of vllm_metal._ext before the package does."""
    if "--ext" not in sys.argv:
        return
    path = sys.argv[sys.argv.index("--ext") + 1]
    from vllm_metal.native import fast_blas

    fast_blas.preload()
    import mlx.core  # noqa: F401  (libmlx first: the other build finds it loaded)

    spec = importlib.util.spec_from_file_location("vllm_metal._ext", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_metal._ext"] = module
    spec.loader.exec_module(module)


_load_ext_override()

from vllm_metal.native import ops  # first: gives MLX the fast BLAS

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # a Llama-3-8B-like layer


def timeit(fn, min_time=0.5, min_reps=3):
    fn()  # warm-up
    reps, start = 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - start < min_time:
        fn()
        reps += 1
    return (time.perf_counter() - start) / reps


def memcpy_bandwidth(nbytes=256 << 20):
    """Read+write bytes per second of a large numpy copy (a STREAM-like copy)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    t = timeit(lambda: np.copyto(dst, src), min_time=1.0)
    return 2 * nbytes / t


def attention_case(num_seqs, context, new_tokens, dtype=mx.float16, rng=np.random.default_rng(0)):
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    kc = mx.array(rng.standard_normal(shape, np.float32)).astype(dtype)
    vc = mx.array(rng.standard_normal(shape, np.float32)).astype(dtype)
    bt = mx.array(rng.permutation(num_blocks).reshape(num_seqs, blocks_per_seq).astype(np.int32))
    sl = mx.array(np.full(num_seqs, context, np.int32))
    cu = mx.array(np.arange(num_seqs + 1, dtype=np.int32) * new_tokens)
    q = mx.array(rng.standard_normal((num_seqs * new_tokens, HEADS, HEAD_DIM), np.float32)).astype(dtype)
    mx.eval(kc, vc, q)
    call = lambda: mx.eval(ops.paged_attention(q, kc, vc, bt, sl, cu, scale=HEAD_DIM ** -0.5))  # noqa: E731
    kv_bytes = 2 * num_seqs * context * KV_HEADS * HEAD_DIM * kc.itemsize
    flops = 4 * num_seqs * new_tokens * HEADS * HEAD_DIM * (context - new_tokens / 2)
    return timeit(call), kv_bytes, flops


def layer_chain(eval_each_layer, layers=28, tokens=8, context=512):
    """A decode step of `tokens` sequences through `layers` write+attend layers."""
    rng = np.random.default_rng(1)
    blocks = -(-context // BLOCK)
    caches = [tuple(mx.zeros((tokens * blocks, BLOCK, KV_HEADS, HEAD_DIM), mx.float16) for _ in range(2))
              for _ in range(layers)]
    mx.eval(caches)
    bt = mx.array(np.arange(tokens * blocks, dtype=np.int32).reshape(tokens, blocks))
    sl = mx.array(np.full(tokens, context, np.int32))
    cu = mx.array(np.arange(tokens + 1, dtype=np.int32))
    slots = (np.arange(tokens) * blocks * BLOCK + context - 1).astype(np.int64)
    x = mx.array(rng.standard_normal((tokens, HEADS, HEAD_DIM), np.float32)).astype(mx.float16)

    def step():
        nonlocal caches
        h = x
        for i in range(layers):
            kv = h[:, :KV_HEADS]
            kc, vc = ops.write_kv(*caches[i], kv, kv, slots)
            caches[i] = (kc, vc)
            h = h + ops.paged_attention(h, kc, vc, bt, sl, cu, scale=HEAD_DIM ** -0.5)
            if eval_each_layer:
                mx.eval(h, kc, vc)
        mx.eval(h, caches)

    return timeit(step)


# Shape classes of the tile table: (heads, kv heads) per head dim, like
# SmolLM2-135M (64), Llama-3-8B (128) and Gemma-2-style (256) layers.
TILE_HEADS = {64: (9, 3), 128: (32, 8), 256: (8, 2)}
TILE_CASES = [  # (name, sequences, new tokens each, context)
    ("decode b1", 1, 1, 1024),
    ("decode b8", 8, 1, 1024),
    ("short b4 x 4", 4, 4, 1024),
    # Speculative decoding's verify rows: the last token plus k drafts (k + 1 = 2, 5, 8), and the
    # long drafts of MTP-style proposers (256), against 1024 cached tokens.
    ("verify b1 x 2", 1, 2, 1024),
    ("verify b1 x 5", 1, 5, 1024),
    ("verify b1 x 8", 1, 8, 1024),
    ("verify b8 x 5", 8, 5, 1024),
    ("verify b1 x 256", 1, 256, 1024),
    ("prefill 1024", 1, 1024, 1024),
]
PREFILL_ROWS = (16, 32, 64, 128, 256)


def tile_case(head_dim, num_seqs, new_tokens, context, rng):
    heads, kv_heads = TILE_HEADS[head_dim]
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, BLOCK, kv_heads, head_dim)
    kc = mx.array(rng.standard_normal(shape, np.float32))
    vc = mx.array(rng.standard_normal(shape, np.float32))
    bt = mx.array(rng.permutation(num_blocks).reshape(num_seqs, blocks_per_seq).astype(np.int32))
    sl = mx.array(np.full(num_seqs, context, np.int32))
    cu = mx.array(np.arange(num_seqs + 1, dtype=np.int32) * new_tokens)
    q = mx.array(rng.standard_normal((num_seqs * new_tokens, heads, head_dim), np.float32))
    mx.eval(kc, vc, q)
    # Causal pairs (row, key) scored: 2 FMAs (QK and PV) x head_dim each.
    pairs = num_seqs * heads * sum(context - new_tokens + t + 1 for t in range(new_tokens))
    call = lambda: mx.eval(ops.paged_attention(q, kc, vc, bt, sl, cu, scale=head_dim ** -0.5))  # noqa: E731
    return call, 4 * pairs * head_dim


def tiles(args):
    ext = ops._ext
    variant = ext.cpu_attention_variant() if hasattr(ext, "cpu_attention_variant") else "previous build"
    print(f"# CPU kernel per shape class ({variant}), float32, block {BLOCK}, GFLOP/s = 4 x head_dim"
          " x causal (row, key) pairs / time")
    print("| head dim | heads/kv | case | rows per tile | ms/call | GFLOP/s |")
    print("|---:|---|---|---|---:|---:|")
    rng = np.random.default_rng(0)
    rows = []
    for head_dim in (64, 128, 256):
        heads, kv_heads = TILE_HEADS[head_dim]
        for name, seqs, new, ctx in TILE_CASES:
            call, flops = tile_case(head_dim, seqs, new, ctx, rng)
            swept = name.startswith("prefill") or name.endswith("x 256")  # the prefill class: rows per tile
            sweep = (0, *PREFILL_ROWS) if swept and hasattr(ext, "set_cpu_tile_override") else (0,)
            for r in sweep:
                if hasattr(ext, "set_cpu_tile_override"):
                    ext.set_cpu_tile_override(r)
                t = timeit(call, min_time=0.3)
                label = "table" if r == 0 else str(r)
                print(f"| {head_dim} | {heads}/{kv_heads} | {name} | {label} | {t * 1e3:.3f} | {flops / t / 1e9:.1f} |")
                rows.append(dict(head_dim=head_dim, case=name, rows_per_tile=r, ms=t * 1e3,
                                 GFLOPs=flops / t / 1e9))
            if hasattr(ext, "set_cpu_tile_override"):
                ext.set_cpu_tile_override(0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"variant": variant, "tiles": rows}, f, indent=2)


def decode_stream(args, layers=30, seqs=8, context=1024, heads=9, kv_heads=3, head_dim=64):
    """Decode attention over caches streamed from memory: compute, memory, and both."""
    rng = np.random.default_rng(0)
    nb = seqs * context // BLOCK
    sl = mx.array(np.full(seqs, context, np.int32))
    cu = mx.array(np.arange(seqs + 1, dtype=np.int32))
    shape = (nb, BLOCK, kv_heads, head_dim)
    caches = []
    for _ in range(layers):
        kc = mx.array(rng.standard_normal(shape, np.float32))
        vc = mx.array(rng.standard_normal(shape, np.float32))
        q = mx.array(rng.standard_normal((seqs, heads, head_dim), np.float32))
        mx.eval(kc, vc, q)
        caches.append((q, kc, vc))
    tables = {"blocks in order": np.arange(nb), "blocks shuffled": rng.permutation(nb),
              "one block (compute alone)": np.zeros(nb)}
    kv_bytes = 2 * nb * BLOCK * kv_heads * head_dim * 4 * layers
    print(f"decode attention, {layers} layers x {seqs} sequences x {context} tokens, {heads}/{kv_heads} heads x "
          f"{head_dim}, float32 ({kv_bytes / 1e6:.0f} MB of KV per step)")
    print("| case | ms per step | KV GB/s |")
    print("|---|---:|---:|")
    out = {"variant": ops._ext.cpu_attention_variant(), "kv_bytes": kv_bytes, "cases": {}}
    for name, table in tables.items():
        bt = mx.array(table.reshape(seqs, -1).astype(np.int32))
        t = timeit(lambda: mx.eval([ops.paged_attention(q, kc, vc, bt, sl, cu, scale=head_dim ** -0.5)
                                    for q, kc, vc in caches]), min_time=1.0)
        print(f"| {name} | {t * 1e3:.2f} | {kv_bytes / t / 1e9:.1f} |")
        out["cases"][name] = t * 1e3
    arrays = [(np.asarray(kc), np.asarray(vc)) for _, kc, vc in caches]
    t = timeit(lambda: [a.sum() + b.sum() for a, b in arrays], min_time=1.0)
    print(f"| numpy reads the same bytes (memory alone) | {t * 1e3:.2f} | {kv_bytes / t / 1e9:.1f} |")
    out["cases"]["numpy read"] = t * 1e3
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--tiles", action="store_true", help="the CPU tile-table sweep instead")
    parser.add_argument("--ext", help="path of another _ext build to load (comparisons)")
    parser.add_argument("--decode-stream", action="store_true",
                        help="decode over 30 layers' caches streamed from memory instead")
    args = parser.parse_args()
    if args.tiles:
        tiles(args)
        return
    if args.decode_stream:
        decode_stream(args)
        return

    bw = memcpy_bandwidth()
    print(f"# {platform.processor() or platform.machine()}, MLX {mx.__version__} on {mx.default_device()}")
    print(f"memcpy bandwidth (read+write): {bw / 1e9:.1f} GB/s\n")
    results = {"memcpy_GBps": bw / 1e9, "decode": [], "prefill": [], "chain": {}}

    seqs = (1, 8, 64) if args.quick else (1, 4, 16, 64)
    contexts = (512, 8192) if args.quick else (512, 2048, 8192)
    print(f"decode (fp16, {HEADS} heads / {KV_HEADS} kv heads, head_dim {HEAD_DIM}, block {BLOCK})")
    print("| seqs | context | ms/call | KV GB/s | % of memcpy |")
    print("|---:|---:|---:|---:|---:|")
    for s in seqs:
        for c in contexts:
            if s * c > 64 * 2048 and args.quick:
                continue
            t, kv_bytes, _ = attention_case(s, c, 1)
            print(f"| {s} | {c} | {t * 1e3:.2f} | {kv_bytes / t / 1e9:.1f} | {100 * kv_bytes / t / bw:.0f}% |")
            results["decode"].append(dict(seqs=s, context=c, ms=t * 1e3, kv_GBps=kv_bytes / t / 1e9))

    print("\nprefill (fp16, one sequence, all tokens new)")
    print("| tokens | ms/call | GFLOP/s |")
    print("|---:|---:|---:|")
    for n in ((128, 512) if args.quick else (128, 512, 2048)):
        t, _, flops = attention_case(1, n, n)
        print(f"| {n} | {t * 1e3:.1f} | {flops / t / 1e9:.1f} |")
        results["prefill"].append(dict(tokens=n, ms=t * 1e3, GFLOPs=flops / t / 1e9))

    once, per_layer = layer_chain(False), layer_chain(True)
    print("\n28-layer write+attend decode step (8 seqs x 512 context)")
    print(f"one eval per step: {once * 1e3:.2f} ms; eval after every layer: {per_layer * 1e3:.2f} ms "
          f"({per_layer / once:.2f}x)")
    results["chain"] = dict(one_eval_ms=once * 1e3, eval_per_layer_ms=per_layer * 1e3)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
