"""AutoAWQ and GPTQ checkpoints repacked at load to MLX affine quantization.

Both store, per linear layer, integer weights q, per-group scales s and
zero points z with w = s * (q - z); MLX's affine form is w = s * q + b with
b = -s * z, the same numbers. The layouts (`qweight`, `qzeros`, `scales`,
`g_idx`; int32 words of 32 / bits values):

  AWQ (AutoAWQ "gemm"): qweight [in, out / 8], values packed along the
      output in the order 0 2 4 6 1 3 5 7; qzeros [in / group, out / 8] the
      same way; scales [in / group, out].
  GPTQ (AutoGPTQ / GPTQModel "gptq" format): qweight [in * bits / 32, out],
      values packed along the input in order; qzeros [in / group, out * bits
      / 32] packed along the output, stored as z - 1 (format "gptq_v2": z);
      scales [in / group, out]; g_idx [in] must be input // group.

`preflight` refuses, naming the config field, what this repack cannot
represent: act-order (`desc_act`), bit widths other than 4 (AWQ) or 4 / 8
(GPTQ), group sizes MLX does not have, AWQ without zero points, other
packing versions. mlx-lm's own AWQ/GPTQ path is not used: it reads GPTQ's
input-packed qweight as if it were AWQ's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vllm_metal.formats.gguf_quants import pack_bits

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # packed position i holds value AWQ_ORDER[i] of each 8
GROUP_SIZES = (32, 64, 128)


class UnsupportedQuantization(ValueError):
    pass


def _refuse(directory: Path, field: str, value, why: str) -> None:
    raise UnsupportedQuantization(f"{directory}: quantization_config.{field} = {value!r}: {why}; serve an "
                                  "unquantized or MLX-quantized checkpoint (mlx_lm.convert -q) instead")


def preflight(directory: Path, config: dict) -> dict:
    """The checked quantization settings {method, bits, group_size, zero_offset}."""
    q = config["quantization_config"]
    method = q["quant_method"]
    bits = q.get("bits", q.get("w_bit"))
    group = q.get("group_size", q.get("q_group_size"))
    allowed = (4,) if method == "awq" else (4, 8)
    if bits not in allowed:
        _refuse(directory, "bits", bits, f"{method.upper()} is served at {' or '.join(map(str, allowed))} bits")
    if group not in GROUP_SIZES:
        _refuse(directory, "group_size", group, f"MLX quantizes in groups of {', '.join(map(str, GROUP_SIZES))}")
    zero_offset = 0
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            _refuse(directory, "version", q.get("version"), "only AutoAWQ's GEMM packing is repacked")
        if q.get("zero_point", True) is False:
            _refuse(directory, "zero_point", False, "AWQ without zero points is not a layout this repack knows")
    else:
        if q.get("desc_act"):
            _refuse(directory, "desc_act", q.get("desc_act"),
                    "act-order GPTQ permutes each layer's input groups, which MLX's grouped quantization cannot")
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            _refuse(directory, "checkpoint_format", fmt, "only the gptq / gptq_v2 packing is repacked")
        zero_offset = 1 if fmt == "gptq" else 0
    return {"method": method, "bits": bits, "group_size": group, "zero_offset": zero_offset}


def _unpack_rows(words: np.ndarray, bits: int, order=None) -> np.ndarray:
    """int32 words (r, c) -> values (r, c * 32 / bits), packed along the last axis."""
    per = 32 // bits
    w = words.astype(np.uint32)
    values = np.stack([(w >> np.uint32(bits * i)) & np.uint32((1 << bits) - 1) for i in range(per)], axis=-1)
    if order is not None:  # packed position i holds value order[i]
        values = values[..., np.argsort(order)]
    return values.reshape(words.shape[0], -1).astype(np.uint8)


def _unpack_cols(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 words (r, c) -> values (r * 32 / bits, c), packed along the first axis."""
    per = 32 // bits
    w = words.astype(np.uint32)
    values = np.stack([(w >> np.uint32(bits * i)) & np.uint32((1 << bits) - 1) for i in range(per)], axis=1)
    return values.reshape(-1, words.shape[1]).astype(np.uint8)


def repack_layer(tensors: dict, settings: dict, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer's (qweight, qzeros, scales[, g_idx]) -> MLX (weight, scales, biases)."""
    bits, group = settings["bits"], settings["group_size"]
    scales = np.asarray(tensors["scales"], np.float32)  # [in / group, out]
    if settings["method"] == "awq":
        q = _unpack_rows(tensors["qweight"], bits, AWQ_ORDER)  # [in, out]
        z = _unpack_rows(tensors["qzeros"], bits, AWQ_ORDER)  # [in / group, out]
    else:
        q = _unpack_cols(tensors["qweight"], bits)  # [in, out]
        z = _unpack_rows(tensors["qzeros"], bits).astype(np.int32) + settings["zero_offset"]
        g_idx = tensors.get("g_idx")
        if g_idx is not None and not np.array_equal(np.asarray(g_idx), np.arange(q.shape[0]) // group):
            raise UnsupportedQuantization(f"{name}.g_idx is not input // group_size ({group}): an act-order "
                                          "layer, which MLX's grouped quantization cannot represent")
    n_in, n_out = q.shape
    if scales.shape != (n_in // group, n_out) or z.shape != scales.shape:
        raise UnsupportedQuantization(f"{name}: qweight {tuple(q.shape)} (unpacked), qzeros {tuple(z.shape)}, "
                                      f"scales {tuple(scales.shape)} do not match group size {group}")
    if z.max(initial=0) > (1 << bits) - 1:
        raise UnsupportedQuantization(f"{name}: a zero point above {(1 << bits) - 1} for {bits}-bit values")
    weight = pack_bits(np.ascontiguousarray(q.T), bits)  # [out, in * bits / 32]
    biases = -(z.astype(np.float32) * scales)
    return weight, np.ascontiguousarray(scales.T), np.ascontiguousarray(biases.T)


def load_weights(directory: Path, config: dict) -> tuple[dict, dict]:
    """(mlx-lm weights, mlx-lm "quantization" entry) of an AWQ / GPTQ directory."""
    import mlx.core as mx

    settings = preflight(directory, config)
    files = sorted(Path(directory).glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no model*.safetensors in {directory}")
    raw = {}
    for f in files:
        raw.update(mx.load(str(f)))
    layers = sorted(k[: -len(".qweight")] for k in raw if k.endswith(".qweight"))
    if not layers:
        raise UnsupportedQuantization(f"{directory}: quant_method {settings['method']!r} but no .qweight tensors")
    weights = {}
    for base in layers:
        parts = {}
        for part in ("qweight", "qzeros", "scales", "g_idx"):
            if f"{base}.{part}" in raw:
                value = raw.pop(f"{base}.{part}")
                parts[part] = np.array(value.astype(mx.float32) if value.dtype in (mx.float16, mx.bfloat16)
                                       else value)
        missing = [p for p in ("qweight", "qzeros", "scales") if p not in parts]
        if missing:
            raise UnsupportedQuantization(f"{directory}: layer {base} has no {', '.join(missing)} "
                                          "(asymmetric quantization needs its zero points)")
        for suffix, value in zip(("weight", "scales", "biases"), repack_layer(parts, settings, base)):
            weights[f"{base}.{suffix}"] = mx.array(value)
    weights.update(raw)  # everything not quantized: embeddings, norms, biases, an unquantized head
    return weights, {"group_size": settings["group_size"], "bits": settings["bits"]}
