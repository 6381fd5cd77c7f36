"""The runner's view of live requests, kept across engine steps.

vLLM's scheduler sends only what changed each step (new requests, newly
computed token counts, new blocks, finished ids). This module keeps every
request's full state and the ordered batch of rows that run this step, and
tells vLLM's logits processors how rows were added, removed and moved.
Preempted requests leave the batch but keep their state until they resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.sampling_params import SamplingParams, SamplingType
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.logits_processor import MoveDirectionality
from vllm.v1.sample.logits_processor.state import BatchUpdateBuilder

from vllm_metal.engine.block_tables import BlockTables


@dataclass
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[list[int]]  # per KV-cache group
    num_computed_tokens: int
    # Appended in place: vLLM's logits processors hold a reference to it.
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt scores, filled chunk by chunk (vllm_metal.engine.prompt_logprobs) and
    # handed to vLLM once, with the request's first sampled token.
    prompt_logprobs: LogprobsTensors | None = None
    prompt_logprobs_sent: bool = False
    lora_request: object = None  # vLLM's LoRARequest: the adapter this request runs with (None: the base model)
    pooling: object = None  # a pooling model's request: its pooling.step.PoolingRow (params, prompt, states)
    # Images (vLLM's MultiModalFeatureSpec per item, prompt order) and, for
    # M-RoPE models, the prompt's 3-D positions and the offset of later tokens
    # (multimodal/step.py fills them on first sight).
    mm_features: list = field(default_factory=list)
    mrope: object = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def place_tokens(self, start: int, ids: list[int]) -> None:
        """Sets the tokens at positions start, start+1, ... (prompt positions
        are known already; output positions are overwritten or appended)."""
        n = len(self.prompt_token_ids)
        out = self.output_token_ids
        for pos, token in enumerate(ids, start):
            if pos < n:
                continue
            if pos - n < len(out):
                out[pos - n] = token
            elif pos - n == len(out):
                out.append(token)
            else:
                raise RuntimeError(f"request {self.req_id}: token for position {pos} arrived with only "
                                   f"{n + len(out)} known")

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids[start:] if start < n else []) + \
            self.output_token_ids[max(start - n, 0):end - n]


class PersistentBatch:
    """Request states plus the row order of the running batch (no holes after
    `update`) and the rows' block tables."""

    def __init__(self, logitsprocs, pooling=None):
        # A pooling model's side (engine/pooling_runner.py): vets and records
        # each new request's PoolingParams; None for a generation model.
        self.pooling = pooling
        self.requests: dict[str, RequestState] = {}
        self.rows: list[str | None] = []
        self.row_of: dict[str, int] = {}  # req_id -> its index in rows
        self.block_tables = BlockTables()
        self.logitsprocs = logitsprocs
        self._updates = BatchUpdateBuilder()
        self.num_resumed = 0  # preempted requests that came back (instrumentation)

    @property
    def req_ids(self) -> list[str]:  # also what vLLM's apply_grammar_bitmask reads
        return [r for r in self.rows if r is not None]

    def states(self) -> list[RequestState]:
        return [self.requests[r] for r in self.req_ids]

    def update(self, so: SchedulerOutput) -> None:
        """Applies one SchedulerOutput; afterwards `rows` are the rows to run."""
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self._remove(req_id)
        cached = so.scheduled_cached_reqs
        for req_id in list(self.rows):
            # Not scheduled this step (preempted, or waiting): leave the batch,
            # keep the state.
            if req_id is not None and (req_id not in so.num_scheduled_tokens
                                       or req_id in cached.resumed_req_ids):
                self._remove(req_id)

        to_add: list[RequestState] = []
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            if params is None and self.pooling is None:
                raise ValueError(f"request {new.req_id}: a generation model answers generation (sampling) "
                                 "requests only; serve an embedding or classifier model with --runner pooling")
            generator = None
            if params is not None and params.sampling_type == SamplingType.RANDOM_SEED:
                generator = torch.Generator(device="cpu")
                generator.manual_seed(params.seed)
            state = RequestState(new.req_id, list(new.prompt_token_ids or []), params, generator,
                                 [list(b) for b in new.block_ids], new.num_computed_tokens,
                                 lora_request=new.lora_request, mm_features=list(new.mm_features or []))
            if self.pooling is not None:
                self.pooling.add_request(state, new)
            self.requests[new.req_id] = state
            to_add.append(state)

        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.num_resumed += 1
                state.block_ids = [list(b) for b in new_blocks]  # its table is set when it is added
            elif new_blocks is not None:
                for group, ids in zip(state.block_ids, new_blocks):
                    group.extend(ids)
                if req_id in self.row_of:
                    self.block_tables.append(self.row_of[req_id], new_blocks)
            if req_id in cached.all_token_ids:
                # Full token list for a request not scheduled last step.
                tokens = cached.all_token_ids[req_id]
                del state.output_token_ids[:]
                state.output_token_ids.extend(tokens[len(state.prompt_token_ids):])
            if cached.new_token_ids:
                # Pipeline parallel: the scheduler sends each request's tokens
                # for this step (stages before the last never sample them).
                state.place_tokens(state.num_computed_tokens, cached.new_token_ids[i])
            if cached.num_output_tokens[i] < len(state.output_token_ids):
                del state.output_token_ids[cached.num_output_tokens[i]:]
            if req_id not in self.row_of:
                to_add.append(state)

        for state in to_add:
            self._add(state)
        self._condense()
        update = self._updates.get_and_reset(len(self.rows))
        for proc in self.logitsprocs.all:
            proc.update_state(update)

    def block_table_view(self):
        """This step's tables, row for row (see BlockTables.view)."""
        return self.block_tables.view(len(self.rows))

    def _remove(self, req_id: str) -> None:
        i = self.row_of.pop(req_id, None)
        if i is not None:
            self.rows[i] = None
            self._updates.removed_append(i)

    def _add(self, state: RequestState) -> None:
        i = self._updates.pop_removed()
        if i is None:
            i = len(self.rows)
            self.rows.append(state.req_id)
        else:
            self.rows[i] = state.req_id
        self.row_of[state.req_id] = i
        self.block_tables.set_row(i, state.block_ids)
        self._updates.added.append((i, state.sampling_params, state.prompt_token_ids,
                                    state.output_token_ids))

    def _condense(self) -> None:
        """Moves the last rows into holes so rows are dense, like vLLM's InputBatch."""
        while True:
            # Trailing holes stay registered as removed, as vLLM's InputBatch does.
            while self.rows and self.rows[-1] is None:
                self.rows.pop()
            if not self._updates.removed:
                break
            hole, last = self._updates.peek_removed(), len(self.rows) - 1
            if last < hole:
                break
            self._updates.pop_removed()
            req_id = self.rows[last]
            self.rows[hole], self.rows[last] = req_id, None
            self.row_of[req_id] = hole
            self.block_tables.move(last, hole)
            self._updates.moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
