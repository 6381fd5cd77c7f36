"""Drafts from a smaller model (vLLM's method "draft_model"): a second
LoadedModel with its own paged KV cache, proposing greedily.

The cache: the draft model's layers are declared to vLLM beside the
target's (`layer_name`), so vLLM sizes and groups them with the target's
and one block table addresses both caches (vLLM's GPU runner does the same:
the drafter's attention layers join the KV-cache config). The draft model
writes a request's tokens into the same slots as the target, lazily: only
when the request drafts, and then every token since its last draft (its
whole prompt the first time: a catch-up). `written` says how far each
request's draft cache holds its own tokens; nothing else is trusted (a
prefix-cached block is written again -- the same tokens at the same
positions give the same values), and a preempted request starts over. A
request that never drafts costs the draft model nothing, so a draft model
whose drafts do not pay costs only the requests that found that out.

The proposal (`propose`), after the step's tokens are on the host: pass 1
runs each drafting request's unwritten tokens (its newest last), pass j > 1
one token -- the draft model's own argmax of the pass before -- at the
request's next position; the k passes are built as one lazy graph and
evaluated once (only the drafts leave it). vLLM reserves k lookahead slots
past every scheduled row for the passes' writes
(`VllmConfig.num_lookahead_tokens`); a request drafts no further than its
blocks reach or max_model_len allows; a rejected draft's slot is written
again with the accepted token by the next catch-up. Drafting is greedy, as
vLLM's model proposers are: the rejection sampler then treats each draft
as certain (speculative/rejection.py), which keeps the target distribution.

Who starts drafting (`CatchUpGate`, with the budget): a catch-up costs a
prefill of the request through the draft model, so until the budget has a
cost fit and MIN_POOLED verified rows of this draft model's acceptance,
one request at a time catches up (the others wait for the evidence); then
the budget decides from the pooled acceptance (budget.py). When no request
has drafted for REPROBE steps, the pooled evidence is dropped and one
request probes again.
"""

from __future__ import annotations

from typing import Callable, Container, Sequence

import mlx.core as mx
import numpy as np

from vllm_metal.models.attention_adapter import PagedKVCache
from vllm_metal.models.loaded_model import LoadedModel

# step inputs for rows of tokens: (rows of the batch, each row's tokens, their first positions) -> StepInputs
InputsFor = Callable[[np.ndarray, Sequence[Sequence[int]], np.ndarray], object]
# a drafting request's tokens from a position to its newest: (req_id, position) -> token ids
Tail = Callable[[str, int], Sequence[int]]

MIN_POOLED = 8  # verified rows of the draft model's drafts before more than one request catches up at once
REPROBE = 256  # steps with candidates and no draft before the pooled evidence is dropped (one request probes)


class CatchUpGate:
    """Which requests may draft this step: those already drafting, as the
    budget keeps them, and requests that have never drafted (a catch-up
    each) only when the budget has evidence that drafts pay -- until then
    one at a time, while no other request drafts. Without a budget
    (VLLM_METAL_SPEC_BUDGET=0) every request drafts, as in vLLM."""

    def __init__(self):
        self.idle = 0  # consecutive steps with candidates and no draft kept
        self.reprobes = 0  # times the pooled evidence was dropped (instrumentation)

    def step(self, keep: dict[str, int], written: Container[str], budget) -> dict[str, int]:
        if budget is None:
            return keep
        settled = budget.per_row is not None and budget.pool_rows >= MIN_POOLED
        if not settled:
            drafting = any(n and r in written for r, n in keep.items())
            first_new = next((r for r, n in keep.items() if n and r not in written), None)
            keep = {r: n if r in written or (r == first_new and not drafting) else 0 for r, n in keep.items()}
        if keep and not any(keep.values()):
            self.idle += 1
            if self.idle >= REPROBE:
                self.idle, self.reprobes = 0, self.reprobes + 1
                budget.reset_pool()
        elif keep:
            self.idle = 0
        return keep


class ModelDrafter:
    reads_target_cache = False  # a cache of its own, allocated beside the target's
    def __init__(self, model: LoadedModel, k: int, max_model_len: int):
        self.model, self.k, self.max_model_len = model, k, max_model_len
        self.kv: PagedKVCache | None = None
        self.written: dict[str, int] = {}  # req_id -> its positions 0 .. n-1 hold its tokens in the draft cache
        self.gate = CatchUpGate()
        self.passes = 0  # draft passes run (instrumentation)
        self.caught_up = 0  # tokens written by pass 1 (instrumentation)

    @staticmethod
    def layer_name(i: int) -> str:
        """The name of the draft model's layer i among the KV-cache specs (beside the target's)."""
        return f"draft_model.model.layers.{i}.self_attn"

    def reach(self, position: int, room: int) -> int:
        """How many drafts a request whose next token sits at `position` can
        have: passes write positions position .. position + n - 1 (within the
        `room` tokens its blocks hold) and drafts land below max_model_len."""
        return max(0, min(self.k, room - position, self.max_model_len - 1 - position))

    def restart(self, req_ids) -> None:
        """Finished or preempted requests: their blocks are gone (a resumed request catches up again)."""
        for r in req_ids:
            self.written.pop(r, None)

    def propose(self, rows: np.ndarray, req_ids: Sequence[str], positions: np.ndarray, tail: Tail,
                want: Sequence[int], inputs_for: InputsFor) -> list[list[int]]:
        """Up to want[i] greedy drafts for batch row rows[i] (request
        req_ids[i]), whose newest token sits at positions[i] (in neither
        cache yet); tail(req_id, p): its tokens from position p to the newest."""
        want = np.asarray(want, np.int64)
        passes: list[tuple[np.ndarray, mx.array]] = []  # (indices into `rows`, their drafts) per pass
        active = np.arange(len(rows))  # indices into `rows` still drafting
        tokens = None
        for j in range(int(want.max(initial=0))):
            if j == 0:  # every token since the request last drafted, its newest last
                starts = np.array([min(self.written.get(r, 0), int(p)) for r, p in zip(req_ids, positions)],
                                  np.int64)
                segments = [tail(r, int(s)) for r, s in zip(req_ids, starts)]
                inputs = inputs_for(rows, segments, starts)
                logit_rows = np.cumsum([len(t) for t in segments]) - 1
                self.caught_up += int(logit_rows[-1]) + 1 if len(segments) else 0
            else:
                keep = want[active] > j
                if not keep.all():
                    tokens = tokens[mx.array(np.flatnonzero(keep).astype(np.int32))]
                    active = active[keep]
                inputs = inputs_for(rows[active], [[0]] * len(active), positions[active] + j)
                inputs.token_ids_mx = tokens
                logit_rows = np.arange(len(active), dtype=np.int64)
            tokens = self.model.forward(self.kv, inputs, logit_rows, greedy=True)
            passes.append((active, tokens))
        drafts: list[list[int]] = [[] for _ in rows]
        if not passes:
            return drafts
        mx.eval([t for _, t in passes], self.kv.arrays())  # the passes' one evaluation
        self.passes += len(passes)
        for r, p in zip(req_ids, positions):
            self.written[r] = int(p) + 1  # its drafts' slots are rewritten by its next catch-up
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
