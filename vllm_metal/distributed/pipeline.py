"""Pipeline stages: each rank runs a contiguous range of the decoder's layers.

mlx-lm's decoder runs unchanged (its embedding, its loop, its final norm):
this module only replaces entries of its `layers` list. Layers of other
stages become pass-throughs; the stage's first layer takes its input from
the previous stage instead of what the loop hands it (the embedding, on a
later stage); the stage's last layer also sends its output on. So a family's
own decoder code -- embedding scale, per-layer arguments, masks -- runs as
written on every stage, and the transfers are nodes of the step's one MLX
graph. The last stage computes the final norm and the head; on the other
stages those stay unevaluated (lazy) and cost nothing.

A transport moves the hidden states: Chain (mx.distributed send/recv
between ring neighbours, topology.py) in serving, or an in-process one in
tests. What a stage sends is the output of its last layer, all rows
([1, tokens, hidden]): the next stage needs every token's state.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from vllm_metal.distributed.topology import Topology


class Chain:
    """Stage transfers over MLX's distributed group (ring neighbours only,
    in order: comm.py): a rank of a later stage receives from its left
    neighbour and, if it is not its stage's last TP rank, passes the same
    rows on to its right; a stage's last TP rank sends its output to the
    next stage's first rank."""

    def __init__(self, topology: Topology, comm):
        self.topology, self.comm = topology, comm

    def receive(self, like: mx.array) -> mx.array:
        t = self.topology
        h = self.comm.recv_like(like, t.rank - 1)
        if t.forwards:
            self.comm.send(h, t.rank + 1)
        return h

    def send(self, h: mx.array) -> None:
        if self.topology.sends:
            self.comm.send(h, self.topology.rank + 1)

    def take_pending(self) -> list[mx.array]:
        return self.comm.take_pending()


class _Skipped(nn.Module):
    """A layer of another stage: hands its input through. Attribute reads
    (a decoder loop asking `layer.use_sliding`) reach the real layer, which
    stays out of the module tree: its weights are never loaded here."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        object.__setattr__(self, "_layer", layer)

    def __call__(self, x, *args, **kwargs):
        return x

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__"):
                raise
            return getattr(object.__getattribute__(self, "_layer"), name)


class _StageLayer(nn.Module):
    """One of this stage's layers; the first takes its input from the
    previous stage, the last sends its output to the next."""

    def __init__(self, layer: nn.Module, transport, entry: bool, exit: bool):
        super().__init__()
        self.layer = layer
        object.__setattr__(self, "_transport", transport)
        object.__setattr__(self, "_entry", entry)
        object.__setattr__(self, "_exit", exit)

    def __call__(self, x, *args, **kwargs):
        transport = object.__getattribute__(self, "_transport")
        if object.__getattribute__(self, "_entry"):
            x = transport.receive(x)
        out = self.layer(x, *args, **kwargs)
        if object.__getattribute__(self, "_exit"):
            if not isinstance(out, mx.array):
                raise NotImplementedError(f"{type(self.layer).__name__} returns {type(out).__name__}, not one "
                                          "hidden-state array: pipeline stages cannot hand it on")
            transport.send(out)
        return out

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            layer = dict.get(self, "layer")
            if layer is None or name.startswith("__"):
                raise
            return getattr(layer, name)


def split_stages(layers: list, owned: range, transport, first: bool, last: bool) -> None:
    """Replaces, in place, the decoder's `layers` list entries: layers outside
    `owned` pass through, the first owned layer receives (unless this is the
    first stage), the last owned layer sends (unless this is the last)."""
    for i in range(len(layers)):
        if i not in owned:
            layers[i] = _Skipped(layers[i])
        elif i == owned.start or i == owned.stop - 1:
            layers[i] = _StageLayer(layers[i], transport, entry=i == owned.start and not first,
                                    exit=i == owned.stop - 1 and not last)

