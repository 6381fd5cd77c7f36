"""Drafts from a smaller model (vLLM's method "draft_model"): a second
LoadedModel with its own paged KV cache, proposing greedily.

The cache: the draft model's layers are declared to vLLM beside the
target's (`layer_name`), so vLLM sizes and groups them with the target's
and one block table addresses both caches (vLLM's GPU runner does the same:
the drafter's attention layers join the KV-cache config). The draft model
runs every token the target runs, in the target's step graph and into the
same slots (`write`): its cache is then a function of the blocks' tokens
exactly as the target's is, so prefix caching, chunked prefill, preemption
and rejected drafts (their slots rewritten next step) need nothing of
their own.

The proposal (`propose`), after the step's tokens are on the host: pass j
runs one token per drafting request -- the request's new last token, then
the draft model's own argmax of the pass before -- at the request's next
positions, k passes built as one lazy graph and evaluated once (only the
drafts leave it). vLLM reserves k lookahead slots past every scheduled row
for this (`VllmConfig.num_lookahead_tokens`); a request drafts no further
than its blocks reach or max_model_len allows. Drafting is greedy, as
vLLM's model proposers are: the rejection sampler then treats each draft
as certain (speculative/rejection.py), which keeps the target
distribution.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np

from vllm_metal.models.attention_adapter import PagedKVCache
from vllm_metal.models.loaded_model import LoadedModel

# step inputs for one token per row: (rows of the batch, their positions) -> StepInputs (the runner's)
InputsFor = Callable[[np.ndarray, np.ndarray], object]

OFF_AFTER = 16  # decode steps in which the budget kept no draft before the draft model stops writing its cache
REPROBE = 256  # steps off before it writes (and may draft) again


class WritingSwitch:
    """Whether the draft model writes its cache in the step's graph (the
    share of every step it costs, drafting or not). When the budget keeps
    no draft of any request for OFF_AFTER decode steps in a row, the draft
    model stops: no cache writes, no passes. A request that ran while it was
    off has holes in its draft cache and never drafts again (its drafts
    would still be verified -- a hole costs acceptance, never output -- but
    they would mostly be rejected); after REPROBE steps the draft model
    writes again, and requests it sees from then on may draft (their
    prefix-cached blocks may hold holes too). Without a budget
    (VLLM_METAL_SPEC_BUDGET=0) it never turns off."""

    def __init__(self):
        self.writing = True
        self.idle = 0  # consecutive steps with candidates and no draft kept
        self.off_steps = 0
        self.holed: set[str] = set()
        self.turned_off = 0  # times it stopped (instrumentation)

    def step(self, req_ids: list[str], keep: dict[str, int], budget) -> dict[str, int]:
        """This step's allotment, less requests whose draft cache has holes (or all, while off)."""
        if not self.writing:
            self.holed.update(req_ids)
            self.off_steps += 1
            if self.off_steps >= REPROBE:
                self.writing, self.idle = True, 0
            return {}
        keep = {r: n for r, n in keep.items() if r not in self.holed}
        if budget is not None and budget.per_row is not None and keep and not any(keep.values()):
            self.idle += 1
            if self.idle >= OFF_AFTER:
                self.writing, self.off_steps, self.turned_off = False, 0, self.turned_off + 1
                self.holed.update(req_ids)
                return {}
        elif any(keep.values()):
            self.idle = 0
        return keep

    def forget(self, req_ids) -> None:
        self.holed.difference_update(req_ids)


class ModelDrafter:
    def __init__(self, model: LoadedModel, k: int, max_model_len: int):
        self.model, self.k, self.max_model_len = model, k, max_model_len
        self.kv: PagedKVCache | None = None
        self.switch = WritingSwitch()
        self.passes = 0  # draft passes run (instrumentation)

    @staticmethod
    def layer_name(i: int) -> str:
        """The name of the draft model's layer i among the KV-cache specs (beside the target's)."""
        return f"draft_model.model.layers.{i}.self_attn"

    def write(self, inputs) -> list[mx.array]:
        """The step's tokens through the draft model, lazily, into its cache
        (the target's slots): the cache arrays to evaluate with the step."""
        self.model.forward_hidden(self.kv, inputs)  # the hidden states themselves are never asked for
        return self.kv.arrays()

    def reach(self, position: int, room: int) -> int:
        """How many drafts a request whose next token sits at `position` can
        have: passes write positions position .. position + n - 1 (within the
        `room` tokens its blocks hold) and drafts land below max_model_len."""
        return max(0, min(self.k, room - position, self.max_model_len - 1 - position))

    def propose(self, rows: np.ndarray, positions: np.ndarray, last_tokens: list[int], want: list[int],
                inputs_for: InputsFor) -> list[list[int]]:
        """Up to want[i] greedy drafts for batch row rows[i], whose newest
        token last_tokens[i] sits at positions[i] (not yet in either cache)."""
        want = np.asarray(want, np.int64)
        passes: list[tuple[np.ndarray, mx.array]] = []  # (indices into `rows`, their drafts) per pass
        tokens = mx.array(np.asarray(last_tokens, np.int32))
        active = np.arange(len(rows))  # indices into `rows` still drafting
        for j in range(int(want.max(initial=0))):
            keep = want[active] > j
            if not keep.all():
                tokens = tokens[mx.array(np.flatnonzero(keep).astype(np.int32))]
                active = active[keep]
            inputs = inputs_for(rows[active], positions[active] + j)
            inputs.token_ids_mx = tokens
            tokens = self.model.forward(self.kv, inputs, np.arange(len(active), dtype=np.int64), greedy=True)
            passes.append((active, tokens))
        drafts: list[list[int]] = [[] for _ in rows]
        if not passes:
            return drafts
        mx.eval([t for _, t in passes], self.kv.arrays())  # the passes' one evaluation
        self.passes += len(passes)
        for active, tokens in passes:
            for a, t in zip(active, tokens.tolist()):
                drafts[a].append(t)
        return drafts


def load_drafter(spec_config, dtype: str, dequantize: bool, fuse: bool, norm_rope: bool) -> ModelDrafter:
    """The draft model of `--speculative-config` (its vLLM ModelConfig), loaded as the target is."""
    from vllm_metal.models.loader import load_model

    config = spec_config.draft_model_config
    model = load_model(config.model, dtype=dtype, dequantize=dequantize, fuse=fuse, norm_rope=norm_rope,
                       config_path=config.hf_config_path)
    if model.has_linear:
        raise ValueError(f"draft model {config.model} has linear-attention (recurrent) layers: vllm-metal drafts "
                         "with attention-only models (their drafts' cache slots are simply rewritten)")
    return ModelDrafter(model, spec_config.num_speculative_tokens, spec_config.target_model_config.max_model_len)
