"""Pipeline parallel: keep micro-batches apart so every stage has work.

vLLM keeps P batches in flight under pipeline parallel (its batch queue),
but its synchronous scheduler schedules every request that is ready: two
requests whose outputs come back close together are merged into one
micro-batch and stay merged, and the other slots run empty -- the stages
take turns instead of working at once. vLLM's own cure, for its V2 model
runner with async scheduling (AsyncScheduler), is a decode cadence: a
request decoded at scheduler step s is eligible again at step s + P
(`Request.next_decode_eligible_step`, honoured by the base scheduler).
vllm-metal implements vLLM's V1 runner contract, where vLLM runs pipeline
parallel synchronously, so this scheduler applies the same cadence there,
and spreads requests over the P lanes (a request joining a busy lane waits
up to P - 1 steps more, once) so concurrent requests fill all micro-batches.

Targets vLLM 0.33's Scheduler (`_update_after_schedule`, `current_step`,
`Request.next_decode_eligible_step`); tests/distributed/test_scheduler.py
fails if those change.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

QUALNAME = "vllm_metal.distributed.scheduler.PipelineScheduler"


def stagger_decodes(requests: dict, scheduled: list[str], current_step: int, stages: int) -> None:
    """Requests decoding this step wait at least `stages` steps for their
    next decode, and as many more (< stages) as put them in the least busy
    lane (lane: eligible step mod stages), so that requests that became
    ready together spread over the micro-batches instead of sharing one.
    A request moves lanes at most once per step by less than a round."""
    lanes = [0] * stages
    mine = set(scheduled)
    for req_id, request in requests.items():
        if req_id not in mine and not request.is_prefill_chunk and request.next_decode_eligible_step:
            lanes[request.next_decode_eligible_step % stages] += 1
    for req_id in scheduled:
        request = requests[req_id]
        if request.is_prefill_chunk:
            continue
        base = current_step + stages
        step = min(range(base, base + stages), key=lambda t: (lanes[t % stages], t))
        request.next_decode_eligible_step = step
        lanes[step % stages] += 1


class PipelineScheduler(Scheduler):
    def _update_after_schedule(self, scheduler_output) -> None:
        super()._update_after_schedule(scheduler_output)
        stages = self.parallel_config.pipeline_parallel_size
        if stages > 1:
            stagger_decodes(self.requests, list(scheduler_output.num_scheduled_tokens), self.current_step, stages)
