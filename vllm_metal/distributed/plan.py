"""This rank's share of a multi-rank model, as the loader takes it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelPlan:
    """This rank's part of a multi-rank model (the worker builds it:
    distributed/). Tensor parallel: rank `tp_rank` of `tp`, `reduce` sums
    over the TP group. Pipeline parallel: stage `pp_rank` of `pp`, layers
    per stage from `layer_split(num_layers)`, hidden states moved by
    `transport`."""

    tp_rank: int = 0
    tp: int = 1
    reduce: object = None
    pp_rank: int = 0
    pp: int = 1
    layer_split: object = None
    transport: object = None
