"""Hybrid models under speculative decoding: a verify row's linear-attention
states after each of its positions, kept until the step's accepted counts
are known, then the accepted one written where the request's state lives.

A verify row runs the request's newest token and its d drafts (1 + d
positions) through every layer. Attention caches need nothing more (vLLM
rolls `num_computed_tokens` back over rejected drafts and their slots are
written again), but a recurrent layer folds every position into one state:
written as it is, the state would carry the rejected drafts. vLLM's GPU
runner therefore keeps the state after every position of a verify row (in
num_speculative_blocks extra state blocks) and reads the accepted one at
the next step (num_accepted_tokens). Here the gated-delta layers
(gated_delta.py) compute the 1 + d candidate states of each verify row in
the step's graph -- the convolution's last inputs after each position (a
window of its input) and the recurrent state after each position (the
recurrence's one call runs each verify row again over only its first
1 .. width - 1 positions, `prefix_rows` / `prefix_mask`) -- and keep them
(`DraftRows.candidates`, evaluated with the step); once sampling has
accepted a drafts, `select` writes candidate a (the state after 1 + a
tokens) to the row's destination slot, functionally: the write is part of
the next step's graph. Rows vLLM padded with placeholder drafts run 1 + d
tokens too and keep candidate 0.

Prefix caching (vLLM's "align" mode): block p of a request's state group
must hold the state after exactly (p + 1) * block_size tokens once the
request is past it (a block vLLM may cache and hand to another request).
The step's destination is the block of its last scheduled token (drafts
included, as vLLM allocates); when the accepted tokens cross a block
boundary inside the row, the candidate at that boundary is also written to
the boundary's block -- what vLLM's `postprocess_mamba` copies there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np


@dataclass
class DraftRows:
    """A step's rows that run drafts, and the candidate states their layers keep."""

    rows: np.ndarray  # int64 [V]: batch rows with drafts (placeholders too)
    index: mx.array  # int32 [V]: the same rows, for gathers in the graph
    width: int  # tokens of the widest such row (1 + its drafts)
    num_computed: np.ndarray  # int64 [V]: each row's first position
    # Per KV-cache group: (blocks read, blocks written) of align mode, rows [V] (state_align.py).
    state_slots: dict[int, tuple[np.ndarray, np.ndarray]]
    tables: list[np.ndarray]  # per KV-cache group: the rows' block tables [V, blocks]
    # The recurrence's extra rows: verify row v again over only its first j + 1 positions, for
    # j < width - 1 (index into the step's rows, int32 [V * (width - 1)]; bool mask [.., the step's width]).
    prefix_rows: mx.array | None = None
    prefix_mask: mx.array | None = None
    # layer -> (its KV-cache group, convolution candidates [V, width, kernel - 1, conv_dim],
    # recurrent candidates [V, width, ...]): candidate j is the state after j + 1 tokens.
    candidates: dict[int, tuple[int, mx.array, mx.array]] = field(default_factory=dict)

    @classmethod
    def build(cls, rows: np.ndarray, counts: np.ndarray, first_positions: np.ndarray,
              state_slots: dict[int, tuple[np.ndarray, np.ndarray]] | None,
              block_tables: list[np.ndarray] | None) -> DraftRows:
        rows = np.asarray(rows, np.int64)
        width = int(np.max(counts[rows]))
        prefixes = np.arange(width - 1)
        positions = np.arange(int(np.max(counts)))  # the step's padded width
        mask = (positions[None, None, :] <= prefixes[None, :, None]) & \
            (positions[None, None, :] < np.asarray(counts)[rows][:, None, None])
        return cls(rows=rows, index=mx.array(rows.astype(np.int32)), width=width,
                   prefix_rows=mx.array(np.repeat(rows, width - 1).astype(np.int32)),
                   prefix_mask=mx.array(mask.reshape(-1, len(positions))),
                   num_computed=np.asarray(first_positions, np.int64)[rows],
                   state_slots={g: (np.asarray(s)[rows], np.asarray(d)[rows])
                                for g, (s, d) in (state_slots or {}).items()},
                   tables=[np.asarray(t)[rows] for t in block_tables or []])

    def arrays(self) -> list[mx.array]:
        return [a for _, conv, rec in self.candidates.values() for a in (conv, rec)]

    def writes(self, group: int, accepted: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For state group `group`: (slots to write, which row's, which
        candidate), given each row's accepted drafts: the accepted state to
        the row's destination, and in align mode each block boundary the
        accepted tokens reach inside the row, its state to its block."""
        aligned = group in self.state_slots
        dst = self.state_slots[group][1] if aligned else self.tables[group][:, 0]
        slots, who, which = [dst], [np.arange(len(self.rows))], [np.asarray(accepted, np.int64)]
        if aligned:
            table = self.tables[group]
            for i, (c, a) in enumerate(zip(self.num_computed.tolist(), np.asarray(accepted).tolist())):
                for j in range(-(c + 1) % block_size, a + 1, block_size):  # c + j + 1 on a boundary
                    q = (c + j + 1) // block_size - 1
                    block = int(table[i, q]) if q < table.shape[1] else 0
                    if block and block != int(dst[i]):  # (a null block: vLLM keeps no state there)
                        slots.append(np.array([block]))
                        who.append(np.array([i]))
                        which.append(np.array([j]))
        return (np.concatenate(slots).astype(np.int32), np.concatenate(who).astype(np.int32),
                np.concatenate(which).astype(np.int32))


def select(kv, accepted: np.ndarray, block_sizes: list[int]) -> None:
    """After sampling: each draft row's accepted state (accepted[i] drafts of
    row i of `kv.drafts`) written into the state pools, lazily (the next
    step's graph carries the writes); the candidates are dropped."""
    from vllm_metal.models.state_slots import write_back

    drafts, kv.drafts = kv.drafts, None
    if drafts is None or not drafts.candidates:
        return
    plans = {}
    for layer, (group, conv, rec) in drafts.candidates.items():
        if group not in plans:
            slots, who, which = drafts.writes(group, accepted, block_sizes[group])
            plans[group] = (mx.array(slots), mx.array(who), mx.array(which))
        slots, who, which = plans[group]
        kv.keys[layer] = write_back(kv, kv.keys[layer], slots, conv[who, which])
        kv.values[layer] = write_back(kv, kv.values[layer], slots, rec[who, which])
