"""MSL executor: runs the real Metal kernels on the CPU, for tests without a Mac.

`Executor(build())` loads the library msl_build.py produces. `launch` runs one
kernel by host name over numpy buffers (the shim self-tests);
`paged_attention` runs msl/paged_attention_driver.cpp, the stand-in for
eval_gpu: same plan, buffer slots, allocation and dispatch order;
`gated_delta` runs msl/gated_delta_driver.cpp, the stand-in for
GatedDelta::eval_gpu; `write_kv` runs msl/write_kv_driver.cpp, the stand-in
for RopeWriteKV::eval_gpu's cache write. Inputs and outputs sit in guarded memory (an
out-of-bounds read faults) and outputs start as NaN (an unwritten element
shows).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from msl_build import ExecutorUnavailable, build  # noqa: F401  (re-exported)


class KernelFault(RuntimeError):
    """The executor stopped a kernel: divergent barrier, bad shuffle, ..."""


DTYPES = {  # name -> (numpy storage dtype, itemsize)
    "float32": (np.float32, 4),
    "float16": (np.float16, 2),
    "bfloat16": (np.uint16, 2),  # bf16 bit patterns
}


def _view(a: np.ndarray) -> tuple[np.ndarray, int, list[int]]:
    """(base buffer, element offset, element strides) of a strided view."""
    base = a
    while isinstance(base.base, np.ndarray):
        base = base.base
    if not base.flags.c_contiguous:
        raise ValueError("views must come from a contiguous base array")
    item = a.itemsize
    offset = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    if offset % item or any(s % item for s in a.strides):
        raise ValueError("unaligned view")
    return base, offset // item, [s // item for s in a.strides]


class Executor:
    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        c = ctypes
        self.lib.msl_launch.argtypes = [
            c.c_char_p, c.POINTER(c.c_void_p), c.POINTER(c.c_uint64), c.c_int,
            c.POINTER(c.c_uint32), c.POINTER(c.c_uint32), c.c_uint64, c.c_int, c.c_int,
            c.c_char_p, c.c_uint64]
        self.lib.vm_paged_attention.argtypes = [
            c.c_char_p, c.c_int, c.POINTER(c.c_int64), c.POINTER(c.c_int64),
            c.POINTER(c.c_void_p), c.POINTER(c.c_uint64), c.POINTER(c.c_int64), c.c_float,
            c.c_int, c.c_float, c.c_int, c.c_int, c.POINTER(c.c_int), c.c_int, c.c_uint64, c.c_int,
            c.c_int, c.c_void_p, c.POINTER(c.c_int64), c.c_char_p, c.c_uint64, c.c_char_p,
            c.c_uint64]
        self.lib.vm_paged_attention_plan.argtypes = [
            c.c_char_p, c.c_int, c.POINTER(c.c_int64), c.POINTER(c.c_int),
            c.POINTER(c.c_int64), c.c_char_p, c.c_uint64, c.c_char_p, c.c_uint64]
        self.lib.vm_decode_shape_table.argtypes = [c.c_int, c.POINTER(c.c_int64)]
        self.lib.msl_kernel_names.argtypes = [c.c_char_p, c.c_uint64]
        self.lib.msl_kernel_names.restype = c.c_uint64
        self.lib.vm_kernel_name.argtypes = [c.c_char_p, c.c_char_p, c.c_int, c.c_int,
                                            c.c_char_p, c.c_uint64]
        self.lib.vm_gated_delta.argtypes = [
            c.c_char_p, c.c_int, c.POINTER(c.c_int64), c.POINTER(c.c_void_p), c.c_int, c.c_int,
            c.c_uint64, c.c_int, c.c_void_p, c.c_void_p, c.POINTER(c.c_int64), c.c_char_p,
            c.c_uint64]
        self.lib.vm_gated_delta_kernel_name.argtypes = [c.c_char_p, c.c_int, c.c_char_p,
                                                        c.c_uint64]
        self.lib.vm_write_kv.argtypes = [
            c.c_char_p, c.c_int, c.POINTER(c.c_int64), c.c_void_p, c.c_int64, c.POINTER(c.c_int64),
            c.c_void_p, c.c_int64, c.POINTER(c.c_int64), c.c_void_p, c.c_void_p, c.c_void_p, c.c_int,
            c.c_int, c.c_uint64, c.c_int, c.POINTER(c.c_int64), c.c_char_p, c.c_uint64]
        self.workers = max(1, min(os.cpu_count() or 1, 4))

    def kernel_names(self) -> set[str]:
        """Host names of every kernel instantiated in the compiled sources."""
        buf = ctypes.create_string_buffer(1 << 16)
        if self.lib.msl_kernel_names(buf, len(buf)) >= len(buf):
            raise RuntimeError("kernel name list truncated")
        return set(buf.value.decode().split())

    def host_kernel_name(self, kind: str, dtype: str, head_dim: int,
                         v_head_dim: int | None = None) -> str:
        """The name eval_gpu looks up (vllm_metal::kernel_name)."""
        buf = ctypes.create_string_buffer(256)
        self.lib.vm_kernel_name(kind.encode(), dtype.encode(), head_dim,
                                head_dim if v_head_dim is None else v_head_dim, buf, len(buf))
        return buf.value.decode()

    def launch(self, kernel: str, buffers: list[np.ndarray | None], grid, group, *,
               seed: int = 0, at_start: bool = False) -> None:
        """Runs `kernel`; buffers (contiguous numpy arrays) are updated in place."""
        c = ctypes
        n = len(buffers)
        for b in buffers:
            if b is not None and not b.flags.c_contiguous:
                raise ValueError("launch buffers must be contiguous")
        ptrs = (c.c_void_p * n)(*[None if b is None else b.ctypes.data for b in buffers])
        sizes = (c.c_uint64 * n)(*[0 if b is None else b.nbytes for b in buffers])
        err = c.create_string_buffer(4096)
        rc = self.lib.msl_launch(kernel.encode(), ptrs, sizes, n, (c.c_uint32 * 3)(*grid),
                                 (c.c_uint32 * 3)(*group), seed, self.workers, int(at_start),
                                 err, len(err))
        if rc != 0:
            raise KernelFault(err.value.decode())

    def paged_attention(self, dtype: str, q, key_cache, value_cache, block_tables, seq_lens,
                        cu_seqlens_q, *, scale: float, sliding_window: int | None = None,
                        softcap: float | None = None, sinks: np.ndarray | None = None,
                        v_head_dim: int | None = None, causal: bool = True, partition_size: int = 0,
                        decode_heads: int = 0, decode_simdgroups: int = 0, decode_tokens: int = 0,
                        seed: int = 0,
                        at_start: bool = False,
                        kernels: tuple[str, ...] = ("decode", "prefill"),
                        cache_format: str | None = None,
                        ) -> tuple[np.ndarray, dict]:
        """Runs the kernels as eval_gpu would; returns (output as float32, plan info).

        Arrays may be any strided numpy views (bfloat16 as uint16 bit patterns;
        sinks float32, which the op casts them to). `kernels` leaves out decode
        (with its reduce) or prefill, to see which rows each writes; rows no
        kernel writes come out NaN. partition_size, decode_heads (1: the
        per-head kernel, else the tier's grouped width), decode_simdgroups and
        decode_tokens (the most tokens per decode threadgroup: the verify
        regime) override the plan's choice when non-zero (PlanOverrides).
        cache_format "fp8e4m3" / "fp8e5m2": the caches are uint8 8-bit floats.
        """
        c = ctypes
        storage, itemsize = DTYPES[dtype]
        has_sinks = sinks is not None
        if not has_sinks:
            sinks = np.zeros(1, np.float32)  # a placeholder the driver does not bind
        inputs = [q, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, sinks]
        cache = np.uint8 if cache_format else storage
        for a, want in zip(inputs, [storage, cache, cache] + [np.int32] * 3 + [np.float32]):
            if a.dtype != want:
                raise TypeError(f"expected {np.dtype(want)}, got {a.dtype}")
        views = [_view(a) for a in inputs]
        num_tokens, num_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        dims = [num_tokens, num_heads, head_dim, num_blocks, block_size, num_kv_heads,
                seq_lens.shape[0], block_tables.shape[1], v_head_dim]
        strides = [s for _, _, st in views for s in st]
        out = np.empty((num_tokens, num_heads, v_head_dim), dtype=storage)
        info = (c.c_int64 * _PLAN_INFO)()
        name = c.create_string_buffer(256)
        err = c.create_string_buffer(4096)
        rc = self.lib.vm_paged_attention(
            (f"{dtype}_{cache_format}" if cache_format else dtype).encode(), itemsize, (c.c_int64 * 9)(*dims),
            (c.c_int64 * 16)(*strides),
            (c.c_void_p * 7)(*[b.ctypes.data for b, _, _ in views]),
            (c.c_uint64 * 7)(*[b.nbytes for b, _, _ in views]),
            (c.c_int64 * 7)(*[o for _, o, _ in views]), scale, sliding_window or 0,
            softcap or 0.0, int(has_sinks), int(causal),
            (c.c_int * 4)(partition_size, decode_heads, decode_simdgroups, decode_tokens), int(at_start),
            seed,
            self.workers, int("decode" in kernels) | 2 * int("prefill" in kernels),
            out.ctypes.data, info, name, len(name), err, len(err))
        if rc != 0:
            raise KernelFault(err.value.decode())
        result = bf16_bits_to_float(out) if dtype == "bfloat16" else out.astype(np.float32)
        return result, _plan_dict(info, name)

    def plan(self, dtype: str, *, num_tokens: int, num_heads: int, num_kv_heads: int,
             head_dim: int, v_head_dim: int | None = None, num_seqs: int,
             block_size: int = 16, max_blocks_per_seq: int = 8, num_blocks: int = 64,
             partition_size: int = 0, decode_heads: int = 0,
             decode_simdgroups: int = 0, decode_tokens: int = 0) -> dict:
        """The launch plan eval_gpu would make for these shapes (nothing runs)."""
        c = ctypes
        dims = [num_tokens, num_heads, head_dim, num_blocks, block_size, num_kv_heads,
                num_seqs, max_blocks_per_seq, head_dim if v_head_dim is None else v_head_dim]
        info = (c.c_int64 * _PLAN_INFO)()
        name = c.create_string_buffer(256)
        err = c.create_string_buffer(4096)
        rc = self.lib.vm_paged_attention_plan(
            dtype.encode(), DTYPES[dtype][1], (c.c_int64 * 9)(*dims),
            (c.c_int * 4)(partition_size, decode_heads, decode_simdgroups, decode_tokens), info, name,
            len(name), err, len(err))
        if rc != 0:
            raise ValueError(err.value.decode())
        return _plan_dict(info, name)

    def decode_shape_table(self) -> list[dict]:
        """kDecodeShapeTable (paged_attention_tuning.h), row by row."""
        row = (ctypes.c_int64 * 7)()
        n = self.lib.vm_decode_shape_table(-1, row)
        rows = []
        for i in range(n):
            self.lib.vm_decode_shape_table(i, row)
            rows.append({"dims": HEAD_DIM_CLASSES[row[0]], "queries": QUERY_CLASSES[row[1]],
                         "batch": BATCH_CLASSES[row[2]], "decode_heads": int(row[3]),
                         "decode_simdgroups": int(row[4]), "partition": bool(row[5]),
                         "decode_tokens": int(row[6])})
        return rows

    def gated_delta_kernel_name(self, dtype: str, key_dim: int) -> str:
        """The name GatedDelta::eval_gpu looks up (vllm_metal::gated_delta_kernel_name)."""
        buf = ctypes.create_string_buffer(256)
        self.lib.vm_gated_delta_kernel_name(dtype.encode(), key_dim, buf, len(buf))
        return buf.value.decode()

    def gated_delta(self, dtype: str, q, k, v, g, beta, state, mask=None, *,
                    in_place: bool = False, seed: int = 0, at_start: bool = False,
                    raw: bool = False) -> tuple[np.ndarray, np.ndarray, dict]:
        """Runs the gated-delta kernel as GatedDelta::eval_gpu would; returns
        (y as float32, final state float32, plan info).

        q, k, v in the storage dtype of `dtype` (bfloat16 as uint16 bit
        patterns), g, beta, state float32, mask bool or None; all made
        row-contiguous here, as the op does. `in_place`: the final state is
        written over the state input's buffer (a donated state). `raw`: y
        comes back in its storage dtype, bit for bit. Elements the kernel
        does not write come out NaN.
        """
        c = ctypes
        storage, itemsize = DTYPES[dtype]
        arrays = [np.ascontiguousarray(a) for a in (q, k, v, g, beta, state)]
        for a, want in zip(arrays, [storage] * 3 + [np.float32] * 3):
            if a.dtype != want:
                raise TypeError(f"expected {np.dtype(want)}, got {a.dtype}")
        if mask is not None:
            mask = np.ascontiguousarray(mask, dtype=np.bool_)
            arrays.append(mask)
        B, T, Hk, Dk = arrays[0].shape
        Hv, Dv = arrays[2].shape[2:]
        y = np.empty((B, T, Hv, Dv), dtype=storage)
        state_out = np.empty((B, Hv, Dv, Dk), dtype=np.float32)
        ptrs = [a.ctypes.data for a in arrays] + ([None] if mask is None else [])
        info = (c.c_int64 * 5)()
        err = c.create_string_buffer(4096)
        rc = self.lib.vm_gated_delta(
            dtype.encode(), itemsize, (c.c_int64 * 6)(B, T, Hk, Hv, Dk, Dv),
            (c.c_void_p * 7)(*ptrs), int(in_place), int(at_start), seed, self.workers,
            y.ctypes.data, state_out.ctypes.data, info, err, len(err))
        if rc != 0:
            raise KernelFault(err.value.decode())
        if not raw:
            y = bf16_bits_to_float(y) if dtype == "bfloat16" else y.astype(np.float32)
        plan = {"grid": tuple(info[:3]), "threads": int(info[3]), "dispatched": bool(info[4])}
        return y, state_out, plan

    def write_kv(self, dtype: str, k, v, slots, key_cache, value_cache, *, in_place: bool = True,
                 seed: int = 0, at_start: bool = False) -> tuple[np.ndarray, np.ndarray, dict]:
        """Runs the KV-cache write kernel as RopeWriteKV::eval_gpu (a table of
        no pairs) would; returns (key_cache', value_cache', plan info), in the
        storage dtype, bit for bit.

        k, v [tokens, heads, dim] in the storage dtype of `dtype`, any views
        of contiguous base arrays (read through their strides, as MLX's
        views are); slots int32 [tokens]; the caches row-contiguous.
        `in_place`: the kernel writes into the input caches' buffers (the
        alias write); else into copies, and the driver checks the inputs
        stay untouched.
        """
        c = ctypes
        storage, itemsize = DTYPES[dtype]
        for a in (k, v, key_cache, value_cache):
            if a.dtype != storage:
                raise TypeError(f"expected {np.dtype(storage)}, got {a.dtype}")
        kc = np.ascontiguousarray(key_cache).copy()
        vc = np.ascontiguousarray(value_cache).copy()
        slots = np.ascontiguousarray(slots, dtype=np.int32)
        (kb, k_off, k_st), (vb, v_off, v_st) = _view(k), _view(v)
        tokens, heads, dim = k.shape
        num_blocks, block_size = kc.shape[:2]
        info = (c.c_int64 * 6)()
        err = c.create_string_buffer(4096)
        rc = self.lib.vm_write_kv(
            dtype.encode(), itemsize, (c.c_int64 * 5)(tokens, heads, dim, num_blocks, block_size),
            kb.ctypes.data + k_off * itemsize, kb.size - k_off, (c.c_int64 * 3)(*k_st),
            vb.ctypes.data + v_off * itemsize, vb.size - v_off, (c.c_int64 * 3)(*v_st),
            slots.ctypes.data, kc.ctypes.data, vc.ctypes.data, int(in_place), int(at_start), seed,
            self.workers, info, err, len(err))
        if rc != 0:
            raise KernelFault(err.value.decode())
        plan = {"grid": tuple(info[:3]), "threads": int(info[3]), "dispatched": bool(info[4]),
                "in_place": bool(info[5])}
        return kc, vc, plan


# The shape classes of paged_attention_tuning.h, by enum value.
HEAD_DIM_CLASSES = ("up_to_128", "256", "large")
QUERY_CLASSES = ("decode", "verify", "prefill")
BATCH_CLASSES = ("small", "large")
_PLAN_INFO = 13  # kPlanInfo in msl/paged_attention_driver.cpp


def _plan_dict(info, name) -> dict:
    return {
        "prefill_dispatched": bool(info[0]), "partitions": int(info[1]),
        "table_row": int(info[2]), "dims": HEAD_DIM_CLASSES[info[3]],
        "queries": QUERY_CLASSES[info[4]], "batch": BATCH_CLASSES[info[5]],
        "decode_heads": int(info[6]), "decode_chunks": int(info[7]),
        "decode_threads": int(info[8]), "decode_grid": (int(info[9]), int(info[10]), int(info[11])),
        "decode_tokens": int(info[12]), "decode_kernel": name.value.decode(),
    }


def float_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Rounds float32 to bfloat16 (nearest even), as bit patterns."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def bf16_bits_to_float(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)
