"""The kernels' two thread pools with their cores contended: the attention /
norm kernels' pool (csrc/thread_pool.cpp) and the BLAS shim's few-row pool
(csrc/blas_few_rows.c) let the calling thread take the work of a worker that
has not started yet (its core taken by another process: a server's API
process, a benchmark client), instead of waiting for it. Which thread runs a
piece never changes what it computes: with two processes spinning on the
machine's cores, every result keeps the bits it had on a quiet machine, and
nothing hangs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_SCRIPT = r"""
import subprocess, sys
import vllm_metal  # before mlx.core: the BLAS shim binds MLX's matmuls
import numpy as np, mlx.core as mx
sys.path.insert(0, {tests!r})
from numpy_reference import make_batch
from vllm_metal.native import fast_blas, ops

b = make_batch(np.random.default_rng(3), new_tokens=[1, 1, 1, 1, 5], context_lens=[700, 40, 1300, 9, 300],
               num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=np.float32)
attn = [mx.array(x) for x in (b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.cu_seqlens_q)]
rng = np.random.default_rng(4)
w = mx.array(rng.standard_normal((3000, 576)).astype(np.float32))
xs = [mx.array(rng.standard_normal((m, 576)).astype(np.float32)) for m in (1, 2, 5, 8)]
norm_x = mx.array(rng.standard_normal((700, 576)).astype(np.float32))

def results():
    out = [ops.paged_attention(*attn, scale=b.scale)] + [x @ w.T for x in xs]
    out.append(ops.rms_norm(norm_x, w[0], 1e-5))
    mx.eval(out)
    return [np.array(o) for o in out]

quiet = results()  # the pools' threads are started now
taken = lambda: (fast_blas.shim_calls() or {{}}).get("few_rows_taken_over", 0)

# Two processes spinning on the machine's cores.
hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
try:
    for i in range(100):
        for got, want in zip(results(), quiet):
            assert np.array_equal(got, want), ("hogs", i)
finally:
    for h in hogs:
        h.kill()

# Every thread of this process on one core: a worker can only run when the
# caller stops, so the caller takes its pieces over (most of the time).
import os
for tid in os.listdir("/proc/self/task"):
    os.sched_setaffinity(int(tid), {{sorted(os.sched_getaffinity(0))[0]}})
before = taken()
for i in range(30):
    for got, want in zip(results(), quiet):
        assert np.array_equal(got, want), ("one core", i)
print("taken over:", taken() - before)
print("ok")
"""


def test_results_keep_their_bits_with_the_cores_contended():
    env = {**os.environ, "VLLM_METAL_CPU_THREADS": "2"}
    script = _SCRIPT.format(tests=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    from vllm_metal.native import fast_blas

    if fast_blas.few_rows_supported() and fast_blas.shim_calls() is not None:
        # The few-row products (1-8 rows x 3000 x 576) ran on the pool, and on
        # one core the caller took slices over from its worker.
        assert int(done.stdout.split("taken over:")[1].split()[0]) > 0, done.stdout
