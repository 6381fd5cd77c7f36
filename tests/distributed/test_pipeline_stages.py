"""Pipeline stages of every served family, in one process: the stages' logits
are the whole model's.

Each family's tiny random-weight model (tests/families.py) is loaded
once whole and once per stage (distributed/pipeline.py rewires mlx-lm's own
decoder), the stages joined by an in-process transport instead of MLX's
ring, and run by `LoadedModel.forward`, the step the model runner evaluates:
the prompt in two chunks, then greedy decode steps. The stages' logits must
equal the whole model's (float32, 1e-5) and so must the greedy tokens. A
family whose split cannot be served (a layer reading another stage's KV
cache) must be refused at load with the reason. The transport between
processes is tests/distributed/test_engines.py's.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import GOLDEN
from families import FAMILIES, build

from vllm_metal.distributed.plan import ParallelPlan
from vllm_metal.models.loader import load_model
from vllm_metal.models.registry import SERVED
from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs

PROMPT = GOLDEN[-1]["prompt_ids"][40:110]  # 70 tokens: two chunks
CHUNK = 48
BLOCK = 16
NUM_TOKENS = 3


class LocalPipe:
    """The stages' transport in one process: what a stage sends, the next receives."""

    def __init__(self):
        self.hidden, self.pending, self.hops = None, [], 0

    def receive(self, like):
        assert self.hidden is not None, "a stage received before the previous one sent"
        assert self.hidden.shape == like.shape and self.hidden.dtype == like.dtype
        h, self.hidden = self.hidden, None
        self.hops += 1
        return h

    def send(self, h):
        self.hidden = h
        self.pending.append(h)

    def take_pending(self):
        pending, self.pending = self.pending, []
        return pending


def run(stages, prompt, num_tokens):
    """Logits rows of every step (float32) and the greedy tokens, the step
    run through `stages` (LoadedModels) in order."""
    first = stages[0]
    windows = sorted(set(first.sliding_windows), key=lambda w: w or 0)
    layer_group = [windows.index(w) for w in first.sliding_windows]
    block_sizes = [BLOCK] * len(windows)
    num_blocks = 2 + (len(prompt) + num_tokens) // BLOCK + 1
    caches = [m.allocate_kv(num_blocks, block_sizes, layer_group) for m in stages]
    blocks = list(range(1, num_blocks))
    rows, tokens, done, sequence = [], [], 0, list(prompt)
    while len(tokens) < num_tokens:
        new = sequence[done:done + CHUNK]
        inputs = build_step_inputs([ScheduledRow(new, done, [blocks] * len(windows))], block_sizes)
        for m, kv in zip(stages, caches):
            logits = m.forward(kv, inputs, np.arange(len(new)))
            sends = m.transport.take_pending() if m.transport is not None else []
            mx.eval(*([logits] if logits is not None else []), *sends, kv.arrays())
        lp = np.array(logits)
        done += len(new)
        rows.append(lp)
        if done >= len(sequence):
            tokens.append(int(np.argmax(lp[-1])))
            sequence.append(tokens[-1])
    return np.concatenate(rows), tokens


def stages_of(path, split, **kwargs):
    pipe = LocalPipe()
    return [load_model(path, parallel=ParallelPlan(pp_rank=s, pp=len(split), layer_split=lambda n: split,
                                                   transport=pipe), **kwargs)
            for s in range(len(split))], pipe


@pytest.mark.parametrize("model_type", sorted(SERVED))
def test_stages_equal_the_whole_model(model_type, model_dir, tmp_path):
    path = build(model_type, tmp_path / model_type, model_dir)
    whole = load_model(path, fuse=True, norm_rope=True)
    n = whole.num_layers
    split = [n - n // 2, n // 2]
    try:
        stages, pipe = stages_of(path, split, fuse=True, norm_rope=True)
    except NotImplementedError as e:
        # Refused with the reason: only a KV cache shared across the split.
        assert "KV cache, which the layer split" in str(e), e
        assert any(kv.source is not None for kv in whole.layer_kv)
        return
    assert [list(m.owned) for m in stages] == [list(range(split[0])), list(range(split[0], n))]
    assert [m.last_stage for m in stages] == [False, True]
    want, want_tokens = run([whole], PROMPT, NUM_TOKENS)
    got, got_tokens = run(stages, PROMPT, NUM_TOKENS)
    assert pipe.hops == 2 + NUM_TOKENS - 1  # one hand-over a step
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert got_tokens == want_tokens


def test_three_stages_and_each_stage_caches_only_its_layers(model_dir, tmp_path):
    path = build("llama", tmp_path / "llama", model_dir)  # 3 layers, sliding and full
    stages, pipe = stages_of(path, [1, 1, 1])
    want, want_tokens = run([load_model(path)], PROMPT, NUM_TOKENS)
    got, got_tokens = run(stages, PROMPT, NUM_TOKENS)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert got_tokens == want_tokens
    for s, m in enumerate(stages):
        kv = m.allocate_kv(4, [BLOCK, BLOCK], [0, 1, 0])
        assert [k is not None for k in kv.keys] == [i == s for i in range(3)]
    # Only a stage's own layers hold weights in the module tree.
    from mlx.utils import tree_flatten

    names = [{k.split(".")[2] for k, _ in tree_flatten(m.model.parameters()) if k.startswith("model.layers.")}
             for m in stages]
    assert names == [{"0"}, {"1"}, {"2"}]
    # The memory budget counts what a stage holds: the middle one only its layer's weights.
    middle = sum(v.nbytes for _, v in tree_flatten(stages[1].model.model.layers[1].parameters()))
    assert stages[1].weights_bytes == middle
    assert stages[0].weights_bytes > middle and stages[2].weights_bytes > middle  # + embedding / head


def test_a_family_layer_that_returns_no_array_is_refused_at_the_hand_over():
    import mlx.nn as nn

    from vllm_metal.distributed.pipeline import split_stages

    class Pair(nn.Module):
        def __call__(self, x, *args, **kwargs):
            return x, None

    layers = [Pair(), Pair()]
    split_stages(layers, range(0, 1), LocalPipe(), first=True, last=False)
    with pytest.raises(NotImplementedError, match="returns tuple, not one hidden-state array"):
        layers[0](mx.zeros((1, 2, 4)))
