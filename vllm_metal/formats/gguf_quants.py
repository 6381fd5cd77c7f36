"""GGML tensor types -> MLX arrays: kept quantized where MLX's affine
quantization holds the same numbers, re-quantized where it cannot.

MLX affine quantization stores, per group of 32 consecutive input values,
``w = scale * q + bias`` with ``q`` an unsigned integer of 2-8 bits packed
as a little-endian bit stream into uint32 words. The GGML block types whose
numbers are exactly that, group by group, are *kept* (bit-exact: the repacked
tensor dequantizes to the same float32 values as the `gguf` package's
reference dequantization, checked on every tensor at load):

  Q4_0 (w = d*(q-8)), Q4_1 (w = d*q + m), Q5_0, Q5_1, Q8_0 (w = d*q, q
  signed): one group per 32-value block; Q4_K, Q5_K: 8 groups of 32 per
  256-value super-block, w = (d*sc)*q - dmin*m.

The other GGML types have groups of 16 (Q6_K, Q3_K, Q2_K: MLX's smallest
group is 32) or non-linear levels (IQ*): they are dequantized with the `gguf`
package and *re-quantized* to MLX affine at the bits in REQUANT_BITS (the
added error, measured, is in docs/checkpoints.md). F32 / F16 / BF16 stay
floating point. Anything else is refused, naming the type.
"""

from __future__ import annotations

import numpy as np

GROUP = 32  # MLX group size used for every kept or re-quantized GGML tensor

# Kept quantized: type name -> bits of the MLX affine tensor.
EXACT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}
# Re-quantized (lossy): type name -> bits of the MLX affine tensor it becomes.
REQUANT_BITS = {"Q6_K": 8, "Q3_K": 6, "Q2_K": 4, "IQ4_NL": 6, "IQ4_XS": 6, "IQ3_S": 6,
                "IQ3_XXS": 6, "IQ2_S": 5, "IQ2_XS": 5, "IQ2_XXS": 5, "IQ1_S": 4, "IQ1_M": 4}
# Upper bounds of the relative RMS error a re-quantization adds to the file's
# own values, measured on random valid blocks (every level equally likely:
# benchmarks/gguf_requant_loss.py; docs/checkpoints.md). For scale, the GGML
# types' own error on Gaussian weights: ~2% (Q6_K), ~7% (IQ4), ~12% (Q3_K,
# IQ3), ~20-30% (Q2_K, IQ2), more for IQ1.
REQUANT_LOSS = {"Q6_K": 0.005, "Q3_K": 0.015, "Q2_K": 0.055, "IQ4_NL": 0.017, "IQ4_XS": 0.017, "IQ3_S": 0.022,
                "IQ3_XXS": 0.022, "IQ2_S": 0.05, "IQ2_XS": 0.05, "IQ2_XXS": 0.05, "IQ1_S": 0.03, "IQ1_M": 0.08}
FLOAT_TYPES = ("F32", "F16", "BF16")


class UnsupportedTensorType(ValueError):
    pass


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _group_affine(name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-value group (scale, bias) of ``blocks`` (n_blocks, type_size)
    such that the block's values are ``scale * q + bias``, q >= 0."""
    from gguf.quants import Q4_K

    d = _f16(blocks, 0)
    if name in ("Q4_0", "Q5_0", "Q8_0"):  # symmetric: q - 8 / q - 16 / signed int8
        offset = {"Q4_0": 8.0, "Q5_0": 16.0, "Q8_0": 128.0}[name]
        return d[:, None], (-offset * d)[:, None]
    if name in ("Q4_1", "Q5_1"):
        return d[:, None], _f16(blocks, 2)[:, None]
    # Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit (scale, min) pairs for 8 groups
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
    return d[:, None] * sc.astype(np.float32), -(_f16(blocks, 2)[:, None] * mn.astype(np.float32))


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned integers ``q`` (..., n), n a multiple of 32 -> MLX's packed
    uint32 words (..., n * bits / 32): value j at bits [j*bits, (j+1)*bits)
    of the little-endian stream."""
    lead, n = q.shape[:-1], q.shape[-1]
    if bits == 8:
        return np.ascontiguousarray(q, dtype=np.uint8).view(np.uint32)
    if bits == 4:
        pairs = np.asarray(q, np.uint8).reshape(*lead, n // 2, 2)
        return np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4)).view(np.uint32)
    eights = q.astype(np.uint64).reshape(-1, n // 8, 8)
    words = np.zeros(eights.shape[:2], np.uint64)
    for j in range(8):
        words |= eights[..., j] << np.uint64(j * bits)
    stream = words.view(np.uint8).reshape(-1, n // 8, 8)[..., :bits]
    return np.ascontiguousarray(stream).reshape(*lead, n * bits // 32 * 4).view(np.uint32)


def unpack_bits(words: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of pack_bits (for checks and tests)."""
    lead = words.shape[:-1]
    stream = words.view(np.uint8).reshape(-1, words.shape[-1] * 4 // bits, bits)
    padded = np.zeros(stream.shape[:2] + (8,), np.uint8)
    padded[..., :bits] = stream
    chunks = padded.view(np.uint64)[..., 0]
    mask = np.uint64((1 << bits) - 1)
    q = np.stack([(chunks >> np.uint64(j * bits)) & mask for j in range(8)], axis=-1)
    return q.reshape(*lead, -1).astype(np.uint8)


_BLOCKS_PER_CALL = 1 << 16  # bounds the temporaries of one vectorised dequantization


def dequantize(raw: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The `gguf` package's reference float32 values of a tensor (its
    per-type block decoder, called on many blocks at once: the package's
    `dequantize` walks a few rows per Python call)."""
    import gguf

    if name in ("F32", "F16"):
        return np.asarray(raw).astype(np.float32).reshape(shape)
    qtype = gguf.GGMLQuantizationType[name]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(raw).reshape(-1, type_size)
    decoder = getattr(gguf.quants, name)
    out = np.empty((len(blocks), block), np.float32)
    for i in range(0, len(blocks), _BLOCKS_PER_CALL):
        out[i:i + _BLOCKS_PER_CALL] = decoder.dequantize_blocks(blocks[i:i + _BLOCKS_PER_CALL])
    return out.reshape(shape)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., k) bytes -> (..., 2k): the low nibbles, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits_of(packed: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bit `i` of each row of bytes, i < count: (..., count)."""
    return np.unpackbits(packed, axis=-1, count=count, bitorder="little")


def integers(name: str, blocks: np.ndarray) -> np.ndarray:
    """The unsigned quantized integers of a kept type's blocks, in value
    order: (n_blocks, values per block) uint8 (Q8_0: int8 + 128)."""
    if name == "Q8_0":
        return (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    if name in ("Q4_0", "Q4_1"):
        return _nibbles(blocks[:, 2 if name == "Q4_0" else 4:])
    if name in ("Q5_0", "Q5_1"):
        head = 2 if name == "Q5_0" else 4
        return _nibbles(blocks[:, head + 4:]) | (_bits_of(blocks[:, head:head + 4], 32) << 4)
    qs = blocks[:, -128:].reshape(-1, 4, 32)  # Q4_K / Q5_K: 4 chunks of 64 values, 32 bytes each
    q = _nibbles(qs)  # (n, 4, 64): chunk j holds values 64j .. 64j + 63
    if name == "Q5_K":
        qh = _bits_of(blocks[:, 16:48].reshape(-1, 32, 1), 8)  # (n, 32 bytes, 8 bits)
        q = q | (qh.transpose(0, 2, 1).reshape(-1, 4, 64) << 4)  # bit 2j: first 32 of chunk j, 2j+1: rest
    return q.reshape(len(blocks), -1)


def repack_exact(raw: np.ndarray, name: str, shape: tuple[int, ...]):
    """A kept type's tensor (shape: numpy order, last axis the input values)
    -> (weight uint32, scales float32, biases float32) in MLX's layout: the
    same numbers (tests check against the `gguf` package's dequantization)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[name]
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = np.ascontiguousarray(raw).reshape(-1, type_size)
    scale, bias = _group_affine(name, blocks)  # (n_blocks, groups per block)
    lead, n_in = shape[:-1], shape[-1]
    q = integers(name, blocks).reshape(*lead, n_in)
    return (pack_bits(q, EXACT_BITS[name]), scale.reshape(*lead, n_in // GROUP),
            bias.reshape(*lead, n_in // GROUP))


def requantize(raw: np.ndarray, name: str, shape: tuple[int, ...]):
    """A re-quantized type's tensor -> MLX affine at REQUANT_BITS[name] (lossy)."""
    import mlx.core as mx

    w = mx.array(dequantize(raw, name, shape))
    parts = mx.quantize(w, group_size=GROUP, bits=REQUANT_BITS[name])
    mx.eval(parts)  # now, tensor by tensor: the float copy is freed before the next one
    return parts  # MLX arrays (no round trip through numpy)


def kind_of(name: str) -> str:
    """'float', 'kept', 'requantized', or raises UnsupportedTensorType."""
    if name in FLOAT_TYPES:
        return "float"
    if name in EXACT_BITS:
        return "kept"
    if name in REQUANT_BITS:
        return "requantized"
    raise UnsupportedTensorType(name)


def bits_of(name: str) -> int | None:
    return EXACT_BITS.get(name) or REQUANT_BITS.get(name)


def markdown_table() -> str:
    """How each GGML type is served (docs/checkpoints.md; tests keep it in sync)."""
    import gguf

    rows = ["| GGML type | served as | exact | added error (bound, relative RMS) |", "|---|---|---|---|"]
    for name in FLOAT_TYPES:
        rows.append(f"| {name} | floating point (the model dtype) | yes | 0 |")
    for name, bits in EXACT_BITS.items():
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][0]
        rows.append(f"| {name} | MLX affine {bits}-bit, group {GROUP} (blocks of {block} repacked) | yes | 0 |")
    for name, bits in REQUANT_BITS.items():
        rows.append(f"| {name} | MLX affine {bits}-bit, group {GROUP} (re-quantized) | no | "
                    f"{100 * REQUANT_LOSS[name]:.1f}% |")
    rows.append("| any other (TQ1_0, TQ2_0, MXFP4, I8..I64, F64, ...) | refused, naming the tensor and type | | |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
