"""Drafts under vLLM's async scheduling: the runner's own, put where the
scheduler left placeholders.

With async scheduling (vLLM's default for a draft model, MTP and EAGLE-3)
the engine schedules step N+1 before step N's output exists. Each request
that decoded in N gets `num_spec_tokens` placeholder drafts (-1) in N+1 and
an optimistic `num_computed_tokens`: every draft of N assumed accepted. The
engine never asks for the drafts (`take_draft_token_ids` is called only for
grammar checks), and rolls `num_computed_tokens` back over N's rejected
drafts when N's output arrives. The runner finishes N first (its tokens
sampled, accepted, the next drafts proposed), then runs each such row from
the request's real position -- its last known token, the first one not in
the cache -- with its real drafts, as many as the placeholders allow
(vLLM's GPU runner does the same on the device: its drafts replace the
placeholders and each row's start is shifted back by N's rejections).

A row that drafts less than it was scheduled for runs shorter; the
scheduler counts the missing drafts as proposed and rejected (what its
metrics report: the runner's counters count them as padding), which rolls
its count back to the same position. A request that step N finished (its
length reached, a stop token sampled) is scheduled once more when N+1 is
scheduled before N's output; it runs one token, no drafts (and vLLM, which
drops that output, counts nothing for it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllm.v1.core.sched.output import SchedulerOutput


def finished(state, max_model_len: int, newest: int) -> bool:
    """The request's newest `newest` tokens (a step's accepted drafts and its token) ended it: vLLM's
    check_stop (less stop strings: they are matched on text, after the step)."""
    p, out = state.sampling_params, state.output_token_ids
    if not out or p is None:
        return False
    stops = {p.eos_token_id, *(p.stop_token_ids or ())} - {None}
    return (state.num_tokens >= max_model_len or len(out) >= p.max_tokens
            or any(t in stops for t in out[-newest:]))


@dataclass
class Substituted:
    so: SchedulerOutput
    padded_rows: int = 0  # rows that run fewer drafts than scheduled (vLLM counts them as drafting)
    padded_drafts: int = 0  # ... and the drafts they do not run


def substitute(so: SchedulerOutput, states, drafts: dict[str, list[int]], max_model_len: int,
               newest: int) -> Substituted:
    """`so` with every placeholder row's drafts and token count set from
    `drafts` (req_id -> the proposal made after its last step), and those
    requests' num_computed_tokens set to their real position."""
    spec = so.scheduled_spec_decode_tokens
    if not spec:
        return Substituted(so)
    new_spec, scheduled, out = dict(spec), dict(so.num_scheduled_tokens), Substituted(so)
    for state in states:
        placeholders = spec.get(state.req_id)
        if not placeholders or any(d >= 0 for d in placeholders):
            continue
        real = list(drafts.get(state.req_id, ()))[:len(placeholders)]
        # Every known token but the newest is in the cache (the step before finished).
        state.num_computed_tokens = state.num_tokens - 1
        scheduled[state.req_id] = 1 + len(real)
        if real:
            new_spec[state.req_id] = real
        else:
            del new_spec[state.req_id]
        if len(real) < len(placeholders) and not finished(state, max_model_len, newest):
            out.padded_rows += not real  # a row with drafts is counted when verified
            out.padded_drafts += len(placeholders) - len(real)
    out.so = replace(so, scheduled_spec_decode_tokens=new_spec, num_scheduled_tokens=scheduled,
                     total_num_scheduled_tokens=sum(scheduled.values()))
    return out
