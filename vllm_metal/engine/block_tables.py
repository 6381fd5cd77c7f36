"""Every running row's block ids, kept in numpy buffers across steps.

vLLM's scheduler sends each step only the blocks a request gained; rebuilding
a [rows, max_blocks] table from Python lists every step costs O(batch x
blocks) list-to-array conversions (1.0 ms at 256 rows of 129 blocks on the
2-core CPU here; benchmarks/bench_step_inputs.py). Here a row's ids are
written when it joins the batch, new blocks are appended in place, a row
moved by the batch's condensing is one row copy, and a step reads a slice.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class BlockTables:
    """Per KV-cache group, an int32 [rows, blocks] buffer (grown by doubling)
    and each row's number of valid entries. Entries past a row's count are
    stale and never read: `view` pads them with the null block 0."""

    def __init__(self, rows: int = 16, blocks: int = 16):
        self._initial = (rows, blocks)
        self.tables: list[np.ndarray] = []  # groups appear with the first row that has them
        self.counts: list[np.ndarray] = []

    def _fit(self, group: int, row: int, blocks: int) -> None:
        table = self.tables[group]
        rows, width = table.shape
        if row < rows and blocks <= width:
            return
        new_rows, new_width = rows, width
        while row >= new_rows:
            new_rows *= 2
        while blocks > new_width:
            new_width *= 2
        grown = np.zeros((new_rows, new_width), np.int32)
        grown[:rows, :width] = table
        counts = np.zeros(new_rows, np.int32)
        counts[:rows] = self.counts[group]
        self.tables[group], self.counts[group] = grown, counts

    def set_row(self, row: int, block_ids: Sequence[Sequence[int]]) -> None:
        """A row's whole table (a request joining or resuming)."""
        while len(self.tables) < len(block_ids):
            self.tables.append(np.zeros(self._initial, np.int32))
            self.counts.append(np.zeros(self._initial[0], np.int32))
        for group, ids in enumerate(block_ids):
            self._fit(group, row, len(ids))
            self.tables[group][row, :len(ids)] = ids
            self.counts[group][row] = len(ids)

    def append(self, row: int, new_ids: Sequence[Sequence[int]]) -> None:
        """Blocks a running request gained this step, per group."""
        for group, ids in enumerate(new_ids):
            if not ids:
                continue
            n = int(self.counts[group][row])
            self._fit(group, row, n + len(ids))
            self.tables[group][row, n:n + len(ids)] = ids
            self.counts[group][row] = n + len(ids)

    def move(self, src: int, dst: int) -> None:
        for group, table in enumerate(self.tables):
            n = int(self.counts[group][src])
            table[dst, :n] = table[src, :n]
            self.counts[group][dst] = n

    def view(self, num_rows: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per group, (table int32 [num_rows, width], counts int32 [num_rows]):
        a fresh array (the buffers change under the next step while this one
        evaluates), entries past each row's count set to the null block 0."""
        out = []
        for table, counts in zip(self.tables, self.counts):
            counts = counts[:num_rows].copy()
            width = max(int(counts.max()) if num_rows else 0, 1)
            sliced = table[:num_rows, :width].copy()
            sliced[np.arange(width)[None, :] >= counts[:, None]] = 0
            out.append((sliced, counts))
        return out
