"""Which tokens each scheduled request runs this step, which rows sample,
and which input tokens the graph takes from the previous step's graph.

Token feed (vLLM's async scheduling): the engine schedules step N+1 before
step N's tokens reach the host. When step N sampled in its graph
(sampling.greedy_in_graph), a request decoding in N+1 needs exactly one
token the host does not know yet, the one N sampled for it: its row reads
it from N's token array inside N+1's graph, so N+1 is built and queued
while N computes -- as vLLM's GPU runner copies the previous step's sampled
ids on the device. Anything else (more than one unknown token, or a request
N did not sample) is answered by finishing N first (`plan` returns None).

Speculative decoding: a request with drafts runs its last token plus the
drafts as one row (query length k + 1); every position of it is scored
(the target rows, after the prompt-score rows) and speculative/ verifies them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from vllm_metal.engine import prompt_logprobs
from vllm_metal.engine.persistent_batch import RequestState
from vllm_metal.engine.step_inputs import ScheduledRow
from vllm_metal.speculative.speculator import VerifyRow


@dataclass
class StepRows:
    rows: list[ScheduledRow] = field(default_factory=list)
    discard: list[bool] = field(default_factory=list)  # no token this step (still prefilling, failed load)
    logit_rows: list[int] = field(default_factory=list)  # each row's last token, then prompt-score rows
    prompt_rows: list[tuple[RequestState, int, int]] = field(default_factory=list)  # (state, start, rows)
    fed_at: list[int] = field(default_factory=list)  # packed token indices read from the previous step
    fed_from: list[int] = field(default_factory=list)  # ... and the row of its tokens each comes from
    verify: list[VerifyRow] = field(default_factory=list)  # rows with drafts (speculative decoding)
    padded_rows: int = 0  # rows vLLM padded with placeholder drafts (-1), run as plain rows
    padded_drafts: int = 0


def plan(states: list[RequestState], num_scheduled: dict[str, int], failed_loads: set[str],
         prev_rows: dict[str, int] | None = None, spec: dict[str, list[int]] | None = None) -> StepRows | None:
    """prev_rows: req_id -> row of the unfinished previous step's in-graph
    tokens (None: every token is known on the host). spec: vLLM's
    scheduled_spec_decode_tokens. None when a row needs a token that feed
    cannot give."""
    out, offset, extra, targets = StepRows(), 0, [], []
    for i, state in enumerate(states):
        n = num_scheduled[state.req_id]
        start, known = state.num_computed_tokens, state.num_tokens
        drafts = spec.get(state.req_id) if spec else None
        padding = False
        if drafts:
            k = len(drafts)
            if start + n - k != known:
                if prev_rows is not None:  # its last token is still being sampled: finish that step first
                    return None
                raise RuntimeError(f"request {state.req_id}: {k} drafts scheduled after position {start + n - k}"
                                   f" with {known} tokens known")
            # Drafts of -1 are placeholders (vLLM pads a new decode row to 1 + k
            # tokens; an invalid draft): run as token 0, never accepted.
            out.rows.append(ScheduledRow(state.tokens(start, known) + [max(d, 0) for d in drafts], start,
                                         num_drafts=k))
            padding = all(d < 0 for d in drafts)
            if padding:  # a plain row whose tail is ignored: its token from the real next position
                out.padded_rows += 1
                out.padded_drafts += k
                n -= k
            elif state.req_id not in failed_loads:  # a failed KV load samples nothing (discarded below)
                out.verify.append(VerifyRow(i, len(targets), tuple(drafts)))
                targets.extend(range(offset + n - k - 1, offset + n - 1))  # the positions predicting each draft
        elif start + n > known:  # the token the previous step is sampling
            if prev_rows is None or start + n != known + 1 or state.req_id not in prev_rows:
                return None
            out.rows.append(ScheduledRow(state.tokens(start, known) + [0], start))
            out.fed_at.append(offset + n - 1)
            out.fed_from.append(prev_rows[state.req_id])
        else:
            out.rows.append(ScheduledRow(state.tokens(start, start + n), start))
        # still prefilling: no token this step
        out.discard.append(start + n < known or state.req_id in failed_loads)
        out.logit_rows.append(offset + n - 1)
        m = prompt_logprobs.rows_this_step(state, start, n) if state.req_id not in failed_loads else 0
        if m:
            out.prompt_rows.append((state, start, m))
            extra.extend(range(offset, offset + m))  # after every row's last token
        offset += n + (len(drafts) if padding else 0)
    out.logit_rows.extend(extra)
    out.logit_rows.extend(targets)
    return out


def token_ids(host_ids: np.ndarray, fed_at: list[int], fed_from: list[int], prev_tokens: mx.array | None) -> mx.array:
    """The step's input ids (lazy): the host's, with the fed positions read
    from the previous step's in-graph tokens."""
    ids = mx.array(host_ids)
    if fed_at:
        ids[mx.array(np.asarray(fed_at, np.int32))] = prev_tokens[mx.array(np.asarray(fed_from, np.int32))]
    return ids
