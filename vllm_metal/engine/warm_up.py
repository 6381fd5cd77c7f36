"""The runner's warm-up step at start-up: the first request pays no lazy
set-up, and a model the adapter cannot serve fails here, named."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs

if TYPE_CHECKING:
    from vllm_metal.engine.model_runner import MetalModelRunner


def run(runner: MetalModelRunner) -> None:
    """A small step shaped like real traffic, into the null block: one row
    prefilling several tokens from position 0, one continuing past a block
    boundary, one decoding. The first request then pays no lazy set-up,
    and whatever the adapter cannot do for this model fails here, at
    start-up, with the model named -- never on a user's request."""
    if runner.pooling is not None:
        try:
            runner.pooling.warm_up()
        except Exception as e:  # noqa: BLE001 -- reported with the model's name, then start-up stops
            raise RuntimeError(f"vllm-metal cannot serve {runner.model_config.model} as a pooling model: a "
                               f"warm-up step failed: {type(e).__name__}: {e}") from e
        return
    groups = len(runner.block_sizes)
    block = min(runner.block_sizes)
    rows = [ScheduledRow([1, 2, 3, 4], 0, [[0]] * groups),
            ScheduledRow([5, 6, 7], block - 1, [[0, 0]] * groups),
            ScheduledRow([8], 2 * block + 5, [[0, 0, 0]] * groups)]
    inputs = build_step_inputs(rows, runner.block_sizes)
    if runner.adapters is not None:
        runner.adapters.trace()  # the projections the model's code calls: what an adapter may target
    try:
        logits, _ = runner._forward(inputs, inputs.last_token_indices.astype(np.int64))
        mx.eval(logits if logits is not None else [], runner.kv.arrays())
        if runner.adapters is not None:
            runner.adapters.seal()
    except Exception as e:  # noqa: BLE001 -- reported with the model's name, then start-up stops
        raise RuntimeError(f"vllm-metal cannot serve {runner.model_config.model}: a warm-up step "
                           f"(prefill + chunk + decode rows) failed: {type(e).__name__}: {e}") from e
    if runner.sample_in_graph and logits is not None:
        runner.mlx_model.greedy_head()  # its one-time probe at start-up, not in the first greedy step
    if logits is not None and not np.isfinite(np.array(logits, copy=False)).all():
        raise RuntimeError(f"vllm-metal cannot serve {runner.model_config.model}: the warm-up step gave "
                           "non-finite logits")
