"""Turns one engine step's scheduled rows into the arrays the model needs.

Pure numpy and independent of vLLM and MLX, so it is tested without a model:
token ids and positions of every scheduled token (packed, row after row),
the varlen offsets, each row's block table and each token's cache slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Sequence

import numpy as np


@dataclass
class ScheduledRow:
    """One request's share of a step."""

    token_ids: Sequence[int]  # the tokens scheduled now (positions num_computed ...)
    num_computed: int  # tokens already in the KV cache
    block_ids: Sequence[Sequence[int]] = ()  # per KV-cache group; unused when tables are given
    num_drafts: int = 0  # of token_ids, the drafts at its end (speculative decoding; placeholders too)


@dataclass
class StepInputs:
    token_ids: np.ndarray  # int32 [num_tokens]
    positions: np.ndarray  # int32 [num_tokens]
    seq_lens: np.ndarray  # int32 [num_seqs], context after this step
    cu_seqlens_q: np.ndarray  # int32 [num_seqs + 1]
    block_tables: list[np.ndarray]  # per group: int32 [num_seqs, max_blocks]
    slot_mappings: list[np.ndarray]  # per group: int64 [num_tokens]
    # Prefix caching of hybrid models (vLLM's "align" mode): per state group,
    # (blocks each row's state is read from, blocks it is written to), int32
    # [num_seqs], set by the runner (engine/state_align.py). None: one state
    # slot per request, its block table's first entry.
    state_slots: dict[int, tuple[np.ndarray, np.ndarray]] | None = None
    # Images in the step (set by the runner's multimodal side, multimodal/step.py):
    # the text model's input embeddings with image rows scattered in (lazy
    # MLX [num_tokens, hidden]); M-RoPE positions int32 [3, num_tokens]; the
    # image tokens attended both ways (models/attention_adapter.ImageSpans).
    input_embeddings: object = None
    mrope_positions: np.ndarray | None = None
    image_spans: object = None
    # The input ids as a lazy MLX array when some are read from the previous
    # step's in-graph tokens (engine/step_rows.py); None: token_ids.
    token_ids_mx: object = None
    # Drafts at the end of each row, int64 [num_seqs] (speculative decoding:
    # hybrid models keep a verify row's states per position); None: no row has any.
    num_drafts: np.ndarray | None = None

    @property
    def last_token_indices(self) -> np.ndarray:
        """Index in the packed tokens of each row's last scheduled token."""
        return self.cu_seqlens_q[1:] - 1


def build_step_inputs(rows: Sequence[ScheduledRow], block_sizes: Sequence[int],
                      sliding_windows: Sequence[int | None] | None = None,
                      tables: Sequence[tuple[np.ndarray, np.ndarray]] | None = None) -> StepInputs:
    """tables: per group, (int32 [rows, width] block table padded with 0,
    int32 [rows] valid entries) kept by the runner's persistent batch
    (vllm_metal.engine.block_tables), taken over (masked in place) instead of being
    built from the rows' block_ids.

    sliding_windows: per group, the window of a sliding-window group (None
    for full attention). vLLM frees a sliding-window request's out-of-window
    blocks (and may hand them to other requests) without telling the worker,
    so table entries wholly below the step's first query's window are set to
    the null block 0: nothing may read a block the request no longer owns."""
    if not rows:
        raise ValueError("a step needs at least one scheduled row")
    counts = np.array([len(r.token_ids) for r in rows], np.int32)
    if (counts <= 0).any():
        raise ValueError(f"row {int(np.argmax(counts <= 0))} has no scheduled tokens")
    cu = np.zeros(len(rows) + 1, np.int32)
    np.cumsum(counts, out=cu[1:])
    computed = np.array([r.num_computed for r in rows], np.int32)
    seq_lens = computed + counts
    token_ids = np.fromiter((t for r in rows for t in r.token_ids), np.int32, count=int(cu[-1]))
    # position of token j of row s = computed[s] + j
    row_of_token = np.repeat(np.arange(len(rows)), counts)
    positions = (computed[row_of_token] + np.arange(cu[-1]) - cu[row_of_token]).astype(np.int32)

    block_tables, slot_mappings = [], []
    if tables is not None and (len(tables) != len(block_sizes)
                               or any(len(t) != len(rows) or len(c) != len(rows) for t, c in tables)):
        raise ValueError(f"block tables for {[len(t) for t, _ in tables]} rows in {len(tables)} groups "
                         f"do not match {len(rows)} rows in {len(block_sizes)} groups")
    for group, block_size in enumerate(block_sizes):
        if tables is not None:
            table, counts = tables[group]
        else:
            counts = np.array([len(r.block_ids[group]) for r in rows], np.int32)
            table = np.zeros((len(rows), max(int(counts.max()), 1)), np.int32)  # pad with the null block 0
            for s, r in enumerate(rows):
                table[s, :counts[s]] = r.block_ids[group]
        short = counts.astype(np.int64) * block_size < seq_lens
        if short.any():
            s = int(np.argmax(short))
            raise ValueError(f"row {s}: {int(counts[s])} blocks of {block_size} cannot hold "
                             f"{int(seq_lens[s])} tokens")
        blocks = table[row_of_token, positions // block_size].astype(np.int64)
        window = sliding_windows[group] if sliding_windows is not None else None
        if window:
            # Entry j is out of every query's window when (j + 1) * block_size
            # <= first position - window + 1.
            first_live = np.maximum(computed - window + 1, 0) // block_size
            table[np.arange(table.shape[1])[None, :] < first_live[:, None]] = 0
        block_tables.append(table)
        slot_mappings.append(blocks * block_size + positions % block_size)
    drafts = np.array([r.num_drafts for r in rows], np.int64)
    return StepInputs(token_ids=token_ids, positions=positions, seq_lens=seq_lens, cu_seqlens_q=cu,
                      block_tables=block_tables, slot_mappings=slot_mappings,
                      num_drafts=drafts if drafts.any() else None)


def token_rows(tables: Sequence[tuple[np.ndarray, np.ndarray]], block_sizes: Sequence[int],
               sliding_windows: Sequence[int | None], rows: np.ndarray, tokens: Sequence[Sequence[int]],
               starts: np.ndarray) -> StepInputs:
    """Inputs of tokens[i] at positions starts[i] ... for each of the batch
    rows `rows`, from the batch's tables (a draft model's passes,
    speculative/draft_model.py: its cache catching up, then one token a pass)."""
    picked = [(t[rows], c[rows]) for t, c in tables]
    return build_step_inputs([ScheduledRow(list(t), int(p)) for t, p in zip(tokens, starts)], block_sizes,
                             sliding_windows, picked)


def rows_inputs(runner):
    """token_rows over the runner's batch tables: (rows, tokens, starts) -> StepInputs (a drafting model's)."""
    return partial(token_rows, runner.batch.block_table_view(), runner.block_sizes, runner.group_windows)


def room(tables: Sequence[tuple[np.ndarray, np.ndarray]], block_sizes: Sequence[int]) -> np.ndarray:
    """Tokens each row's blocks hold, in every group (int64 [rows])."""
    return np.min([c.astype(np.int64) * b for (_, c), b in zip(tables, block_sizes)], axis=0)
