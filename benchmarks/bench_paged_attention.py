"""Benchmarks the paged-attention primitive on MLX's CPU device (reported, not asserted).

Prints, for decode and prefill shapes, the time per call and the effective KV
bytes read per second beside this machine's measured memory-copy bandwidth,
then a 28-layer write+read graph evaluated once vs with an eval per layer.

`--tiles` instead times the CPU kernel per shape class (decode at batch 1 and
8, short, speculative decoding's verify rows, prefill) for head dims 64, 128 and 256 in float32, sweeping the
prefill rows per tile: the measurements behind the table in
csrc/cpu/paged_attention_tiles.h. `--ext PATH` loads another build of the
extension (e.g. the previous kernel) to compare.

`--shapes` times the CPU kernel per shape class with the tile before and
after the verify entries of the tile table side by side: long prefill, chat
prefill, speculative decoding's verify rows (2, 5 and 8 new tokens per
sequence at 1024 and 8192 cached tokens, batch 1 to 32, sliding window off
and on) and chunked prefill at batch 8, 16 and 32, for head dims 64, 128,
256 and 512 in float32. Without --quick it also sweeps every verify tile
(tokens per tile x KV heads per unit) the table chose from. Times are the
fastest of several interleaved rounds (the candidates of a shape take turns),
so a busy machine inflates them less.

`--decode-stream` times decode as a model step runs it: 30 layers' caches of
their own (8 sequences x 1024 tokens, SmolLM2's 9/3 heads x 64, float32: the
KV comes from memory, not cache), with blocks in order and shuffled, then the
same calls with every block table pointing at one block (the kernel's compute
alone) and numpy reading the same bytes (the memory alone).

    python benchmarks/bench_paged_attention.py [--quick] [--json out.json]
    python benchmarks/bench_paged_attention.py --tiles [--ext old/_ext.so] [--json out.json]
    python benchmarks/bench_paged_attention.py --decode-stream [--json out.json]
    python benchmarks/bench_paged_attention.py --shapes [--quick] [--json out.json]   # < 3 min with --quick
    VLLM_METAL_CPU_THREADS=1 python benchmarks/bench_paged_attention.py --shapes --quick --cpu-time  # a busy host

`--shapes` options: --cpu-time times by the process's CPU time (with one
kernel thread, the kernel's own work, which other jobs on the machine
inflate far less than wall time); --only CLASS, --head-dims 256,512 and
--sweep (the verify tile sweep with --quick) narrow a tuning run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone


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


# ---- --shapes: every shape class, the tile before and after the verify entries ----------------

# (heads, kv heads) per head dim: SmolLM2-135M (64), Llama-3-8B (128), Gemma-2-style (256) and a
# Gemma-4-style global layer (512) -- groups 3, 4, 4 and 8.
SHAPE_HEADS = {64: (9, 3), 128: (32, 8), 256: (8, 2), 512: (16, 2)}
SHAPE_WINDOW = 512  # the windowed rows' sliding window (Gemma-3-1B's)
# The verify tile before the table had verify entries: all of a sequence's tokens (64 rows, every
# GQA group up to 8) on one KV head per unit. As set_cpu_tile_override's (verify_tokens,
# verify_kv_heads): 8 = all tokens, 1 = one KV head.
OLD_VERIFY = (8, 1)
VERIFY_SWEEP = [(t, h) for t in (1, 2, 4, 8) for h in (1, 2)]  # h 2: all KV heads of the tile


def shape_list(quick):
    """(class, case, sequences, new tokens each, cached tokens before them, window)."""
    shapes = [("long prefill", "1 x 2048 new", 1, 2048, 0), ("chat prefill", "1 x 256 new", 1, 256, 0)]
    verify = [(1024, 1), (1024, 8), (1024, 32), (8192, 1), (8192, 8)]
    for prefix, seqs in verify:
        for new in ((5,) if quick else (2, 5, 8)):
            shapes.append((f"verify {prefix // 1024}k", f"b{seqs} x {new}", seqs, new, prefix))
    for seqs in (8, 16, 32):  # a 1024-token budget shared by the batch, each chunk after 1024 cached tokens
        shapes.append(("chunked prefill", f"b{seqs} x {1024 // seqs}", seqs, 1024 // seqs, 1024))
    return [(*sh, w) for sh in shapes for w in (None, SHAPE_WINDOW)]


def tile_label(tile):
    t, h = tile
    return f"{'all' if t >= 8 else t} tok x {'all' if h > 1 else 1} kv"


def table_verify_tile(head_dim, seqs):
    """The table's verify tile as a label (builds without the hook: 'table')."""
    ext = ops._ext
    if not hasattr(ext, "cpu_verify_tile"):
        return "table"
    t, h = ext.cpu_verify_tile(head_dim, seqs)
    return tile_label((t if t > 0 else 8, 2 if h == 0 else 1))


def shape_call(head_dim, caches, seqs, new, prefix, window, rng):
    heads, _ = SHAPE_HEADS[head_dim]
    kc, vc = caches
    context = prefix + new
    per_seq = -(-context // BLOCK)
    bt = mx.array(rng.permutation(kc.shape[0])[:seqs * per_seq].reshape(seqs, per_seq).astype(np.int32))
    sl = mx.array(np.full(seqs, context, np.int32))
    cu = mx.array(np.arange(seqs + 1, dtype=np.int32) * new)
    q = mx.random.normal((seqs * new, heads, head_dim))
    mx.eval(q, bt)
    call = lambda: mx.eval(ops.paged_attention(q, kc, vc, bt, sl, cu, scale=head_dim ** -0.5,  # noqa: E731
                                               sliding_window=window))
    return call


def fastest(calls, rounds, clock=time.perf_counter):
    """{name: fastest seconds per call}: the calls take turns, `rounds` times; each turn times
    enough calls back to back (the same count every round) to last about 2 ms: short samples,
    so that some of them run without being preempted on a busy machine. clock: wall time, or
    the process's CPU time (--cpu-time: what the calls cost the cores, preemption left out)."""
    set_tile = ops._ext.set_cpu_tile_override
    reps = {}
    for name, (tile, call) in calls.items():
        set_tile(*tile)
        call()  # warm-up (scratch, thread pool)
        t0 = time.perf_counter()
        call()
        reps[name] = max(1, int(0.002 / max(time.perf_counter() - t0, 1e-6)))
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, (tile, call) in calls.items():
            set_tile(*tile)
            t0 = clock()
            for _ in range(reps[name]):
                call()
            best[name] = min(best[name], (clock() - t0) / reps[name])
    set_tile()
    return best


def _meta(quick, rounds, cpu_time):
    def run(*cmd):
        return subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(__file__)).stdout.strip()

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=run("git", "rev-parse",
                "--short", "HEAD") + ("+dirty" if run("git", "status", "--porcelain", "--untracked-files=no") else ""),
                cpu=cpu, cores=os.cpu_count(), variant=ops._ext.cpu_attention_variant(), quick=quick,
                rounds=rounds, load_before=os.getloadavg()[0],
                threads=os.environ.get("VLLM_METAL_CPU_THREADS") or f"{os.cpu_count()} (default)",
                clock="process CPU time" if cpu_time else "wall", load_after=None, complete=False)


def shapes(args):
    rounds = 4 if args.quick else 7
    quick = args.quick and not args.sweep  # the table's columns: no sweep column
    meta = _meta(quick, rounds, args.cpu_time)
    clock = time.process_time if args.cpu_time else time.perf_counter
    rng = np.random.default_rng(0)
    started, rows = time.perf_counter(), []
    print(f"# CPU kernel per shape class ({meta['variant']}, {meta['cpu']}), float32, block {BLOCK}; "
          f"fastest of {rounds} interleaved rounds, {meta['clock']}, kernel threads: {meta['threads']}")
    print("| class | case | head dim | heads/kv | window | old tile | ms | new tile | ms | new/old |"
          + ("" if quick else " fastest swept |"))
    print("|---|---|---:|---|---:|---|---:|---|---:|---:|" + ("" if quick else "---|"))
    shape_rows = [sh for sh in shape_list(args.quick) if sh[0].startswith(args.only or "")]
    dims = [int(d) for d in args.head_dims.split(",")] if args.head_dims else list(SHAPE_HEADS)
    for head_dim, (heads, kv_heads) in ((d, SHAPE_HEADS[d]) for d in dims):
        blocks = max(seqs * -(-(prefix + new) // BLOCK) for _, _, seqs, new, prefix, _ in shape_rows)
        caches = tuple(mx.random.normal((blocks, BLOCK, kv_heads, head_dim)) for _ in range(2))
        mx.eval(caches)
        for cls, case, seqs, new, prefix, window in shape_rows:
            call = shape_call(head_dim, caches, seqs, new, prefix, window, rng)
            verify = cls.startswith("verify")
            calls = {"table": ((0, 0, 0), call)}
            new_label = table_verify_tile(head_dim, seqs) if verify else "table (unchanged)"
            changed = verify and new_label != tile_label(OLD_VERIFY)
            if changed:
                calls["old"] = ((0, *OLD_VERIFY), call)
            if verify and (args.sweep or not args.quick):
                calls.update({tile_label(t): ((0, *t), call) for t in VERIFY_SWEEP})
            # A class whose tile did not change is timed once (fewer rounds with --quick).
            best = fastest(calls, rounds if changed or not args.quick else 2, clock)
            old_ms = best.get("old", best["table"]) * 1e3
            row = dict(cls=cls, case=case, head_dim=head_dim, heads=heads, kv_heads=kv_heads, seqs=seqs, new=new,
                       prefix=prefix, window=window, old_tile=tile_label(OLD_VERIFY) if verify else "table",
                       same_tile=not changed, old_ms=old_ms, new_tile=new_label, new_ms=best["table"] * 1e3,
                       swept={k: v * 1e3 for k, v in best.items() if k not in ("table", "old")})
            rows.append(row)
            print(render_row(row, quick), flush=True)
            if args.json:  # after every row: an interrupted run keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(dict(meta=meta, rows=rows), f, indent=2)
        del caches
    meta.update(load_after=os.getloadavg()[0], seconds=time.perf_counter() - started, complete=True)
    report = dict(meta=meta, rows=rows)
    print(f"\n{meta['seconds']:.0f} s; load average {meta['load_before']:.1f} before, {meta['load_after']:.1f} after")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def render_row(row, quick):
    cells = [row["cls"], row["case"], row["head_dim"], f"{row['heads']}/{row['kv_heads']}", row["window"] or "off",
             row["old_tile"], f"{row['old_ms']:.3g}", row["new_tile"], f"{row['new_ms']:.3g}",
             "same tile" if row.get("same_tile") else f"{row['new_ms'] / row['old_ms']:.2f}"]
    if not quick:
        swept = row["swept"]
        cells.append(f"{min(swept, key=swept.get)} ({min(swept.values()):.3g})" if swept else "")
    return "| " + " | ".join(str(c) for c in cells) + " |"


def render(report):
    """The --shapes table of a raw file, in Markdown (benchmarks/summaries.py's `_script`)."""
    m = report["meta"]
    quick = m["quick"]
    head = (f"{m['date']}, vllm-metal at `{m['commit']}`, {m['cpu']} ({m['cores']} cores), {m['variant']} build; "
            f"float32, block {BLOCK}; milliseconds per call ({m['clock']}; kernel threads: {m['threads']}), the "
            f"fastest of {m['rounds']} interleaved rounds (2 where the tile did not change) "
            f"(load average {m['load_before']:.1f} before, {m['load_after'] or float('nan'):.1f} after). Old tile: "
            "the verify tile "
            "before the table had verify entries; prefill classes kept theirs. same tile: the table kept the old "
            "tile for that shape (timed once).")
    lines = [head, "", "| class | case | head dim | heads/kv | window | old tile | ms | new tile | ms | new/old |"
             + ("" if quick else " fastest swept |"),
             "|---|---|---:|---|---:|---|---:|---|---:|---:|" + ("" if quick else "---|")]
    lines += [render_row(r, quick) for r in report["rows"]]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="fewer shapes (--shapes: verify at 5 new tokens only, 4 rounds)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--tiles", action="store_true", help="the CPU tile-table sweep instead")
    parser.add_argument("--ext", help="path of another _ext build to load (comparisons)")
    parser.add_argument("--decode-stream", action="store_true",
                        help="decode over 30 layers' caches streamed from memory instead")
    parser.add_argument("--shapes", action="store_true",
                        help="every shape class with the old and the new tile instead (--quick: < 3 min)")
    parser.add_argument("--only", help="--shapes: only the classes starting with this (e.g. verify)")
    parser.add_argument("--head-dims", help="--shapes: only these head dims (comma-separated)")
    parser.add_argument("--sweep", action="store_true", help="--shapes --quick: sweep the verify tiles too")
    parser.add_argument("--cpu-time", action="store_true",
                        help="--shapes: time by the process's CPU time, not wall time (a busy machine; "
                             "with VLLM_METAL_CPU_THREADS=1 it is the kernel's own work)")
    args = parser.parse_args()
    if args.shapes:
        shapes(args)
        return
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
