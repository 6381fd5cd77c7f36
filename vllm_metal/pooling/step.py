"""One pooling step: the step's final hidden states (MLX, then a zero-copy
torch view) through vLLM's pooler with vLLM's pooling metadata, as vLLM's
GPU runner does in `_pool`: every row's PoolingParams (its task, normalize,
dimensions, activation), a cursor over the packed tokens, and per-request
PoolingStates (the hidden states a chunked `token_embed` request has
gathered so far). Rows whose prompt is not finished this step (chunked
prefill) get None; vLLM hands a request its output once, when it finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.pooling_params import PoolingParams
from vllm.v1.pool.metadata import PoolingMetadata, PoolingStates


@dataclass
class PoolingRow:
    """What the pooler needs of one scheduled request."""

    prompt_token_ids: list[int]
    params: PoolingParams
    states: PoolingStates = field(default_factory=PoolingStates)


def token_type_ids(params: PoolingParams, positions: np.ndarray) -> np.ndarray | None:
    """A cross-encoder pair's token types at `positions` (1 inside the
    second text), from vLLM's compressed form (the half-open range of type-1
    positions the scoring front end put in extra_kwargs); None without one."""
    extra = params.extra_kwargs or {}
    span = extra.get("compressed_token_type_ids")
    if span is None:
        return None
    start, end = span
    return ((positions >= start) & (positions < end)).astype(np.int32)


def pool(pooler, hidden: torch.Tensor, rows: list[PoolingRow], num_scheduled: np.ndarray,
         seq_lens: np.ndarray) -> list[torch.Tensor | None]:
    """hidden: [scheduled tokens, hidden] float32, rows packed in order;
    seq_lens: each row's tokens computed after this step. Returns each
    row's pooled output (None: its prompt is still being prefilled)."""
    params = [r.params for r in rows]
    prompt_lens = torch.tensor([len(r.prompt_token_ids) for r in rows], dtype=torch.int64)
    token_ids = None
    if any(p.requires_token_ids for p in params):
        token_ids = torch.zeros((len(rows), int(prompt_lens.max())), dtype=torch.int64)
        for i, r in enumerate(rows):
            token_ids[i, :len(r.prompt_token_ids)] = torch.tensor(r.prompt_token_ids)
    metadata = PoolingMetadata(prompt_lens=prompt_lens, prompt_token_ids=token_ids, prompt_token_ids_cpu=token_ids,
                               pooling_params=params, pooling_states=[r.states for r in rows])
    metadata.build_pooling_cursor(np.asarray(num_scheduled, dtype=np.int64),
                                  torch.from_numpy(np.asarray(seq_lens, dtype=np.int64)), device=hidden.device)
    with torch.inference_mode():
        out = pooler(hidden, metadata)
    finished = metadata.get_pooling_cursor().get_finished_mask()
    outputs: list[torch.Tensor | None] = []
    for i, done in enumerate(finished):
        if not done:
            outputs.append(None)
            continue
        value = out[i]
        outputs.append(None if value is None else value.detach().clone())
        rows[i].states.clean()
    return outputs
