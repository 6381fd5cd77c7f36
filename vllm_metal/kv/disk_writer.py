"""The worker side's writes for the disk KV connector (kv/disk_connector.py):
a writer thread that writes the queued blocks behind the step, and the LRU
index of the directory's block files, evicted past max_bytes.

`DiskWriter` is a base class of MetalDiskConnector: it uses the connector's
`directory`, `max_bytes`, `stats`, `_path(hash)` and `_meta(hash)`.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from vllm.logger import init_logger

from vllm_metal.kv import block_file
from vllm_metal.kv.layout import byte_view

logger = init_logger("vllm.vllm_metal.kv.disk_connector")


@dataclass
class SaveJob:
    req_id: str
    blocks: list[tuple[int, str]]
    arrays: list | None  # the evaluated MLX cache arrays, in layout order (released after writing)


class DiskWriter:
    """Saves on a writer thread, and the LRU index it evicts from."""

    def _start_writer(self) -> None:
        # LRU index of this directory's block files: name -> [size, last access]
        self._index: dict[str, list[float]] = {}
        for entry in os.scandir(self.directory):
            if entry.name.endswith(block_file.SUFFIX):
                st = entry.stat()
                self._index[entry.name] = [st.st_size, st.st_atime]
        self._lock = threading.Lock()
        self._queue: queue.Queue[SaveJob | None] = queue.Queue(maxsize=64)
        self._outstanding: dict[str, int] = {}  # req_id -> save jobs not yet written
        self._finished: set[str] = set()  # finished requests with saves
        self.saving_enabled = True
        self._tmp_counter = 0
        self._writer = threading.Thread(target=self._writer_loop, name="vllm-metal-kv-disk", daemon=True)
        self._writer.start()

    def fence(self) -> None:
        """Waits for saves in flight. They write from numpy views of the cache
        arrays; the next step's in-place cache write (MLX donates the buffer
        only when nothing else references it) and any load must come after."""
        start = time.perf_counter()
        self._queue.join()
        self.stats["fence_wait_s"] += time.perf_counter() - start

    def _writer_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write_job(job)
            finally:
                if job is not None:
                    job.arrays = None  # release the cache arrays before the fence opens
                    with self._lock:
                        self._outstanding[job.req_id] -= 1
                self._queue.task_done()

    def _write_job(self, job: SaveJob) -> None:
        if not self.saving_enabled or job.arrays is None:
            return
        start = time.perf_counter()
        views = [byte_view(a) for a in job.arrays]
        try:
            for block_id, block_hash in job.blocks:
                path = self._path(block_hash)
                self._tmp_counter += 1
                try:
                    size = block_file.write_block_file(path, self._meta(block_hash), (v[block_id] for v in views),
                                                       self._tmp_counter)
                except OSError as e:
                    self.stats["save_errors"] += 1
                    self.saving_enabled = False
                    what = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else str(e)
                    logger.warning("vllm-metal disk KV cache: saving stopped (%s); serving goes on, "
                                   "saved blocks are still loaded", what)
                    return
                except Exception as e:  # noqa: BLE001 -- a save must never take the engine down
                    self.stats["save_errors"] += 1
                    logger.warning("vllm-metal disk KV cache: could not save %s: %s", path.name, e)
                    continue
                self.stats["blocks_saved"] += 1
                self.stats["bytes_saved"] += size
                with self._lock:
                    self._index[path.name] = [size, time.time()]
                self._evict()
        finally:
            del views
            self.stats["save_s"] += time.perf_counter() - start

    def _touch(self, path: Path) -> None:
        now = time.time()
        try:  # atime = last use (the LRU order after a restart)
            os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns))
        except OSError:
            pass
        with self._lock:
            if path.name in self._index:
                self._index[path.name][1] = now

    def _evict(self) -> None:
        with self._lock:
            total = sum(size for size, _ in self._index.values())
            if total <= self.max_bytes:
                return
            victims = []
            for name, (size, _) in sorted(self._index.items(), key=lambda kv: kv[1][1]):
                if total <= self.max_bytes:
                    break
                victims.append(name)
                total -= size
            for name in victims:
                del self._index[name]
        for name in victims:
            try:
                os.unlink(self.directory / name)
                self.stats["evicted"] += 1
            except OSError:
                pass
