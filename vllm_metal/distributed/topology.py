"""Who is who in a multi-process run: ranks, stages, and each stage's layers.

vLLM numbers its workers rank = pp_rank * tp_size + tp_rank (its
MultiprocExecutor: the last stage's first TP rank answers the engine). The
MLX ring (distributed/ring.py) uses the same numbers, so in ring order each
stage's TP ranks sit next to each other and a stage's last TP rank is the
next stage's first rank's left neighbour: the hidden states walk the ring
one hop at a time (the ring backend only talks to its two neighbours).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    tp: int  # tensor-parallel size: ranks sharing each stage's layers
    pp: int  # pipeline-parallel size: stages
    rank: int  # vLLM's global rank

    def __post_init__(self):
        if self.tp < 1 or self.pp < 1 or not 0 <= self.rank < self.tp * self.pp:
            raise ValueError(f"bad topology: tp={self.tp} pp={self.pp} rank={self.rank}")

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def receives(self) -> bool:
        """Reads its stage's input hidden states from its left neighbour
        (every rank of a stage after the first: the stage's first TP rank from
        the previous stage, the others passed on along the stage)."""
        return not self.first_stage

    @property
    def forwards(self) -> bool:
        """Passes the received hidden states on to the next TP rank of its stage."""
        return self.receives and self.tp_rank < self.tp - 1

    @property
    def sends(self) -> bool:
        """Sends its stage's output to the next stage (the stage's last TP rank)."""
        return not self.last_stage and self.tp_rank == self.tp - 1


def parse_partition(text: str, num_layers: int, pp: int) -> list[int]:
    """vLLM's VLLM_PP_LAYER_PARTITION ("8,8,6": layers per stage, in stage
    order), checked against the model."""
    try:
        split = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"VLLM_PP_LAYER_PARTITION={text!r}: expected comma-separated layer counts") from None
    if len(split) != pp:
        raise ValueError(f"VLLM_PP_LAYER_PARTITION={text!r} has {len(split)} entries for {pp} pipeline stages")
    if any(n <= 0 for n in split) or sum(split) != num_layers:
        raise ValueError(f"VLLM_PP_LAYER_PARTITION={text!r} must be positive counts summing to the model's "
                         f"{num_layers} layers")
    return split


def split_by_memory(num_layers: int, free: list[int]) -> list[int]:
    """Layers per stage in proportion to each stage's free memory (bytes; a
    stage's figure is the least of its TP ranks'), every stage at least one
    layer; the rounding remainder goes to the stages with the largest
    fractional shares (ties: the earlier stage). Equal memory gives an even
    split with the extra layers on the first stages."""
    pp = len(free)
    if num_layers < pp:
        raise ValueError(f"{num_layers} layers cannot be split over {pp} pipeline stages (one layer each at least)")
    if any(f <= 0 for f in free):
        raise ValueError(f"a pipeline stage reports no free memory: {free}")
    total = sum(free)
    spare = num_layers - pp  # one layer per stage first, the rest by share
    shares = [spare * f / total for f in free]
    split = [1 + int(s) for s in shares]
    order = sorted(range(pp), key=lambda i: (-(shares[i] - int(shares[i])), i))
    for i in order[:num_layers - sum(split)]:
        split[i] += 1
    return split


def stage_layers(split: list[int], pp_rank: int) -> range:
    start = sum(split[:pp_rank])
    return range(start, start + split[pp_rank])
