"""Every instruction-set build of the 16-lane CPU kernels computes the same thing.

The kernels built on csrc/cpu/simd.h (paged attention, RMSNorm / LayerNorm,
SwiGLU, GELU, ArgmaxHead, RoPE + KV write; and the BLAS shim's one-row product) are compiled
once per instruction set and picked at run time;
VLLM_METAL_CPU_ISA caps the pick, so an AVX-512 host also runs what an
AVX2-only host runs. Each build, run in a subprocess of its own, is checked
against float64 numpy, and the AVX2 and AVX-512 builds against each other to
the bit (both have FMA and the same lane-wise operations and reduction tree:
a row's bits never depend on the host's ISA). The generic build has no FMA,
so it is held to the float64 reference only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numpy_reference import make_batch, paged_attention_f64

# Runs in the subprocess: the ops on fixed data, saved to an .npz file.
_SCRIPT = r"""
import json, sys
import vllm_metal  # before mlx.core: the BLAS shim binds MLX's matmuls (matmul_1row below)
import numpy as np, mlx.core as mx
sys.path.insert(0, {tests!r})
from numpy_reference import make_batch
from vllm_metal.native import ops

out = {{}}
rng = np.random.default_rng(11)
for name, kw, new, ctx in (
    ("mixed", dict(), [37, 1, 1, 5], [37, 60, 1, 700]),
    ("window_softcap_sinks", dict(sliding_window=13, softcap=20.0), [20, 1], [45, 1100]),
):
    b = make_batch(rng, new_tokens=new, context_lens=ctx, num_heads=8, num_kv_heads=2,
                   head_dim=80, block_size=16)
    sinks = mx.array(rng.standard_normal(8).astype(np.float32)) if "softcap" in kw else None
    o = ops.paged_attention(mx.array(b.q), mx.array(b.key_cache), mx.array(b.value_cache),
                            mx.array(b.block_tables), mx.array(b.seq_lens), mx.array(b.cu_seqlens_q),
                            scale=b.scale, sinks=sinks, **kw)
    out["pa_" + name] = np.array(o)
x = rng.standard_normal((5, 579)).astype(np.float32)
w = rng.standard_normal(579).astype(np.float32)
bias = rng.standard_normal(579).astype(np.float32)
out["rms_norm"] = np.array(ops.rms_norm(mx.array(x), mx.array(w), 1e-5))
out["layer_norm"] = np.array(ops.layer_norm(mx.array(x), mx.array(w), mx.array(bias), 1e-5))
g = (rng.standard_normal((3, 1541)) * 4).astype(np.float32)
u = rng.standard_normal((3, 1541)).astype(np.float32)
out["swiglu"] = np.array(ops.swiglu(mx.array(g), mx.array(u)))
out["gelu"] = np.array(ops.gelu(mx.array(g)))
out["gelu_tanh"] = np.array(ops.gelu(mx.array(g), approximate=True))
wm = rng.standard_normal((1031, 579)).astype(np.float32)
out["matmul_1row"] = np.array(mx.array(x[:1]) @ mx.array(wm).T)  # the BLAS shim's one-row kernel
r5 = np.random.default_rng(5)
h, wh = r5.standard_normal((40, 72)).astype(np.float32), r5.standard_normal((3001, 72)).astype(np.float32)
out["argmax_head"] = np.array(ops.argmax_head(mx.array(h), mx.array(wh)))
r7 = np.random.default_rng(7)
qkv = r7.standard_normal((6, 9 * 48)).astype(np.float32)
tab = r7.uniform(-1, 1, (6, 16, 2)).astype(np.float32)
qs, ks, vs = mx.split(mx.array(qkv), [5 * 48, 7 * 48], axis=-1)
qr, kc, vc = ops.rope_write_kv(qs.reshape(6, 5, 48), ks.reshape(6, 2, 48), vs.reshape(6, 2, 48), mx.array(tab),
                               mx.zeros((4, 8, 2, 48)), mx.zeros((4, 8, 2, 48)), [3, -1, 31, 0, 17, 9])
out["rope_write_kv_q"], out["rope_write_kv_k"], out["rope_write_kv_v"] = np.array(qr), np.array(kc), np.array(vc)
np.savez(sys.argv[1], **out)
print(json.dumps(ops._ext.cpu_attention_variant()))
"""


def _run_under(isa: str | None, tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_METAL_CPU_ISA"}
    if isa is not None:
        env["VLLM_METAL_CPU_ISA"] = isa
    path = tmp_path / f"{isa or 'best'}.npz"
    script = _SCRIPT.format(tests=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    variant = json.loads(done.stdout.strip().splitlines()[-1])
    with np.load(path) as z:
        return variant, {k: z[k] for k in z.files}


def _references():
    rng = np.random.default_rng(11)
    ref = {}
    for name, kw, new, ctx in (
        ("mixed", dict(), [37, 1, 1, 5], [37, 60, 1, 700]),
        ("window_softcap_sinks", dict(sliding_window=13, softcap=20.0), [20, 1], [45, 1100]),
    ):
        b = make_batch(rng, new_tokens=new, context_lens=ctx, num_heads=8, num_kv_heads=2,
                       head_dim=80, block_size=16)
        sinks = rng.standard_normal(8).astype(np.float32) if "softcap" in kw else None
        ref["pa_" + name] = paged_attention_f64(b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                                                b.cu_seqlens_q, b.scale, sinks=sinks, **kw)
    x = rng.standard_normal((5, 579)).astype(np.float64)
    w = rng.standard_normal(579).astype(np.float32).astype(np.float64)
    bias = rng.standard_normal(579).astype(np.float32).astype(np.float64)
    x = x.astype(np.float32).astype(np.float64)
    ref["rms_norm"] = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w
    c = x - x.mean(-1, keepdims=True)
    ref["layer_norm"] = c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-5) * w + bias
    g = (rng.standard_normal((3, 1541)) * 4).astype(np.float32).astype(np.float64)
    u = rng.standard_normal((3, 1541)).astype(np.float32).astype(np.float64)
    ref["swiglu"] = g / (1 + np.exp(-g)) * u
    from math import erf

    ref["gelu"] = 0.5 * g * (1 + np.vectorize(erf)(g / np.sqrt(2)))
    ref["gelu_tanh"] = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
    wm = rng.standard_normal((1031, 579)).astype(np.float32).astype(np.float64)
    ref["matmul_1row"] = x[:1] @ wm.T
    r5 = np.random.default_rng(5)
    h, wh = r5.standard_normal((40, 72)).astype(np.float32), r5.standard_normal((3001, 72)).astype(np.float32)
    ref["argmax_head"] = np.argmax(h.astype(np.float64) @ wh.astype(np.float64).T, axis=1)
    r7 = np.random.default_rng(7)
    qkv = r7.standard_normal((6, 9 * 48)).astype(np.float32).astype(np.float64)
    tab = r7.uniform(-1, 1, (6, 16, 2)).astype(np.float32).astype(np.float64)

    def rotate(x):  # pairs (i, i + 16) of the first 32 of 48 dims
        a, b, c, s = x[..., :16], x[..., 16:32], tab[:, None, :, 0], tab[:, None, :, 1]
        return np.concatenate([a * c - b * s, b * c + a * s, x[..., 32:]], axis=-1)

    q, k, v = (qkv[:, :240].reshape(6, 5, 48), qkv[:, 240:336].reshape(6, 2, 48), qkv[:, 336:].reshape(6, 2, 48))
    ref["rope_write_kv_q"] = rotate(q)
    kc, vc = np.zeros((32, 2, 48)), np.zeros((32, 2, 48))
    for t, slot in enumerate([3, -1, 31, 0, 17, 9]):
        if slot >= 0:
            kc[slot], vc[slot] = rotate(k)[t], v[t]
    ref["rope_write_kv_k"], ref["rope_write_kv_v"] = kc.reshape(4, 8, 2, 48), vc.reshape(4, 8, 2, 48)
    return ref


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("isa")
    best, _ = _run_under(None, tmp)
    caps = [c for c in ("avx512", "avx2", "generic") if c == "generic" or best in ("avx2", "avx512")]
    if best == "avx2":
        caps.remove("avx512")
    return {cap: _run_under(cap, tmp) for cap in caps}


def test_each_build_matches_float64(builds):
    ref = _references()
    for cap, (variant, got) in builds.items():
        assert variant == cap
        for name, want in ref.items():
            if name == "argmax_head":  # tokens: exactly float64's
                assert got[name].tolist() == want.tolist(), cap
                continue
            np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=3e-5, err_msg=f"{cap}: {name}")


def test_avx2_and_avx512_builds_agree_to_the_bit(builds):
    if "avx512" not in builds:
        pytest.skip("this host has no AVX-512: only its AVX2 build can run")
    _, a = builds["avx2"]
    _, b = builds["avx512"]
    for name in a:
        if name.startswith("matmul"):
            continue  # the BLAS shim sums in its build's vector width: float64-checked above
        assert np.array_equal(a[name].view(np.uint32), b[name].view(np.uint32)), name
