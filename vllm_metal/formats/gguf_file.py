"""A GGUF file's header, metadata and tensor index, read directly (GGUF v2 /
v3, little-endian), with each tensor's bytes a memory-mapped numpy view.

The `gguf` package's GGUFReader builds an object per array element (2 s for
a 49k-token vocabulary); this reads the same fields in a single pass and is
checked against it in tests/formats/test_gguf.py. Bad files (wrong magic,
truncated, offsets past the end) are refused with the reason.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


class GGUFFormatError(ValueError):
    pass


@dataclass
class TensorInfo:
    name: str
    type_name: str  # GGML type: "Q4_K", "F16", ...
    shape: tuple[int, ...]  # numpy order: (..., rows, values per row)
    data: np.ndarray  # F32 / F16: the values; other types: uint8 (..., rows, bytes per row)


class _Cursor:
    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError(f"{self.path}: truncated GGUF header (at byte {self.pos})")
        value = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFFormatError(f"{self.path}: truncated GGUF string (at byte {self.pos})")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            inner, count = self.take("<I"), self.take("<Q")
            if inner == STRING:
                return [self.string() for _ in range(count)]
            if inner not in _NUMPY:
                raise GGUFFormatError(f"{self.path}: GGUF array of unknown type {inner}")
            size = np.dtype(_NUMPY[inner]).itemsize * count
            if self.pos + size > len(self.buf):
                raise GGUFFormatError(f"{self.path}: truncated GGUF array (at byte {self.pos})")
            out = np.frombuffer(self.buf, _NUMPY[inner], count, self.pos).tolist()
            self.pos += size
            return out
        if kind not in _SCALARS:
            raise GGUFFormatError(f"{self.path}: GGUF value of unknown type {kind}")
        return self.take(_SCALARS[kind])


class GGUFFile:
    """metadata: {key: value}; tensors: [TensorInfo] in file order."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise GGUFFormatError(f"{self.path}: cannot map the file ({e})") from e
        cur = _Cursor(memoryview(self._map), self.path)
        if len(self._map) < 24 or bytes(self._map[:4]) != b"GGUF":
            raise GGUFFormatError(f"{self.path}: not a GGUF file (no GGUF magic)")
        cur.pos = 4
        version, n_tensors, n_kv = cur.take("<I"), cur.take("<Q"), cur.take("<Q")
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {version} (read: 2 and 3)")
        self.metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
            infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-cur.pos // align) * align
        self.tensors = []
        for name, dims, kind, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(kind)
            except ValueError as e:
                raise GGUFFormatError(f"{self.path}: tensor {name} has unknown GGML type {kind}") from e
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            shape = tuple(int(d) for d in reversed(dims))
            if not shape or shape[-1] % block:
                raise GGUFFormatError(f"{self.path}: tensor {name} rows of {shape[-1] if shape else 0} values "
                                      f"are not whole {qtype.name} blocks of {block}")
            rows = int(np.prod(shape[:-1], dtype=np.int64))
            row_bytes = shape[-1] // block * type_size
            begin = start + offset
            if begin + rows * row_bytes > len(self._map):
                raise GGUFFormatError(f"{self.path}: tensor {name} runs past the end of the file (truncated?)")
            raw = self._map[begin:begin + rows * row_bytes]
            if qtype.name in ("F32", "F16"):
                data = raw.view(np.float32 if qtype.name == "F32" else np.float16).reshape(shape)
            else:
                data = raw.reshape(*shape[:-1], row_bytes)
            self.tensors.append(TensorInfo(name, qtype.name, shape, data))

    def field(self, key: str, default=None):
        return self.metadata.get(key, default)
