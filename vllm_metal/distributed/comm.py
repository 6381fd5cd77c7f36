"""Messages between ring neighbours inside one MLX graph, in program order.

MLX's ring backend talks only to a rank's two neighbours, and a receive is a
graph node with no inputs: MLX may schedule it anywhere, also before a send
this rank must make first -- and a rank blocked in a receive whose data
needs its own unsent message deadlocks the ring. So every message of a rank
is chained to the one before: `mx.depends([op], [previous])`. With MLX
0.32's evaluation (the tape runs a node's later inputs first; see
tests/distributed/test_comm.py, which deadlocks -- and times out -- if that
changes) a rank's sends and receives then run in the order the model code
issued them, on every rank alike.

What flows: pipeline stages' hidden states (rank -> rank + 1, pipeline.py)
and, for tensor parallel inside a pipeline stage (the ring cannot split a
group), a stage's sum as a chain: partial sums walk right along the stage's
ranks and the total walks back (every rank gets the same bits, summed once
on the stage's last rank).
"""

from __future__ import annotations

import mlx.core as mx


class Comm:
    def __init__(self, group, rank: int):
        self.group, self.rank = group, rank
        self.last: mx.array | None = None  # the rank's latest message (send or receive)
        self.pending: list[mx.array] = []  # sends not yet consumed by anything: evaluate with the step

    def _ordered(self, op: mx.array) -> mx.array:
        if self.last is not None:
            op = mx.depends([op], [self.last])[0]
        self.last = op
        return op

    def send(self, x: mx.array, dst: int) -> mx.array:
        out = self._ordered(mx.distributed.send(x, dst, group=self.group))
        self.pending.append(out)
        return out

    def recv_like(self, x: mx.array, src: int) -> mx.array:
        return self._ordered(mx.distributed.recv_like(x, src, group=self.group))

    def take_pending(self) -> list[mx.array]:
        pending, self.pending = self.pending, []
        return pending

    def chain_sum(self, x: mx.array, index: int, size: int) -> mx.array:
        """Sum of x over `size` consecutive ranks (this one is `index` of
        them): partials rightwards, the total back leftwards."""
        partial = x if index == 0 else self.recv_like(x, self.rank - 1) + x
        if index < size - 1:
            self.send(partial, self.rank + 1)
            total = self.recv_like(x, self.rank + 1)
        else:
            total = partial
        if index > 0:
            self.send(total, self.rank - 1)
        return total
