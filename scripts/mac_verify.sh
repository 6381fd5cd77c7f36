#!/usr/bin/env bash
# Verification on a Mac (Apple Silicon), in one command: builds vllm-metal with
# Metal, runs the Metal kernel tests and the whole test suite on the GPU,
# times the paged-attention and gated-delta kernels, runs the sonnet benchmark
# if the repo has one, and prints one report to paste into an issue.
#
#   scripts/mac_verify.sh
#
# Sets up .venv with scripts/setup.sh (fast when already done) and uses it.
# Steps keep going after a failure; the exit status is non-zero if any step
# failed. Logs stay in the directory printed at the end.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON="$ROOT/.venv/bin/python"
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/vllm-metal-verify.XXXXXX")
REPORT="$LOGS/report.md"
FAILED=0
cd "$ROOT" || exit 1

say() { printf '%s\n' "$*" >>"$REPORT"; }

# step NAME LOGFILE COMMAND...: runs, records PASS/FAIL and the log's tail.
step() {
  local name=$1 log=$LOGS/$2
  shift 2
  echo "== $name" >&2
  local start=$SECONDS
  "$@" >"$log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  if [ $rc -eq 0 ]; then
    say "### PASS: $name (${took}s)"
  else
    say "### FAIL: $name (exit $rc, ${took}s)"
    FAILED=1
  fi
  say '```'
  tail -n "${TAIL:-25}" "$log" >>"$REPORT"
  say '```'
}

say "## vllm-metal Mac verification"
say '```'
{
  echo "date:    $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit:  $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | grep -q . && echo '(with local changes)')"
  echo "macOS:   $(sw_vers -productVersion 2>/dev/null) ($(uname -m))"
  echo "chip:    $(sysctl -n machdep.cpu.brand_string 2>/dev/null)"
  echo "memory:  $(($(sysctl -n hw.memsize 2>/dev/null || echo 0) / 1073741824)) GiB"
  echo "python:  $(python3 --version 2>&1) ($(python3 -c 'import platform; print(platform.machine())' 2>&1))"
} >>"$REPORT"
say '```'

if [ "$(uname -s)" != "Darwin" ]; then
  say "Not a Mac: nothing here runs on Apple hardware. On Linux, run: python -m pytest tests/metal"
  cat "$REPORT"
  exit 1
fi

step "set up .venv and build with Metal (scripts/setup.sh)" setup.log bash scripts/setup.sh

step "native Metal kernel is the GPU attention path" path.log "$PYTHON" -c '
import mlx.core as mx
from vllm_metal.native import ops
print("mlx", mx.__version__, "| metal available:", mx.metal.is_available())
print("device:", mx.metal.device_info())
print("HAS_METAL:", ops._ext.HAS_METAL)
path = ops.attention_path(mx.gpu)
print("gpu attention path:", path)
assert ops._ext.HAS_METAL and path[0] == "metal", "the Metal kernel is not in use"
'

TAIL=15 step "Metal kernel tests on the GPU (tests/metal)" kernel_tests.log \
  env VLLM_METAL_DEVICE=gpu "$PYTHON" -m pytest tests/metal -q -rs

TAIL=40 step "all tests on the GPU, golden tests included (VLLM_METAL_DEVICE=gpu)" all_tests.log \
  env VLLM_METAL_DEVICE=gpu "$PYTHON" -m pytest tests -q -rs

step "paged-attention kernel timings (Metal kernel vs plain-MLX reference)" timings.log \
  "$PYTHON" - <<'EOF'
import time

import mlx.core as mx
import numpy as np

from vllm_metal.native import ops

def batch(num_seqs, context, new, heads=32, kv_heads=8, head_dim=128, v_head_dim=None,
          block=16):
    """float16 inputs; v_head_dim: a latent (MLA) cache, values = its rows' first entries."""
    rng = np.random.default_rng(0)
    blocks = (context + block - 1) // block
    num_blocks = num_seqs * blocks
    q = mx.array(rng.standard_normal((num_seqs * new, heads, head_dim)), dtype=mx.float16)
    k = mx.array(rng.standard_normal((num_blocks, block, kv_heads, head_dim)), dtype=mx.float16)
    v = k if v_head_dim else mx.array(rng.standard_normal((num_blocks, block, kv_heads, head_dim)),
                                      dtype=mx.float16)
    bt = mx.array(rng.permutation(num_blocks).reshape(num_seqs, blocks).astype(np.int32))
    sl = mx.array(np.full(num_seqs, context, np.int32))
    cu = mx.array(np.arange(num_seqs + 1, dtype=np.int32) * new)
    extra = {"v_head_dim": v_head_dim} if v_head_dim else {}
    return (q, k, v, bt, sl, cu), extra

def timed(fn, args, extra, repeat=20):
    mx.eval(fn(*args, scale=0.088, stream=mx.gpu, **extra))
    start = time.perf_counter()
    for _ in range(repeat):
        mx.eval(fn(*args, scale=0.088, stream=mx.gpu, **extra))
    return (time.perf_counter() - start) / repeat * 1e3

# "class": the row of the shape-class table (metal/paged_attention_tuning.h)
# the plan picks (head-dim class, query class / batch class), and how decode
# runs: "N heads/tg" = grouped decode, one threadgroup per KV head computing
# its N query heads from one read of K/V ("x C": the group in C chunks);
# "per head" = one threadgroup, and one read of K/V, per query head.
print(f"{'batch (float16; default 32 q / 8 kv heads, d=128)':54} {'class':34} {'metal ms':>9} "
      f"{'reference ms':>13}")
for name, klass, shape, kw in [
        ("decode: 1 seq x 4096 ctx", "d128 decode/small, 4 heads/tg", (1, 4096, 1), {}),
        ("decode: 64 seqs x 1024 ctx", "d128 decode/large, 4 heads/tg", (64, 1024, 1), {}),
        ("decode: 256 seqs x 512 ctx", "d128 decode/large, 4 heads/tg", (256, 512, 1), {}),
        ("decode: 32 seqs x 2048 ctx, 64 q / 8 kv heads", "d128 decode/small, 8 heads/tg",
         (32, 2048, 1), dict(heads=64)),
        ("decode: 32 seqs x 2048 ctx, 32 q / 32 kv heads", "d128 decode/large, per head",
         (32, 2048, 1), dict(kv_heads=32)),
        ("decode: 16 seqs x 2048 ctx, d=256, 16 q / 4 kv", "d256 decode/small, 4 heads/tg",
         (16, 2048, 1), dict(heads=16, kv_heads=4, head_dim=256)),
        ("decode: 16 seqs x 2048 ctx, MLA 576/512, 16 q / 1 kv",
         "large decode/small, 2 heads/tg x 8",
         (16, 2048, 1), dict(heads=16, kv_heads=1, head_dim=576, v_head_dim=512)),
        ("spec decode: 8 seqs x 1024 ctx x 4 tokens", "d128 short/small, 4 heads/tg",
         (8, 1024, 4), {}),
        ("prefill: 1 seq x 1024 tokens", "d128 prefill/large", (1, 1024, 1024), {}),
        ("prefill: 4 seqs x 512 tokens", "d128 prefill/large", (4, 512, 512), {})]:
    args, extra = batch(*shape, **kw)
    metal = timed(ops.paged_attention, args, extra)
    try:
        ref = f"{timed(ops.paged_attention_reference, args, extra, repeat=3):13.2f}"
    except Exception as e:  # the reference gathers whole contexts: may not fit
        ref = f"{type(e).__name__:>13}"
    print(f"{name:54} {klass:34} {metal:9.2f} {ref}")
EOF

step "gated-delta kernel timings (our Metal kernel vs mlx-lm's)" gated_delta.log \
  "$PYTHON" - <<'EOF'
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.gated_delta import gated_delta_kernel

from vllm_metal.native import ops

def inputs(b, t, hk=16, hv=32, dk=128, dv=128, dtype=mx.bfloat16):
    rng = np.random.default_rng(0)
    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = mx.array(unit((b, t, hk, dk)) * dk ** -0.5, dtype=dtype)
    k = mx.array(unit((b, t, hk, dk)), dtype=dtype)
    v = mx.array(rng.standard_normal((b, t, hv, dv)), dtype=dtype)
    g = mx.array(np.exp(-rng.uniform(0.01, 0.5, (b, t, hv))), dtype=mx.float32)
    beta = mx.array(rng.uniform(0.05, 0.95, (b, t, hv)), dtype=mx.float32)
    state = mx.array(0.3 * rng.standard_normal((b, hv, dv, dk)), dtype=mx.float32)
    return q, k, v, g, beta, state

def timed(fn, args, repeat=20):
    out = fn(*args)
    mx.eval(out)
    start = time.perf_counter()
    for _ in range(repeat):
        mx.eval(fn(*args))
    return (time.perf_counter() - start) / repeat * 1e3, out

ours = lambda *a: ops.gated_delta(*a, stream=mx.gpu)  # noqa: E731
print(f"{'batch (bfloat16, 16 k / 32 v heads, 128 x 128)':48} {'metal ms':>9} {'mlx-lm ms':>10} {'max |dy|':>9}")
for name, shape in [("decode: 1 seq", (1, 1)), ("decode: 64 seqs", (64, 1)),
                    ("prefill: 1 seq x 1024 tokens", (1, 1024)),
                    ("prefill: 4 seqs x 512 tokens", (4, 512))]:
    args = inputs(*shape)
    metal, (y, _) = timed(ours, args)
    ref, (y_ref, _) = timed(gated_delta_kernel, args)
    diff = mx.abs(y.astype(mx.float32) - y_ref.astype(mx.float32)).max().item()
    print(f"{name:48} {metal:9.2f} {ref:10.2f} {diff:9.2g}")
EOF

if [ -f benchmarks/sonnet_bench.py ]; then
  TAIL=30 step "sonnet benchmark (benchmarks/sonnet_bench.py)" sonnet.log \
    env VLLM_METAL_DEVICE=gpu "$PYTHON" benchmarks/sonnet_bench.py
else
  say "### SKIP: sonnet benchmark (benchmarks/sonnet_bench.py is not in this checkout)"
fi

say ""
if [ $FAILED -eq 0 ]; then
  say "**Result: all steps passed.** Full logs: $LOGS"
else
  say "**Result: some steps FAILED.** Full logs: $LOGS"
fi
cat "$REPORT"
exit $FAILED
