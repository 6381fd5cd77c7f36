"""One linear-attention layer's view of a step on its state slots: what
every such layer of a hybrid model does around its own math (short_conv.py,
mamba2.py; gated_delta.py does the same inline).

The layer's state pools are indexed by vLLM's Mamba-group block id (one slot
per request; with prefix caching, vLLM's "align" mode, one per block of
tokens, each row read from the block of its last computed token and written
to the block of its new last token: engine/state_align.py): pool 0 (`store.keys[layer]`) holds the causal convolution's
last `kernel - 1` inputs, pool 1 (`store.values[layer]`, where the layer
has one) its recurrent state. A step gathers its rows' states by slot -- a
row starting at position 0 (new, or preempted and recomputed) from zeros,
whatever its slot held before -- runs every row's scheduled tokens as one
right-padded batch (`build_linear_inputs`, once per step), and writes the
new states back functionally (`write_back`: in place, or copied for the
VLLM_METAL_STATE_WRITEBACK ablation), all inside the step's one lazy graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from vllm_metal import envs
from vllm_metal.models.draft_states import DraftRows


def state_writeback_mode() -> str:
    """'inplace' or 'copy' (VLLM_METAL_STATE_WRITEBACK); anything else is refused."""
    mode = (envs.get("VLLM_METAL_STATE_WRITEBACK") or "inplace").strip().lower()
    if mode not in ("inplace", "copy"):
        raise ValueError(f"VLLM_METAL_STATE_WRITEBACK={mode!r}: expected 'inplace' or 'copy'")
    return mode


def write_back(store, pool: mx.array, slots: mx.array, new: mx.array) -> mx.array:
    """The pool with rows `slots` replaced by `new`, functionally (the caller
    puts the result in the store in place of `pool`). In place: nothing else
    holds the old pool when the step is evaluated, so MLX donates its buffer
    to the scatter and only the step's rows are written. Copy: the old pool is
    kept alive until the next step (`store.retained`), so the scatter must
    allocate a new pool and copy every slot into it: a write-back without
    donation, for the ablation."""
    out = mx.array(pool)  # a second handle: `out[...] =` rebinds it alone
    if state_writeback_mode() == "copy":
        store.retained.append(pool)
    out[slots] = new.astype(pool.dtype)
    return out


@dataclass
class LinearStepInputs:
    """The step's rows as a right-padded batch [num_seqs, max_scheduled]
    (built once per step from the packed layout)."""

    pad_index: mx.array  # int32 [num_seqs, T]: packed token of each padded position (pads repeat a row's first)
    # bool [num_seqs, T]: real tokens; None when every position is real (all
    # rows scheduled alike, e.g. a decode step): no masking pass at all.
    mask: mx.array | None
    lengths: mx.array  # int32 [num_seqs]: tokens scheduled per row
    # bool [num_seqs]: the row continues a state (num_computed > 0); None when
    # every row does (a decode step): the gathered states are used as they are.
    carried: mx.array | None
    unpad_index: mx.array  # int32 [num_tokens]: each packed token's place in the flattened padded batch
    # Per state group (KV-cache group index): (the block ids each row's state
    # is read from, the block ids its new state is written to), int32
    # [num_seqs]. Prefix caching's "align" mode moves a request's state from
    # block to block (engine/state_align.py); a group not listed keeps one
    # slot per request: its block table's first entry, read and written.
    state_slots: dict[int, tuple[mx.array, mx.array]] | None = None
    # Rows verifying drafts (speculative decoding): the states after each of
    # their positions are kept as candidates (models/draft_states.py); None: no such row.
    drafts: DraftRows | None = None


def build_linear_inputs(cu_seqlens_q: np.ndarray, positions: np.ndarray,
                        state_slots: dict[int, tuple[np.ndarray, np.ndarray]] | None = None,
                        num_drafts: np.ndarray | None = None,
                        block_tables: list[np.ndarray] | None = None) -> LinearStepInputs:
    cu = np.asarray(cu_seqlens_q, np.int64)
    counts = np.diff(cu)
    width = int(counts.max())
    offsets = np.arange(width)[None, :]
    mask = offsets < counts[:, None]
    pad_index = np.where(mask, cu[:-1, None] + offsets, cu[:-1, None])
    row_of_token = np.repeat(np.arange(len(counts)), counts)
    unpad = row_of_token * width + np.arange(cu[-1]) - cu[row_of_token]
    carried = np.asarray(positions)[cu[:-1]] > 0
    drafts = None
    if num_drafts is not None and np.any(num_drafts):
        drafts = DraftRows.build(np.flatnonzero(num_drafts), counts, np.asarray(positions)[cu[:-1]],
                                 state_slots, block_tables)
    return LinearStepInputs(pad_index=mx.array(pad_index.astype(np.int32)),
                            mask=None if mask.all() else mx.array(mask),
                            lengths=mx.array(counts.astype(np.int32)),
                            carried=None if carried.all() else mx.array(carried),
                            unpad_index=mx.array(unpad.astype(np.int32)),
                            state_slots={g: (mx.array(src), mx.array(dst)) for g, (src, dst) in state_slots.items()}
                            if state_slots else None, drafts=drafts)


class SlotStep:
    """Built by a linear layer from its `cache` (a LayerCacheView) at each call."""

    def __init__(self, cache, keeps_drafts: bool = False):
        store = cache.store
        self.store, self.layer = store, cache.layer
        self.rows = store.step.linear  # LinearStepInputs
        if self.rows.drafts is not None and not keeps_drafts:  # the serving config refuses it first
            raise NotImplementedError("speculative decoding over this linear-attention layer: its states per "
                                      "draft position are not kept")
        group = self.group = store.layer_group[cache.layer]
        moved = self.rows.state_slots.get(group) if self.rows.state_slots else None
        if moved is None:  # one slot per request (no prefix caching)
            self.src_slots = self.dst_slots = store.step.block_tables[group][:, 0]
        else:  # align mode: read the last step's block, write this step's
            self.src_slots, self.dst_slots = moved

    def pad(self, t: mx.array) -> mx.array:
        """[1, num_tokens, ...] (packed) -> [num_seqs, T, ...], pads zeroed."""
        t = t[0][self.rows.pad_index]
        if self.rows.mask is None:
            return t
        return mx.where(self.rows.mask.reshape(*self.rows.mask.shape, *[1] * (t.ndim - 2)), t, 0)

    def unpad(self, t: mx.array) -> mx.array:
        """[num_seqs, T, ...] -> [1, num_tokens, ...] (packed)."""
        return t.reshape(-1, *t.shape[2:])[self.rows.unpad_index][None]

    def pool(self, index: int) -> mx.array:
        return (self.store.keys if index == 0 else self.store.values)[self.layer]

    def gather(self, index: int) -> mx.array:
        """The rows' states from pool `index`; zeros for rows starting fresh."""
        pool = self.pool(index)
        if self.rows.carried is None:
            return pool[self.src_slots]
        carried = self.rows.carried.reshape(-1, *[1] * (pool.ndim - 1))
        return mx.where(carried, pool[self.src_slots], 0)

    def causal_conv(self, conv, x: mx.array) -> mx.array:
        """mlx-lm's depthwise causal `conv` (kernel k, no padding of its own)
        over the padded batch x [num_seqs, T, channels], continuing each row
        from its carried last k - 1 inputs (pool 0); the new last k - 1
        inputs of each row (its real tokens end at length - 1) are written
        back. Returns the convolution's output [num_seqs, T, channels]."""
        state = self.gather(0).astype(x.dtype)
        conv_input = mx.concatenate([state, x], axis=1)
        keep = (self.rows.lengths[:, None] + mx.arange(state.shape[1]))[..., None]
        self.write(0, mx.take_along_axis(conv_input, keep, axis=1))
        self.conv_input = conv_input  # (a verify row's candidate convolution states are windows of it)
        return conv(conv_input)

    def keep_candidates(self, recurrent: mx.array) -> None:
        """The verify rows' states after each of their positions (models/
        draft_states.py): the convolution's from its input, the recurrent
        ones given [V, width, ...]."""
        drafts = self.rows.drafts
        kernel = self.pool(0).shape[1] + 1
        window = (mx.arange(drafts.width)[:, None] + 1 + mx.arange(kernel - 1)[None]).reshape(-1)
        conv = self.conv_input[drafts.index][:, window]
        drafts.candidates[self.layer] = (self.group, conv.reshape(conv.shape[0], drafts.width, kernel - 1, -1),
                                         recurrent)
        self.store.drafts = drafts

    def write(self, index: int, new: mx.array) -> None:
        """Pool `index` with the rows' (destination) slots replaced by `new`."""
        pools = self.store.keys if index == 0 else self.store.values
        pools[self.layer] = write_back(self.store, pools[self.layer], self.dst_slots, new)

    def done(self, out: mx.array) -> mx.array:
        """The layer's output, after the per-layer evaluation hook (VLLM_METAL_SYNC_PER_LAYER)."""
        if self.store.after_layer is not None:
            self.store.after_layer(out, *[a for a in (self.store.keys[self.layer], self.store.values[self.layer])
                                          if a is not None])
        return out
