"""The on-disk format of one saved KV block, and its atomic writer and verified reader.

One file holds one full block of every layer that owns a cache, keyed by
vLLM's block hash. Pure numpy and stdlib (no MLX, no vLLM), so the format,
the checksum and the atomic-write property are tested without an engine.

    header  32 bytes, little-endian: magic b"VMKVBLK1", format version (u32),
            meta length (u32), payload length (u64), payload crc32 (u32),
            meta crc32 (u32)
    meta    UTF-8 JSON: fingerprint, block hash, token count, array layout
    payload each array's block, in the meta's order, raw bytes
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

MAGIC = b"VMKVBLK1"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIQII")
SUFFIX = ".kvblock"
TMP_MARK = ".tmp-"


class BlockFileError(ValueError):
    """A block file that must not be used (the reason says why)."""


@dataclass(frozen=True)
class BlockMeta:
    fingerprint: str  # hex digest of the model and cache layout (see disk_connector.fingerprint)
    block_hash: str  # hex of vLLM's block hash
    num_tokens: int  # tokens in the block (the block size)
    payload_bytes: int  # the size computed in advance from the cache layout

    def encode(self) -> bytes:
        return json.dumps(dict(fingerprint=self.fingerprint, block_hash=self.block_hash,
                               num_tokens=self.num_tokens, payload_bytes=self.payload_bytes),
                          sort_keys=True).encode()


def file_name(fingerprint: str, block_hash: str) -> str:
    """One name per (model, block): different models never share a name."""
    return f"{fingerprint[:16]}-{block_hash}{SUFFIX}"


def write_block_file(path: str | Path, meta: BlockMeta, chunks: Iterable[np.ndarray], tmp_id: int) -> int:
    """Writes `chunks` (numpy views of the cache blocks, written as they are
    with vectored writes: no staging copy) into `path.tmp-<pid>-<tmp_id>`, fsyncs, checks the byte
    count against meta.payload_bytes and renames it to `path`. Any failure
    unlinks the temporary file and re-raises: `path` is either absent or
    complete. Returns the file's size."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}-{tmp_id}")
    meta_bytes = meta.encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            f.write(b"\0" * HEADER.size)  # placeholder: the checksum is known at the end
            f.write(meta_bytes)
            crc, pending, written = 0, [], 0
            for chunk in chunks:
                if not chunk.flags.c_contiguous:
                    raise BlockFileError("a block view is not contiguous")
                data = memoryview(chunk).cast("B")
                crc = zlib.crc32(data, crc)
                pending.append(data)  # a view, not a copy
                if len(pending) == _IOV_BATCH:
                    written += _writev_all(f.fileno(), pending)
                    pending = []
            written += _writev_all(f.fileno(), pending)
            if written != meta.payload_bytes:
                raise BlockFileError(f"wrote {written} payload bytes, expected {meta.payload_bytes}")
            f.seek(0)
            f.write(HEADER.pack(MAGIC, FORMAT_VERSION, len(meta_bytes), written, crc, zlib.crc32(meta_bytes)))
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)
    return HEADER.size + len(meta_bytes) + meta.payload_bytes


_IOV_BATCH = 512  # buffers per writev (POSIX guarantees IOV_MAX >= 16; Linux and macOS allow 1024)


def _writev_all(fd: int, buffers: list[memoryview]) -> int:
    """Writes the buffers in order with vectored writes (one system call for
    many small per-layer views, no gathering copy), resuming short writes."""
    total, i = 0, 0
    while i < len(buffers):
        n = os.writev(fd, buffers[i:i + _IOV_BATCH])
        total += n
        while i < len(buffers) and n >= len(buffers[i]):
            n -= len(buffers[i])
            i += 1
        if n:
            buffers[i] = buffers[i][n:]
    return total


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_meta(f, expected: BlockMeta) -> tuple[int, int]:
    """Reads and checks the header and meta of an open block file against
    `expected` (and the file's size). Returns (payload crc32, payload offset).
    Raises BlockFileError naming what does not match."""
    raw = f.read(HEADER.size)
    if len(raw) < HEADER.size:
        raise BlockFileError(f"{len(raw)} bytes: shorter than the header")
    magic, version, meta_len, payload_len, crc, meta_crc = HEADER.unpack(raw)
    if magic != MAGIC:
        raise BlockFileError("not a vllm-metal KV block file (bad magic)")
    if version != FORMAT_VERSION:
        raise BlockFileError(f"format version {version}, this build reads {FORMAT_VERSION}")
    if meta_len > 1 << 16:
        raise BlockFileError(f"meta length {meta_len} is implausible")
    meta_bytes = f.read(meta_len)
    if len(meta_bytes) != meta_len or zlib.crc32(meta_bytes) != meta_crc:
        raise BlockFileError("the header's metadata is truncated or corrupt")
    try:
        meta = json.loads(meta_bytes)
    except ValueError as e:
        raise BlockFileError(f"unreadable metadata: {e}") from e
    for key, want in (("fingerprint", expected.fingerprint), ("block_hash", expected.block_hash),
                      ("num_tokens", expected.num_tokens), ("payload_bytes", expected.payload_bytes)):
        if meta.get(key) != want:
            raise BlockFileError(f"{key} {meta.get(key)!r} does not match this engine's {want!r} "
                                 "(another model, dtype, block size or cache layout)")
    if payload_len != expected.payload_bytes:
        raise BlockFileError(f"payload length {payload_len}, expected {expected.payload_bytes}")
    size = os.fstat(f.fileno()).st_size
    if size != HEADER.size + meta_len + payload_len:
        raise BlockFileError(f"file is {size} bytes, the header says {HEADER.size + meta_len + payload_len}")
    return crc, HEADER.size + meta_len


def check_header(path: str | Path, expected: BlockMeta) -> None:
    """The cheap check (header, metadata, size; no payload read)."""
    try:
        with open(path, "rb") as f:
            read_meta(f, expected)
    except OSError as e:
        raise BlockFileError(f"unreadable: {e}") from e


def read_block_file(path: str | Path, expected: BlockMeta, targets: Iterable[np.ndarray]) -> None:
    """Reads the payload straight into `targets` (writable, contiguous numpy
    views of the blocks to fill, in the meta's order) and verifies the
    checksum. On BlockFileError the targets hold unspecified bytes: the
    caller must treat those blocks as not loaded."""
    try:
        with open(path, "rb", buffering=0) as f:
            crc_expected, _ = read_meta(f, expected)
            crc, total = 0, 0
            for target in targets:
                data = memoryview(target).cast("B")
                n = 0
                while n < len(data):
                    got = f.readinto(data[n:])
                    if not got:
                        raise BlockFileError("truncated payload")
                    n += got
                crc = zlib.crc32(data, crc)
                total += n
            if total != expected.payload_bytes or f.read(1):
                raise BlockFileError("payload size does not match the cache layout")
    except OSError as e:
        raise BlockFileError(f"unreadable: {e}") from e
    if crc != crc_expected:
        raise BlockFileError("payload checksum mismatch (corrupt file)")


def remove_stale_tmp(directory: str | Path) -> list[str]:
    """Removes `*.tmp-<pid>-<n>` files left by writers that are gone (a
    crash mid-write): those of dead processes, and this process's own.
    Returns the names removed."""
    removed = []
    for entry in os.scandir(directory):
        name = entry.name
        if TMP_MARK not in name:
            continue
        try:
            pid = int(name.rsplit(TMP_MARK, 1)[1].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and _alive(pid):
            continue  # another live process is writing it
        try:
            os.unlink(entry.path)
            removed.append(name)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
