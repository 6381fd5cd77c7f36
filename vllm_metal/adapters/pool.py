"""The loaded adapters, and each step's deltas for the rows that use them.

vLLM's scheduler caps the adapters of one step at `--max-loras` and names
each request's adapter (LoRARequest) in its output; the worker loads adapters
when vLLM's engine adds them (`--lora-modules`, /v1/load_lora_adapter) or when
a request first names one, and keeps up to `--max-cpu-loras` of them, least
recently used out first, pinned ones never.

A loaded adapter keeps, per site (lora_sites.py) it targets, A [in, R] and
B [R, out] (the scale folded in; for a fused site B has zeros outside the
member's columns, R sums the members' ranks). A and B are stored transposed,
as a Linear's weight is: on MLX's CPU device their products then take the
BLAS shim's few-row kernel like every other projection (native/fast_blas.py)
instead of OpenBLAS's packing path, whose worker threads then contend with
the shim's (a batch-8 decode step of SmolLM2 with four adapters: 119 -> 74 ms,
base 54 ms). Adapters that run together sit
in *slots* (at most --max-loras, vLLM's per-step limit), packed per site by
concatenation, A_cat [in, sum R] and B_cat [sum R, out]; the pack is rebuilt
only when the slots' occupants change (a slot swap), never because a batch
mixes them differently. Every token carries its row's slot (-1: the base
model), and the delta of a site is

    ((x @ A_cat) * mask) @ B_cat,   mask[t, c] = 1 where column c is token t's slot's

so every row gets exactly its adapter's x @ A @ B * scale and a base row an
exact zero, added to the base projection with one fused multiply-add
(addmm), inside the step's one graph, whatever mix the batch holds. Another
request's adapter, or which slot it sits in, contributes exact zeros to a
row: a slot swap cannot change it. A step running one adapter uses that
adapter's own arrays (no slot pack), and no mask at all when every row runs it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from vllm_metal.adapters import lora_sites
from vllm_metal.adapters.adapter_files import AdapterWeights, read_adapter, refusal

# Projections the paged path never computes, and why (an adapter naming one is refused).
ABSORBED = {"kv_b_proj": "latent attention (MLA) absorbs kv_b_proj into its query and output matrices at load, "
                         "so an adapter on it is not served"}


@dataclass
class LoadedAdapter:
    request: object  # the LoRARequest it was loaded for
    sites: dict[int, tuple[mx.array, mx.array]]  # site -> (A^T [R, in], (B * scale)^T [out, R])
    nbytes: int


@dataclass
class StepAdapters:
    active: tuple[int, ...]  # adapter ids
    pack: dict  # site -> (A_cat, B_cat, column layout): the slots' pack, or the one adapter's arrays
    token_slot: mx.array  # [tokens] int32, -1 for base rows
    tokens: int
    uniform: bool  # every token runs the one active adapter: no mask needed
    masks: dict = field(default_factory=dict)  # column layout -> [tokens, R] mask


class AdapterPool:
    def __init__(self, model, dtype: mx.Dtype, max_rank: int, max_loras: int, capacity: int):
        self.dtype = dtype
        self.max_rank = max_rank
        self.max_loras = max_loras
        self.capacity = max(capacity, max_loras)
        self.sites, self.targets = lora_sites.install(model, self)
        self.loaded: OrderedDict[int, LoadedAdapter] = OrderedDict()  # least recently used first
        self.pinned: set[int] = set()
        self.slots: list[int] = []  # adapter ids in slot order (at most max_loras)
        self._slot_pack: dict | None = None  # site -> (A_cat, B_cat, layout) of the slots' occupants
        self._single: dict[int, dict] = {}  # adapter id -> its own arrays as a pack
        self._used: dict[int, int] = {}  # adapter id -> the last step that ran it
        self._steps = 0
        self.repacks = 0  # slot packs built (instrumentation: a slot swap makes one)
        self.step: StepAdapters | None = None
        self.tracing = False
        self.called: set[int] = set()
        self.loads = 0  # adapters read from disk (instrumentation: evictions make reloads)

    # ---- sites -------------------------------------------------------------

    def trace(self) -> None:
        """Record the sites the next forward calls (the runner's warm-up)."""
        self.tracing, self.called = True, set()

    def seal(self) -> None:
        """Keep only the targets the traced forward reached."""
        self.tracing = False
        self.targets = lora_sites.seal(self.targets, self.called)

    def target_names(self, layer: int) -> list[str]:
        return sorted(p for (i, p) in self.targets if i == layer)

    # ---- vLLM's add / remove / list / pin --------------------------------

    def add(self, request, protect: frozenset = frozenset()) -> bool:
        """Loads the adapter `request` names (again, with load_inplace);
        AdapterError (a ValueError) names whatever cannot be served.
        `protect`: adapters not to evict for it (the step's own)."""
        lid = request.lora_int_id
        if lid in self.loaded and not getattr(request, "load_inplace", False):
            self.loaded.move_to_end(lid)
            return True
        adapter = self._bind(request, read_adapter(request.lora_name, request.lora_path, self.max_rank))
        self.loads += 1
        self.remove(lid)
        active = set(protect) | (set(self.step.active) if self.step is not None else set())
        while len(self.loaded) >= self.capacity:
            victim = next((k for k in self.loaded if k not in self.pinned and k not in active), None)
            if victim is None:
                raise refusal(request.lora_name, request.lora_path, f"all {self.capacity} loaded adapters "
                                   "are pinned or in use (raise --max-cpu-loras)")
            self.remove(victim)
        self.loaded[lid] = adapter
        return True

    def remove(self, lora_id: int) -> bool:
        found = self.loaded.pop(lora_id, None) is not None
        self.pinned.discard(lora_id)
        self._single.pop(lora_id, None)
        if lora_id in self.slots:
            self.slots.remove(lora_id)
            self._slot_pack = None
        return found

    def list(self) -> set[int]:
        return set(self.loaded)

    def pin(self, lora_id: int) -> bool:
        if lora_id not in self.loaded:
            raise ValueError(f"LoRA adapter {lora_id} is not loaded, so it cannot be pinned")
        self.pinned.add(lora_id)
        return True

    def _bind(self, request, weights: AdapterWeights) -> LoadedAdapter:
        def fail(problem: str):
            return refusal(request.lora_name, request.lora_path, problem)

        layers = 1 + max(s.layer for s in self.sites) if self.sites else 0
        parts: dict[int, list] = {}
        for m in weights.modules:
            if m.layer >= layers:
                raise fail(f"layer {m.layer} {m.path}: the model has {layers} layers")
            target = self.targets.get((m.layer, m.path))
            if target is None:
                why = ABSORBED.get(m.path.rsplit(".", 1)[-1], "not a projection this model computes")
                raise fail(f"layer {m.layer} {m.path}: {why} (targets of layer {m.layer}: "
                           f"{', '.join(self.target_names(m.layer)) or 'none'})")
            site = self.sites[target.site]
            want = (site.in_dims, target.hi - target.lo)
            if (m.a.shape[0], m.b.shape[1]) != want:
                raise fail(f"layer {m.layer} {m.path}: the adapter maps {m.a.shape[0]} -> {m.b.shape[1]} features, "
                           f"the model's projection {want[0]} -> {want[1]}")
            parts.setdefault(target.site, []).append((target, m))
        sites = {}
        for index, members in parts.items():
            site = self.sites[index]
            a = np.concatenate([m.a for _, m in members], axis=1)
            b = np.zeros((a.shape[1], site.out_dims), dtype=np.float32)
            row = 0
            for target, m in members:
                r = m.a.shape[1]
                b[row:row + r, target.lo:target.hi] = m.b * m.scale
                row += r
            sites[index] = (mx.array(np.ascontiguousarray(a.T)).astype(self.dtype),
                            mx.array(np.ascontiguousarray(b.T)).astype(self.dtype))
        mx.eval([x for pair in sites.values() for x in pair])
        return LoadedAdapter(request, sites,
                             sum(x.nbytes for pair in sites.values() for x in pair))

    # ---- per step ------------------------------------------------------------

    def begin_step(self, requests: list, row_tokens: np.ndarray) -> None:
        """The rows' LoRARequests (None: the base model) and token counts,
        in the step's token order. Loads an adapter a request names for
        the first time (vLLM's worker does the same)."""
        ids = [r.lora_int_id if r is not None else 0 for r in requests]
        active = tuple(sorted({i for i in ids if i}))
        if not active:
            self.step = None
            return
        if len(active) > self.max_loras:
            raise RuntimeError(f"{len(active)} LoRA adapters in one step, above --max-loras {self.max_loras}")
        for lid in active:
            if lid in self.loaded:
                self.loaded.move_to_end(lid)
        for request in {r.lora_int_id: r for r in requests if r is not None}.values():
            self.add(request, frozenset(active))
        self._steps += 1
        for lid in active:
            self._used[lid] = self._steps
        if len(active) == 1:
            pack, slot = self._single_pack(active[0]), {active[0]: 0}
        else:
            self._seat(active)
            pack, slot = self._slot_pack, {lid: s for s, lid in enumerate(self.slots)}
        token_slot = np.repeat(np.array([slot.get(i, -1) for i in ids], np.int32), row_tokens)
        self.step = StepAdapters(active, pack, mx.array(token_slot), int(token_slot.size),
                                 uniform=len(active) == 1 and bool((token_slot == 0).all()))

    def end_step(self) -> None:
        self.step = None

    def _single_pack(self, lid: int) -> dict:
        pack = self._single.get(lid)
        if pack is None:
            pack = self._single[lid] = {index: (a, b, ((0, a.shape[0]),))
                                        for index, (a, b) in self.loaded[lid].sites.items()}
        return pack

    def _seat(self, active: tuple[int, ...]) -> None:
        """Every active adapter in a slot: free slots first, then the least
        recently run occupant not in this step gives up its slot."""
        changed = self._slot_pack is None
        for lid in active:
            if lid in self.slots:
                continue
            if len(self.slots) < self.max_loras:
                self.slots.append(lid)
            else:
                out = min((o for o in self.slots if o not in active), key=lambda o: self._used.get(o, 0))
                self.slots[self.slots.index(out)] = lid
            changed = True
        if changed:
            self._slot_pack = self._build_pack(self.slots)

    def _build_pack(self, occupants: list[int]) -> dict:
        pack = {}
        for index in {s for lid in occupants for s in self.loaded[lid].sites}:
            have = [(slot, self.loaded[lid].sites[index]) for slot, lid in enumerate(occupants)
                    if index in self.loaded[lid].sites]
            layout = tuple((slot, a.shape[0]) for slot, (a, _) in have)
            if len(have) == 1:
                a_cat, b_cat = have[0][1]
            else:
                a_cat = mx.concatenate([a for _, (a, _) in have], axis=0)
                b_cat = mx.concatenate([b for _, (_, b) in have], axis=1)
            pack[index] = (a_cat, b_cat, layout)
        mx.eval([x for a, b, _ in pack.values() for x in (a, b)])
        self.repacks += 1
        return pack

    def apply(self, site: int, x: mx.array, y: mx.array) -> mx.array:
        """`y` (the base projection of `x` [..., tokens, in]) plus the step's
        LoRA delta of `site`: one fused multiply-add (addmm) after the A
        product, and the slot mask only where the step mixes rows."""
        if self.tracing:
            self.called.add(site)
        step = self.step
        if step is None:
            return y
        if x.shape[-2] != step.tokens:
            s = self.sites[site]
            raise RuntimeError(f"layer {s.layer} {s.name}: called on {x.shape[-2]} rows, not the step's "
                               f"{step.tokens} tokens: its adapter rows cannot be matched")
        entry = step.pack.get(site)
        if entry is None:
            return y
        a_cat, b_cat, layout = entry
        h = x @ a_cat.T
        if not step.uniform:  # rows of several adapters, or base rows: each token keeps its own columns
            mask = step.masks.get(layout)
            if mask is None:
                columns = mx.array(np.concatenate([np.full(r, slot, np.int32) for slot, r in layout]))
                mask = step.masks[layout] = (step.token_slot[:, None] == columns[None, :]).astype(h.dtype)
            h = h * mask
        return mx.addmm(y, h, b_cat.T)

    def reserve_bytes(self) -> int:
        """The most the adapters can hold: --max-cpu-loras loaded adapters at
        --max-lora-rank on every target, plus a slot pack of --max-loras of
        them. The worker leaves it out of the KV-cache budget."""
        members: dict[int, int] = {}
        for target in self.targets.values():
            members[target.site] = members.get(target.site, 0) + 1
        per_adapter = sum(n * self.max_rank * (self.sites[i].in_dims + self.sites[i].out_dims)
                          for i, n in members.items()) * self.dtype.size
        return per_adapter * (self.capacity + self.max_loras)
