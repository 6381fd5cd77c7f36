"""Where an engine step's time goes (issue 15's step profile), reported, not
asserted. One command:

    python benchmarks/profile_step.py [--model DIR] [--context 1024] [--batch 8]
                                      [--reps 5] [--json PATH] [--quick]

What runs. The real `MetalModelRunner` (model loaded by its own `load_model`:
float32, quantized weights expanded on MLX's CPU device, the device chosen as
the worker chooses it; its KV cache from `initialize_kv_cache`), driven with
hand-built vLLM `SchedulerOutput`s exactly as the worker drives it:
`execute_model(scheduler_output)` then `sample_tokens(None)`. Three cases:

- decode, batch 1 and decode, batch `--batch`: every row has `--context`
  tokens in the cache, and each timed step schedules one token per row (the
  next step of the same requests, with a new block handed over when a row
  crosses a block boundary, as vLLM's scheduler does). The cache is filled
  beforehand by one real `--context`-token prefill of row 0
  (`LoadedModel.forward`, evaluated); the other rows' blocks are copies of
  row 0's (same bytes, distinct memory: a decode step reads 8 separate
  contexts, at 1/8 of the set-up time of prefilling them all). The rows then
  enter the batch as new requests whose first `--context` tokens are already
  computed (what a prefix-cache hit looks like to the runner);
- prefill, `--context` tokens: each timed step is a new one-row request with
  a `--context`-token prompt, the previous one finished.

Each case runs 2 warm-up steps then `--reps` timed ones (`--quick`: 1 and 1,
64-token contexts); every number is the median over the timed steps.

Phases (wall time, `time.perf_counter`, one step = `execute_model` +
`sample_tokens`; the runner's own methods are wrapped, never replaced):

- prep: from `execute_model` being called to `LoadedModel.forward` being
  called: `PersistentBatch.update(scheduler_output)` (request states, row
  order, logits-processor bookkeeping), the per-row `ScheduledRow`s and
  `build_step_inputs` (numpy). Not included: vLLM's scheduler building the
  `SchedulerOutput`, EngineCore, IPC, detokenization (outside the runner);
- graph: `LoadedModel.forward`, building the whole lazy graph (numpy -> MLX
  input arrays included), no evaluation;
- eval: the runner's one `mx.eval(logits, *caches)`;
- sample: everything after the evaluation, in two parts (both in the JSON):
  handoff, the rest of `execute_model` (logits to numpy and torch, the
  pending step), and sampler, `sample_tokens` (vLLM's `Sampler` through
  `vllm_metal.engine.sampling.sample`: greedy argmax over the vocabulary for these
  greedy requests, tokens to host ints, the `ModelRunnerOutput`);
- total: the whole step, measured end to end (not a sum). The residual
  total - (prep + graph + eval + sample) is printed: medians of separate
  phases need not add up exactly, and anything unaccounted shows there.

The evaluation by op class is ESTIMATED, each class timed alone (median of
`--reps` after 2 warm-ups) on the last timed step's real shapes and inputs:

- matmul: every linear layer except the output head (`nn.Linear`,
  `nn.QuantizedLinear`: q/k/v/o and the MLP), each module called on a
  `[1, tokens, in_features]` input of the step's dtype, all of them
  evaluated in one `mx.eval` (independent products, run one after another
  on the stream, as in the step);
- attention: the paged-attention primitive (`ops.paged_attention`) of every
  `PagedAttentionLayer`, with queries of the layer's real shape and the
  step's real caches, block tables, sequence lengths, scale, window, softcap
  and sinks; one `mx.eval` for all layers. Cache writes (`ops.write_kv`) are
  not in it;
- logits: the decoder's final norm over the step's tokens plus the model's
  own output head (`LoadedModel.logits`) on the sampled rows -- for a greedy
  step the head as it ran, `LoadedModel.greedy_tokens` (ArgmaxHead);
- rest = eval - matmul - attention - logits: element-wise ops, norms, RoPE,
  residual adds, cache writes, embedding and gathers. It is a remainder, so
  the classes sum to eval by construction; a negative rest means the
  isolated classes ran slower alone than inside the step (printed as a
  warning).

The profile runs on the malloc a served engine gets (tcmalloc on Linux's
CPU device, preloaded by re-executing this script once; VLLM_METAL_TCMALLOC=0
keeps glibc's); the output names it.

Host work = prep + graph + sample; the issue's target is < 5% of the
batch-`--batch` decode step. Only models whose layers all have a K/V cache
of their own in one KV-cache group are profiled (no hybrid linear-attention,
latent or shared-cache layers, no sliding windows). With
VLLM_METAL_SYNC_PER_LAYER=1 the per-layer evaluations fall in graph and eval
is the last one only.
"""

from __future__ import annotations

import os

if os.uname().sysname != "Darwin":  # elsewhere the plugin runs on MLX's CPU device, by opt-in
    os.environ.setdefault("VLLM_METAL_DEVICE", "cpu")

if __name__ == "__main__":  # the runner on the malloc a served engine runs on (benchmarks/served_malloc.py)
    import served_malloc

    served_malloc.reexec()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import vllm_metal  # noqa: E402,F401  (fast BLAS preloaded before mlx)
from vllm_metal.native import ops  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec  # noqa: E402

from vllm_metal.engine.model_runner import MetalModelRunner  # noqa: E402
from vllm_metal.models.attention_adapter import PagedAttentionLayer  # noqa: E402
from vllm_metal.engine.persistent_batch import PersistentBatch  # noqa: E402
from vllm_metal.engine.platform import mlx_device_name  # noqa: E402
from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs  # noqa: E402

BLOCK = 16
WARMUPS = 2
STEP_PHASES = ("prep", "graph", "eval", "sample")
CLASSES = ("matmul", "attention", "logits", "rest")
PHASES = STEP_PHASES + CLASSES + ("total", "residual", "handoff", "sampler")
COLUMNS = ("prep", "graph", "eval", "matmul", "attention", "logits", "rest", "sample", "total")


def median_ms(fn, reps: int, warmups: int) -> float:
    times = []
    for i in range(warmups + reps):
        start = time.perf_counter()
        fn()
        if i >= warmups:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def scheduler_output(new=(), cached=None, scheduled=None, finished=()) -> SchedulerOutput:
    scheduled = scheduled or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, num_common_prefix_blocks=[0],
        finished_req_ids=set(finished), free_encoder_mm_hashes=[])


class TimedRunner:
    """The real MetalModelRunner, with its forward and evaluation wrapped to
    stamp the time (the wrappers call the runner's own code)."""

    def __init__(self, model_dir: str, max_batch: int):
        device = mlx_device_name()
        mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)  # as MetalWorker.init_device
        self.stamps: dict[str, float] = {}
        self.last: tuple | None = None  # (inputs, logit_rows) of the latest step
        model_config = SimpleNamespace(model=model_dir, dtype=torch.float32, logprobs_mode="raw_logprobs",
                                       runner_type="generate", hf_config_path=None,
                                       logits_processors=None, get_vocab_size=lambda: self.vocab)
        self.vocab = 0
        config = SimpleNamespace(model_config=model_config, speculative_config=None,
                                 scheduler_config=SimpleNamespace(max_num_seqs=max(max_batch, 1)),
                                 cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"))
        self.runner = runner = MetalModelRunner(config, device)
        runner.load_model()
        loaded = runner.mlx_model
        if loaded.has_linear or any(kv.layout != "kv" or kv.source is not None for kv in loaded.layer_kv):
            raise SystemExit("profile_step: only models whose every layer has its own K/V cache are profiled")
        self.vocab = int(loaded.logits(mx.zeros((1, self.hidden_size()), dtype=loaded.dtype)).shape[-1])
        runner.vocab_size = self.vocab
        forward, evaluate = loaded.forward, runner._evaluate

        def timed_forward(kv, inputs, logit_rows, **kwargs):
            self.stamps["forward"] = time.perf_counter()
            out = forward(kv, inputs, logit_rows, **kwargs)
            self.stamps["graph_done"] = time.perf_counter()
            self.last = (inputs, logit_rows, kwargs.get("greedy", False))
            return out

        def timed_evaluate(*arrays):
            self.stamps["eval"] = time.perf_counter()
            evaluate(*arrays)
            self.stamps["eval_done"] = time.perf_counter()

        loaded.forward = timed_forward  # instance attributes: the runner calls these
        runner._evaluate = timed_evaluate

    def hidden_size(self) -> int:
        return int(self.runner.mlx_model.model.model.embed_tokens.weight.shape[1])

    def reset(self, num_blocks: int) -> None:
        """A fresh cache (vLLM's KVCacheConfig: one group, every layer) and batch."""
        runner = self.runner
        specs = runner.get_kv_cache_spec()
        groups: dict = {}
        for name, spec in specs.items():
            groups.setdefault(spec, []).append(name)
        if len(groups) != 1:
            raise SystemExit(f"profile_step: {len(groups)} KV-cache groups (sliding windows?); only one is profiled")
        runner.initialize_kv_cache(KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                                 kv_cache_groups=[KVCacheGroupSpec(names, spec)
                                                                  for spec, names in groups.items()]))
        runner.batch = PersistentBatch(runner.logitsprocs)

    def step(self, so: SchedulerOutput) -> dict[str, float]:
        self.stamps.clear()
        t0 = time.perf_counter()
        assert self.runner.execute_model(so) is None
        t1 = time.perf_counter()
        out = self.runner.sample_tokens(None)
        t2 = time.perf_counter()
        assert all(len(t) == 1 for t in out.sampled_token_ids), out.sampled_token_ids
        s = self.stamps
        return {"prep": s["forward"] - t0, "graph": s["graph_done"] - s["forward"],
                "eval": s["eval_done"] - s["eval"], "sample": t2 - s["eval_done"], "total": t2 - t0,
                "handoff": t1 - s["eval_done"], "sampler": t2 - t1}


class Profiler:
    def __init__(self, model_dir: str, context: int, batch: int, reps: int, warmups: int):
        self.timed = TimedRunner(model_dir, batch)
        self.context, self.reps, self.warmups = context, reps, warmups
        self.rng = np.random.default_rng(0)
        self.params = SamplingParams(temperature=0.0, max_tokens=context + 64)

    def prompt(self, n: int) -> list[int]:
        return self.rng.integers(100, self.timed.vocab - 1, n).tolist()

    def run_steps(self, steps) -> dict[str, float]:
        """Runs the scheduler outputs `steps` yields; medians of the timed ones (ms)."""
        rows = []
        for i, so in enumerate(steps):
            r = self.timed.step(so)
            if i >= self.warmups:
                rows.append(r)
        return {k: 1e3 * statistics.median(r[k] for r in rows) for k in rows[0]}

    def decode(self, batch: int) -> dict:
        context, steps = self.context, self.warmups + self.reps
        per_row = -(-(context + steps) // BLOCK)
        self.timed.reset(1 + batch * per_row)
        runner, loaded = self.timed.runner, self.timed.runner.mlx_model
        blocks = [list(range(1 + r * per_row, 1 + (r + 1) * per_row)) for r in range(batch)]
        prompt = self.prompt(context + 1)
        # Fill: one real prefill of row 0's context, then its blocks copied to every other row's.
        kv = runner.kv
        fill = build_step_inputs([ScheduledRow(prompt[:context], 0, [blocks[0]])], runner.block_sizes)
        mx.eval(loaded.forward(kv, fill, np.arange(1)), kv.arrays())
        used = -(-context // BLOCK)
        src = mx.array(np.array(blocks[0][:used] * (batch - 1), np.int32))
        dst = mx.array(np.array([b for row in blocks[1:] for b in row[:used]], np.int32))
        if batch > 1:
            for arrays in (kv.keys, kv.values):
                for i, a in enumerate(arrays):
                    a[dst] = a[src]
                    arrays[i] = a
            mx.eval(kv.arrays())

        def held(n_tokens: int) -> int:
            return -(-n_tokens // BLOCK)

        def steps_():
            ids = [f"d{r}" for r in range(batch)]
            # Step 0: the rows arrive with `context` tokens computed (the prefix-cache hit view).
            yield scheduler_output(
                new=[NewRequestData(ids[r], list(prompt), [], self.params, None,
                                    (blocks[r][:held(context + 1)],), context, None) for r in range(batch)],
                scheduled={i: 1 for i in ids})
            for k in range(1, steps):
                computed = context + k  # tokens in the cache before this step; one more scheduled
                grow = held(computed + 1) > held(computed)
                cached = CachedRequestData(
                    req_ids=ids, resumed_req_ids=set(), new_token_ids=[[] for _ in ids], all_token_ids={},
                    new_block_ids=[([blocks[r][held(computed)]],) if grow else None for r in range(batch)],
                    num_computed_tokens=[computed] * batch, num_output_tokens=[k] * batch)
                yield scheduler_output(cached=cached, scheduled={i: 1 for i in ids})

        return self.profile(steps_())

    def prefill(self) -> dict:
        context, steps = self.context, self.warmups + self.reps
        per_row = -(-(context + 1) // BLOCK)
        self.timed.reset(1 + per_row)
        blocks = list(range(1, 1 + per_row))

        def steps_():
            for k in range(steps):
                rid = f"p{k}"
                yield scheduler_output(
                    new=[NewRequestData(rid, self.prompt(context), [], self.params, None,
                                        (blocks[:-(-context // BLOCK)],), 0, None)],
                    scheduled={rid: context}, finished={f"p{k - 1}"} if k else ())

        return self.profile(steps_())

    def profile(self, steps) -> dict:
        out = self.run_steps(steps)
        out["residual"] = out["total"] - sum(out[p] for p in STEP_PHASES)
        out.update(self.classes())
        out["rest"] = out["eval"] - out["matmul"] - out["attention"] - out["logits"]
        return out

    def classes(self) -> dict[str, float]:
        """Each op class alone on the last timed step's real shapes (ms)."""
        runner, loaded = self.timed.runner, self.timed.runner.mlx_model
        inputs, logit_rows, greedy = self.timed.last
        tokens, dtype, kv = len(inputs.token_ids), loaded.dtype, runner.kv
        time_it = lambda fn: median_ms(fn, self.reps, self.warmups)  # noqa: E731

        linears = [m for name, m in loaded.model.named_modules()
                   if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and "lm_head" not in name]
        xs: dict[int, mx.array] = {}
        calls = []
        for m in linears:
            k = m.weight.shape[1] * (32 // m.bits if isinstance(m, nn.QuantizedLinear) else 1)
            calls.append((m, xs.setdefault(k, mx.random.normal((1, tokens, k)).astype(dtype))))
        mx.eval(list(xs.values()))
        matmul = time_it(lambda: mx.eval([m(x) for m, x in calls]))

        tables = [mx.array(t) for t in inputs.block_tables]
        seq_lens, cu = mx.array(inputs.seq_lens), mx.array(inputs.cu_seqlens_q)
        calls = []
        for i, layer in enumerate(loaded.model.model.layers):
            attn = getattr(layer, "self_attn", None)
            if not isinstance(attn, PagedAttentionLayer):
                raise SystemExit(f"profile_step: layer {i} has no PagedAttentionLayer")
            kc, vc = kv.keys[i], kv.values[i]
            q = mx.random.normal((tokens, attn.n_heads, kc.shape[-1])).astype(kc.dtype)
            sinks = attn.inner.sinks.astype(mx.float32) if attn.has_sinks else None
            calls.append((q, kc, vc, tables[kv.layer_group[i]], attn, sinks))
        mx.eval([c[0] for c in calls])
        attention = time_it(lambda: mx.eval([
            ops.paged_attention(q, kc, vc, table, seq_lens, cu, scale=attn.scale, sliding_window=attn.sliding_window,
                                softcap=attn.softcap, sinks=sinks) for q, kc, vc, table, attn, sinks in calls]))

        norm = getattr(loaded.model.model, "norm", None)
        hidden = mx.random.normal((1, tokens, self.timed.hidden_size())).astype(dtype)
        rows = mx.array(np.asarray(logit_rows, np.int32))
        mx.eval(hidden, rows)
        # The head as the step ran it: greedy steps take each row's argmax in the graph (engine/sampling.py).
        head = loaded.greedy_tokens if greedy else loaded.logits
        logits = time_it(lambda: mx.eval(head((norm(hidden) if norm else hidden)[0][rows])))
        return {"matmul": matmul, "attention": attention, "logits": logits}


def table(cases: dict) -> str:
    lines = ["| case | " + " | ".join(COLUMNS[:-1]) + " | total ms | residual |",
             "|---|" + "---:|" * (len(COLUMNS) + 1)]
    for name, r in cases.items():
        cells = [f"{r[p]:.1f} ({100 * r[p] / r['total']:.0f}%)" for p in COLUMNS[:-1]]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r['total']:.1f} | {r['residual']:+.2f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="MLX model directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--context", type=int, help="cached tokens per decode row; prefill length (default 1024)")
    ap.add_argument("--batch", type=int, default=8, help="rows of the batched decode case")
    ap.add_argument("--reps", type=int, help="timed steps per case (default 5, after 2 warm-ups)")
    ap.add_argument("--quick", action="store_true", help="tiny run for tests: 64-token contexts, 1 warm-up, 1 rep")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    context = args.context or (64 if args.quick else 1024)
    reps = args.reps or (1 if args.quick else 5)
    warmups = 1 if args.quick else WARMUPS
    if args.model is None:
        from vllm_metal.formats.default_model import ensure_default_model
        args.model = str(ensure_default_model())
    start = time.perf_counter()
    prof = Profiler(args.model, context, args.batch, reps, warmups)
    cases = {"decode, batch 1": prof.decode(1),
             f"decode, batch {args.batch}": prof.decode(args.batch),
             f"prefill, {context} tokens": prof.prefill()}
    from vllm_metal.native.allocator import engine_allocator

    print(f"model {args.model}, float32, MLX {mx.__version__} on {mx.default_device()}, "
          f"malloc: {engine_allocator()}, decode rows with "
          f"{context} cached tokens; median of {reps} steps after {warmups} warm-ups; ms (% of the step). "
          "matmul/attention/logits are estimated (each class timed alone), rest = eval - the three; "
          "residual = total - (prep + graph + eval + sample).\n")
    print(table(cases))
    for name, r in cases.items():
        if r["rest"] < 0:
            print(f"warning: {name}: rest is {r['rest']:.1f} ms: the isolated classes took longer than the eval")
    batched = cases[f"decode, batch {args.batch}"]
    host = batched["prep"] + batched["graph"] + batched["sample"]
    print(f"\nhost work (prep + graph + sample) in the batch-{args.batch} decode step: {host:.1f} ms = "
          f"{100 * host / batched['total']:.1f}% (target < 5%); run took {time.perf_counter() - start:.0f} s")
    result = {"model": args.model, "device": str(mx.default_device()), "mlx": mx.__version__,
              "malloc": engine_allocator(),
              "context": context, "batch": args.batch, "reps": reps, "warmups": warmups,
              "host_share_batched_decode": host / batched["total"], "cases": cases}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
