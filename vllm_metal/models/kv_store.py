"""The paged KV cache a step's layers write: per-layer K/V arrays (or a
linear-attention layer's state pools), kept per slot so that layers sharing
one vLLM KV-cache tensor share arrays (LayerArrays), replaced functionally
by each step's writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from vllm_metal.native import ops

if TYPE_CHECKING:
    from vllm_metal.models.attention_adapter import StepAttentionInputs


class LayerArrays:
    """Per-layer cache arrays kept per slot: `arrays[layer]` reads (and
    `arrays[layer] = a` replaces) the array of the layer's slot, so layers
    sharing a slot (one vLLM KV-cache tensor, a layer of each cache group:
    their block ids never overlap) see one array. Without a mapping every
    layer has a slot of its own (a plain list's behaviour)."""

    def __init__(self, arrays, layer_slot: list[int] | None = None):
        self.slots = list(arrays)
        self.layer_slot = list(range(len(self.slots))) if layer_slot is None else list(layer_slot)
        self.sharers = [0] * len(self.slots)
        for s in self.layer_slot:
            self.sharers[s] += 1

    def __len__(self) -> int:
        return len(self.layer_slot)

    def __getitem__(self, layer):
        if isinstance(layer, slice):
            return [self.slots[s] for s in self.layer_slot[layer]]
        return self.slots[self.layer_slot[layer]]

    def __setitem__(self, layer: int, array) -> None:
        self.slots[self.layer_slot[layer]] = array

    def __iter__(self):
        return (self.slots[s] for s in self.layer_slot)

    def __add__(self, other) -> list:
        return list(self) + list(other)

    def __repr__(self) -> str:
        return f"LayerArrays({len(self.slots)} slots for {len(self.layer_slot)} layers)"


@dataclass
class PagedKVCache:
    """The per-layer K/V arrays; layers replace them functionally each step.
    keys[i] / values[i]: layer i's arrays (LayerArrays: layers sharing a vLLM
    KV-cache tensor share them, `layer_slot`)."""

    keys: list[mx.array]
    values: list[mx.array]
    layer_group: list[int]  # KV-cache group of each layer
    step: StepAttentionInputs | None = None
    # Hook for VLLM_METAL_SYNC_PER_LAYER: called with each layer's outputs.
    after_layer: object = field(default=None, repr=False)
    # Arrays a step keeps alive until the next one starts (the state pools'
    # copy write-back, VLLM_METAL_STATE_WRITEBACK=copy); emptied by each forward.
    retained: list = field(default_factory=list, repr=False)
    # vLLM's --kv-cache-dtype: "auto" (caches in the model dtype, `dtype`) or
    # an 8-bit float ("fp8", "fp8_e4m3", "fp8_e5m2": uint8 caches, per-layer
    # scales 1.0 as vLLM's without checkpoint scales; "fp8_per_token_head":
    # each row with its own scale; native/kv_quant.py).
    kv_cache_dtype: str = "auto"
    dtype: mx.Dtype = mx.float32
    # Each layer's slot (an index into keys.slots / values.slots); None: one each.
    layer_slot: list[int] | None = None
    # The last step's verify rows and their candidate linear-attention states
    # (models/draft_states.py), until sampling selects the accepted ones.
    drafts: object = field(default=None, repr=False)

    def __post_init__(self):
        if not isinstance(self.keys, LayerArrays):
            self.keys = LayerArrays(self.keys, self.layer_slot)
        if not isinstance(self.values, LayerArrays):
            self.values = LayerArrays(self.values, self.layer_slot)
        self.layer_slot = self.keys.layer_slot

    def __setattr__(self, name, value):
        if name == "step":  # a new step (or none): no slot written in it yet
            self.__dict__["_written"] = set()
            if value is not None:  # nor candidate states kept (a step that was never sampled leaves none behind)
                self.__dict__["drafts"] = None
        super().__setattr__(name, value)

    def alias_write(self, layer: int) -> bool:
        """Called once by each cache write of a step, before it: True when an
        earlier layer of this step already wrote `layer`'s (shared) slot, so
        this write must take the slot's buffer as an alias (`in_place`: the
        earlier layer's attention, the only reader of the old contents, feeds
        this layer's input and so runs first); False for the slot's first
        writer, which keeps the ordinary donation (or copy)."""
        slot = self.keys.layer_slot[layer]
        if self.keys.sharers[slot] < 2:
            return False
        if slot in self._written:
            return True
        self._written.add(slot)
        return False

    def write(self, layer: int, k: mx.array, v: mx.array, slot_mapping) -> tuple[mx.array, mx.array]:
        """Layer `layer`'s K/V for the step's tokens into its cache (kept)."""
        if self.kv_cache_dtype == "auto":
            k, v = k.astype(self.keys[layer].dtype), v.astype(self.values[layer].dtype)
        kc, vc = ops.write_kv(self.keys[layer], self.values[layer], k, v, slot_mapping,
                              kv_cache_dtype=self.kv_cache_dtype, in_place=self.alias_write(layer))
        self.keys[layer], self.values[layer] = kc, vc
        return kc, vc

    def query(self, q: mx.array) -> tuple[mx.array, dict]:
        """q in the dtype attention runs in, and the attention's cache arguments."""
        if self.kv_cache_dtype == "auto":
            return q.astype(self.dtype), {}
        return q.astype(self.dtype), {"kv_cache_dtype": self.kv_cache_dtype}

    def arrays(self) -> list[mx.array]:
        """Every cache array, each shared one once (layers sharing another's
        cache, and MLA's absent V, hold None)."""
        out = [a for a in self.keys.slots + self.values.slots if a is not None]
        return out + self.drafts.arrays() if self.drafts is not None else out

    def layer_views(self) -> list:
        from vllm_metal.models.attention_adapter import LayerCacheView

        return [LayerCacheView(self, i) for i in range(len(self.keys))]

    def copy_blocks(self, pairs) -> None:
        """Block `dst` of every cache array becomes a copy of block `src`, for
        each (src, dst) pair: vLLM's `kv_cache_block_copies` (its prefix
        cache's copy-on-write of a partially matched block). Functional and
        lazy, like the step's writes: the step's graph starts from the copies.
        Block ids index every group's arrays alike (one pool of ids)."""
        index = np.asarray(pairs, np.int64).reshape(-1, 2)
        src, dst = mx.array(index[:, 0].astype(np.int32)), mx.array(index[:, 1].astype(np.int32))
        for arrays in (self.keys.slots, self.values.slots):  # a shared array once
            for i, a in enumerate(arrays):
                if a is not None:
                    copied = mx.array(a)  # a second handle: `copied[...] =` rebinds it alone
                    copied[dst] = a[src]
                    arrays[i] = copied
