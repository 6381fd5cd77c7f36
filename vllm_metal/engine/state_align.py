"""Hybrid models' linear-attention states under vLLM's prefix caching
(`mamba_cache_mode` "align", vLLM's default for hybrids): which block each
row's state is read from and written to this step.

In align mode vLLM's cache manager gives the state group one block per
`block_size` tokens, positional like attention blocks (entries it does not
keep are the null block), and its scheduler ends prefill chunks on block
boundaries, so that block p of a request holds the state after exactly
(p + 1) * block_size tokens once the request is past it: a block vLLM can
cache and hand to a later request with the same prefix, whose first step
then starts from it. A request's running state lives in the block of its
last computed token. vLLM's GPU runner keeps that index per request
(`mamba_state_idx`) and, when a step moves it to a new block, copies the
state there before the forward (`mamba_utils.preprocess_mamba`); here the
step's one graph reads the state from the old block and writes the new
state to the new one (models/state_slots.py), which is the same thing
without a copy: the old block keeps its boundary state for the prefix cache.
"""

from __future__ import annotations

from itertools import chain
from typing import Sequence

import numpy as np


class AlignedStateIndex:
    """Per request, the block index (in its state group's block table) that
    holds its running state after the last step, as vLLM's
    `mamba_utils.preprocess_mamba` keeps it (no speculative blocks)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.state_idx: dict[str, int] = {}

    def forget(self, so) -> None:
        """Finished, preempted and resumed requests start over (vLLM's
        `cleanup_mamba_state_idx`): a resumed request's first state is its
        prefix-cache hit's, or zeros."""
        cached = so.scheduled_cached_reqs
        for req_id in chain(so.finished_req_ids, so.preempted_req_ids or (), cached.resumed_req_ids):
            self.state_idx.pop(req_id, None)

    def plan(self, req_ids: Sequence[str], num_computed: np.ndarray, num_scheduled: np.ndarray,
             tables: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each state group's block table [rows, blocks]: (the block ids
        each row's state is read from, the block ids its new state is written
        to), int32 [rows]. A row with nothing computed reads nothing (the
        layers start it from zeros); its source is the null block 0."""
        block = self.block_size
        computed = np.asarray(num_computed, np.int64)
        # A new or resumed request's state is its last computed token's block
        # (a prefix-cache hit's; -1: nothing computed).
        prev = np.array([self.state_idx.get(r, (c - 1) // block) for r, c in zip(req_ids, computed.tolist())],
                        np.int64)
        curr = -(-(computed + np.asarray(num_scheduled, np.int64)) // block) - 1
        for r, c in zip(req_ids, curr.tolist()):
            self.state_idx[r] = c
        rows = np.arange(len(req_ids))
        out = []
        for table in tables:
            if (curr >= table.shape[1]).any():
                s = int(np.argmax(curr >= table.shape[1]))
                raise ValueError(f"request {req_ids[s]}: its state block {int(curr[s])} is past its "
                                 f"{table.shape[1]}-entry state block table")
            src = np.where(prev >= 0, table[rows, np.maximum(prev, 0)], 0).astype(np.int32)
            dst = table[rows, curr].astype(np.int32)
            if (dst == 0).any():
                s = int(np.argmax(dst == 0))
                raise ValueError(f"request {req_ids[s]}: its state block {int(curr[s])} is the null block")
            out.append((src, dst))
        return out
