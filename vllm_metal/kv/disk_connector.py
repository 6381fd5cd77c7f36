"""vLLM's KV-connector API (KVConnectorBase_V1) over a directory of block files: prefix
blocks survive restarts (docs/kv_disk.md).

Scheduler side: a prompt's full blocks are looked up by vLLM's own block hashes;
those on disk count as computed tokens and are loaded into the blocks vLLM
allocated; every block that becomes fully computed is saved once. Worker side
(driven by MetalModelRunner, not vLLM's GPU runner): loads read each file
straight into the MLX cache arrays before the forward; saves run on a writer
thread (kv/disk_writer.py) behind the step, writing numpy views of the evaluated cache arrays
straight into the file (block_file.write_block_file: temp file, fsync, rename).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                 KVConnectorRole)
from vllm.logger import init_logger

from vllm_metal.kv import block_file
from vllm_metal.kv.block_file import BlockFileError, BlockMeta
from vllm_metal.kv.connector_config import CONNECTOR_NAME
from vllm_metal.kv.disk_writer import DiskWriter, SaveJob
from vllm_metal.kv.layout import array_for, byte_view, cache_layout

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = init_logger("vllm." + __name__)

DEFAULT_MAX_BYTES = 16 << 30


# ---- scheduler -> worker -----------------------------------------------------------


@dataclass
class DiskConnectorMetadata(KVConnectorMetadata):
    # req_id -> [(block id, block hash hex)], in block order
    loads: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    saves: dict[str, list[tuple[int, str]]] = field(default_factory=dict)


class MetalDiskConnector(DiskWriter, KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if not extra.get("path"):
            raise ValueError(f"{CONNECTOR_NAME} needs kv_connector_extra_config.path (a directory)")
        self.directory = Path(extra["path"]).expanduser()
        self.max_bytes = int(extra.get("max_bytes") or DEFAULT_MAX_BYTES)
        self.layout = cache_layout(vllm_config, kv_cache_config)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.block_size = self.layout.block_size
        self._warned: set[str] = set()
        cache_config = vllm_config.cache_config
        if str(cache_config.prefix_caching_hash_algo).startswith("xxhash") and os.getenv("PYTHONHASHSEED") is None:
            logger.warning("vllm-metal disk KV cache: --prefix-caching-hash-algo %s without PYTHONHASHSEED gives "
                           "block hashes that change with every start: saved blocks will not be found after a "
                           "restart (use sha256, the default, or set PYTHONHASHSEED)",
                           cache_config.prefix_caching_hash_algo)
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    def _meta(self, block_hash: str) -> BlockMeta:
        return BlockMeta(self.layout.fingerprint, block_hash, self.block_size, self.layout.payload_bytes)

    def _path(self, block_hash: str) -> Path:
        return self.directory / block_file.file_name(self.layout.fingerprint, block_hash)

    def _reject(self, path: Path, reason: str) -> None:
        """One warning, and the file is removed: never used, and a later save
        of the same block replaces it."""
        if path.name not in self._warned:
            self._warned.add(path.name)
            logger.warning("vllm-metal disk KV cache: skipping %s (%s); its tokens are recomputed", path, reason)
        try:
            path.unlink()
        except OSError:
            pass

    # ==== scheduler side ===========================================================

    def _init_scheduler(self) -> None:
        self._checked: dict[str, tuple[int, int]] = {}  # file name -> (size, mtime_ns) of a good header
        self._load_plans: dict[str, tuple[int, list[str]]] = {}  # req_id -> (first block, hashes on disk)
        self._requests: dict[str, Request] = {}
        self._saved_upto: dict[str, int] = {}  # req_id -> blocks already saved, on disk or planned
        self._pending_loads: dict[str, list[tuple[int, str]]] = {}
        self._saving: dict[str, set[str]] = {}  # req_id -> names it asked the worker to write
        self._inflight: set[str] = set()  # block hashes being written
        self._last_saves: dict[str, tuple[int, list[str]]] = {}  # the last step's: req_id -> (first block, hashes)

    def _on_disk(self, block_hash: str) -> bool:
        """A file with a good header (cheap check, cached per size and mtime;
        the payload checksum is verified when the worker loads it)."""
        path = self._path(block_hash)
        try:
            st = path.stat()
        except OSError:
            self._checked.pop(path.name, None)
            return False
        stamp = (st.st_size, st.st_mtime_ns)
        if self._checked.get(path.name) == stamp:
            return True
        try:
            block_file.check_header(path, self._meta(block_hash))
        except BlockFileError as e:
            self._checked.pop(path.name, None)
            self._reject(path, str(e))
            return False
        self._checked[path.name] = stamp
        return True

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        start = num_computed_tokens // self.block_size
        # Full blocks only, and never the last token: it must be computed to sample.
        limit = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        hashes = []
        for j in range(start, limit):
            h = request.block_hashes[j].hex()
            if not self._on_disk(h):
                break
            hashes.append(h)
        if not hashes:
            self._load_plans.pop(request.request_id, None)
            return 0, False
        self._load_plans[request.request_id] = (start, hashes)
        return len(hashes) * self.block_size, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        req_id = request.request_id
        self._requests[req_id] = request
        plan = self._load_plans.pop(req_id, None)
        if not num_external_tokens or plan is None:
            return
        start, hashes = plan
        count = num_external_tokens // self.block_size
        ids = blocks.get_block_ids()[0]
        self._pending_loads[req_id] = [(ids[start + j], hashes[j]) for j in range(count)]
        self._saved_upto[req_id] = max(self._saved_upto.get(req_id, 0), start + count)

    def build_connector_meta(self, scheduler_output) -> DiskConnectorMetadata:
        meta = DiskConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = {}
        computed = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        computed += list(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, num_computed in computed:
            request = self._requests.get(req_id)
            if request is None:
                continue
            after = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = min(after // self.block_size, len(request.block_hashes))
            start = self._saved_upto.get(req_id, 0)
            if full <= start:
                continue
            self._saved_upto[req_id] = full
            ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            todo = []
            for j in range(start, full):
                h = request.block_hashes[j].hex()
                if h in self._inflight or self._on_disk(h):
                    continue
                self._inflight.add(h)
                todo.append((ids[j], h))
            if todo:
                meta.saves[req_id] = todo
                self._saving.setdefault(req_id, set()).update(h for _, h in todo)
                self._last_saves[req_id] = (start, [h for _, h in todo])
        return meta

    def update_connector_output(self, connector_output) -> None:
        invalid = connector_output.invalid_block_ids
        if invalid:
            # The worker dropped the step's saves (they may have been computed
            # on a block that did not load): plan them again, and the saves of
            # the requests that read a bad block from that block on, once
            # vLLM has recomputed them.
            for req_id, (first, hashes) in self._last_saves.items():
                self._inflight.difference_update(hashes)
                if req_id in self._saved_upto:
                    self._saved_upto[req_id] = min(self._saved_upto[req_id], first)
            for req_id in self._requests:
                ids = self._kv_cache_manager.get_block_ids(req_id)[0]
                bad = next((j for j, b in enumerate(ids) if b in invalid), None)
                if bad is not None and req_id in self._saved_upto:
                    self._saved_upto[req_id] = min(self._saved_upto[req_id], bad)
        self._last_saves = {}
        for req_id in connector_output.finished_sending or ():
            self._inflight.difference_update(self._saving.pop(req_id, ()))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Blocks whose save is still pending stay allocated until the worker
        reports the request in finished_sending."""
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._saved_upto.pop(req_id, None)
        self._load_plans.pop(req_id, None)
        self._pending_loads.pop(req_id, None)
        return req_id in self._saving, None

    # ==== worker side ==============================================================

    def _init_worker(self) -> None:
        removed = block_file.remove_stale_tmp(self.directory)
        if removed:
            logger.info("vllm-metal disk KV cache: removed %d stale temporary files", len(removed))
        self._kv = None
        self._array_index: list[tuple[int, str]] = []  # per payload array: (layer index, "k" / "v")
        self._load_errors: set[int] = set()
        self.failed_load_req_ids: set[str] = set()
        # Instrumentation (tests, logs).
        self.stats = dict(blocks_loaded=0, blocks_saved=0, load_errors=0, save_errors=0, evicted=0,
                          bytes_loaded=0, bytes_saved=0, load_s=0.0, save_s=0.0, fence_wait_s=0.0)
        self._start_writer()

    def register_mlx_cache(self, kv, layer_index: dict[str, int], sliding_windows=()) -> None:
        """The MLX counterpart of register_kv_caches: the runner's PagedKVCache
        (whose arrays it replaces every step) and layer name -> layer index."""
        if any(sliding_windows):
            raise ValueError(f"{CONNECTOR_NAME} cannot serve sliding-window attention layers; serve this "
                             "model without the disk KV cache (drop --kv-transfer-config / VLLM_METAL_KV_DISK)")
        order = []
        for name, arrays in self.layout.layers:
            i = layer_index[name]
            kinds = ["k", "v"][:arrays]
            for kind in kinds:
                a = (kv.keys if kind == "k" else kv.values)[i]
                if a is None or a.shape[1] != self.block_size:
                    raise ValueError(f"{CONNECTOR_NAME}: layer {name} has no {kind} cache of block size "
                                     f"{self.block_size}")
            if arrays == 1 and kv.values[i] is not None:
                raise ValueError(f"{CONNECTOR_NAME}: layer {name} has a V cache its spec does not declare")
            order += [(i, kind) for kind in kinds]
        nbytes = sum(array_for(kv, i, kind)[0].nbytes for i, kind in order)
        if nbytes != self.layout.payload_bytes:
            raise ValueError(f"{CONNECTOR_NAME}: cache arrays hold {nbytes} bytes per block, the layout says "
                             f"{self.layout.payload_bytes}")
        self._kv, self._array_index = kv, order

    def _arrays(self) -> list:
        return [array_for(self._kv, i, kind) for i, kind in self._array_index]

    def handle_preemptions(self, kv_connector_metadata) -> None:
        # A preempted request's blocks are reused only by a later cache write
        # or load, both of which fence first: nothing to do here.
        return None

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self.fence()
        self.failed_load_req_ids = set()
        meta = self._get_connector_metadata()
        if not meta.loads:
            return
        start = time.perf_counter()
        views = [byte_view(a) for a in self._arrays()]
        for req_id, blocks in meta.loads.items():
            for n, (block_id, block_hash) in enumerate(blocks):
                path = self._path(block_hash)
                try:
                    block_file.read_block_file(path, self._meta(block_hash), (v[block_id] for v in views))
                except BlockFileError as e:
                    self._reject(path, str(e))
                    with self._lock:
                        self._index.pop(path.name, None)
                    # vLLM truncates the request's computed tokens at the first
                    # bad block and recomputes from there.
                    self._load_errors.update(b for b, _ in blocks[n:])
                    self.failed_load_req_ids.add(req_id)
                    self.stats["load_errors"] += 1
                    break
                self.stats["blocks_loaded"] += 1
                self.stats["bytes_loaded"] += self.layout.payload_bytes
                self._touch(path)
        del views
        self.stats["load_s"] += time.perf_counter() - start

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are synchronous, before the forward

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None  # whole blocks are saved after the step's evaluation (wait_for_save)

    def wait_for_save(self) -> None:
        """Queues this step's saves (the arrays are evaluated); the writer
        thread writes them while the engine samples and schedules."""
        meta = self._get_connector_metadata()
        if not meta.saves:
            return
        # Queued even when not written (saving stopped, or a load failed this
        # step: blocks computed after a bad block would be wrong, and the
        # scheduler plans the saves again), so the request is still reported
        # in finished_sending and its blocks freed.
        arrays = self._arrays() if self.saving_enabled and not self.failed_load_req_ids else None
        for req_id, blocks in meta.saves.items():
            with self._lock:
                self._outstanding[req_id] = self._outstanding.get(req_id, 0) + 1
            self._queue.put(SaveJob(req_id, blocks, arrays))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose saves are all written, once each has finished."""
        with self._lock:
            self._finished.update(r for r in finished_req_ids if r in self._outstanding)
            done = {r for r in self._finished if self._outstanding[r] == 0}
            for r in done:
                del self._outstanding[r]
            self._finished -= done
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER and self._writer.is_alive():
            self.fence()
            self._queue.put(None)
            self._writer.join(timeout=60)
