"""The runner's pooling side (`--runner pooling`): the model's final hidden
states for every scheduled token, computed as one MLX graph per step, then
vLLM's pooler (vllm_metal/pooling/).

A decoder family runs exactly as it does for generation -- the packed step
through the paged cache, so vLLM's chunked prefill and prefix caching (on
by default for last-token pooling) work -- only without the LM head and
with a KV cache sized for prompts in flight (pooling/serving_config.py). An
encoder (models/encoders.py) has no cache at all: vLLM schedules each
prompt whole, in one step.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.outputs import ModelRunnerOutput

from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs
from vllm_metal.models.encoders import EncoderModel, is_encoder, load_encoder
from vllm_metal.models.loader import DTYPES, load_model
from vllm_metal.pooling.heads import build_pooler, pooling_kind
from vllm_metal.pooling.step import PoolingRow, pool, token_type_ids

logger = init_logger("vllm." + __name__)


class PoolingSide:
    """Loads a pooling model and answers its steps (MetalModelRunner.pooling)."""

    def __init__(self, runner, dtype: str, dequantize: bool, fuse: bool, norm_rope: bool):
        self.runner = runner
        vllm_config = runner.vllm_config
        model_config = vllm_config.model_config
        self.kind = pooling_kind(model_config)
        model_type = getattr(model_config.hf_config, "model_type", None)
        start = time.perf_counter()
        self.encoder: EncoderModel | None = None
        if is_encoder(model_type):
            self.encoder = load_encoder(model_config.model, DTYPES[dtype])
            head_weights, head_rows = self.encoder.head_weights, None
        else:
            runner.mlx_model = load_model(model_config.model, dtype=dtype, dequantize=dequantize, fuse=fuse,
                                          norm_rope=norm_rope, pooling=True,
                                          config_path=model_config.hf_config_path)
            head_weights = runner.mlx_model.head_weights
            head_rows = runner.mlx_model.head_rows
        weights = {k: v for k, v in head_weights.items() if k.startswith(("score.", "pooler.", "classifier.", "head."))}
        weights = {k: np.array(v.astype(mx.float32)) if isinstance(v, mx.array) else v for k, v in weights.items()}
        self.pooler = build_pooler(vllm_config, self.kind, model_type, weights, head_rows)
        if runner.mlx_model is not None:
            runner.mlx_model.head_weights = {}  # the LM head is not kept (its rows were taken, if needed)
        logger.info("vllm-metal loaded %s as a pooling model (%s, %s, tasks: %s) in %.1fs",
                    model_config.model, self.kind, "encoder, no KV cache" if self.encoder else "decoder",
                    ", ".join(sorted(self.tasks())), time.perf_counter() - start)

    def tasks(self) -> tuple[str, ...]:
        return tuple(sorted(self.pooler.get_supported_tasks()))

    @property
    def weights_bytes(self) -> int:
        return self.encoder.weights_bytes if self.encoder is not None else self.runner.mlx_model.weights_bytes

    def add_request(self, state, new) -> None:
        params = new.pooling_params
        if params is None:
            raise ValueError(f"request {new.req_id}: a pooling model answers pooling requests only "
                             "(embed / classify / score), not generation")
        if params.task not in self.pooler.get_supported_tasks():
            raise ValueError(f"request {new.req_id}: task {params.task!r} is not served by this model "
                             f"(tasks: {', '.join(self.tasks())})")
        self.pooler.get_pooling_updates(params.task).apply(params)
        state.pooling = PoolingRow(list(new.prompt_token_ids or []), params)

    # ---- per step -------------------------------------------------------

    def hidden_states(self, states, scheduled: list[int], tables=None) -> mx.array:
        """The step's packed final hidden states, lazy float32 [tokens, hidden]
        (tables: the rows' block tables, default the persistent batch's)."""
        runner = self.runner
        if self.encoder is None:
            rows = [ScheduledRow(s.tokens(s.num_computed_tokens, s.num_computed_tokens + n), s.num_computed_tokens)
                    for s, n in zip(states, scheduled)]
            inputs = build_step_inputs(rows, runner.block_sizes, runner.group_windows,
                                       tables if tables is not None else runner.batch.block_table_view())
            return runner.mlx_model.forward_hidden(runner.kv, inputs)
        for s, n in zip(states, scheduled):
            if s.num_computed_tokens != 0 or n != len(s.prompt_token_ids):
                raise RuntimeError(f"request {s.req_id}: an encoder needs its whole prompt in one step "
                                   f"({len(s.prompt_token_ids)} tokens), got {n} from position "
                                   f"{s.num_computed_tokens} (is chunked prefill forced on?)")
        cu = np.zeros(len(states) + 1, np.int32)
        np.cumsum(scheduled, out=cu[1:])
        token_ids = np.concatenate([np.asarray(s.prompt_token_ids, np.int32) for s in states])
        types = [token_type_ids(s.pooling.params, np.arange(len(s.prompt_token_ids))) for s in states]
        type_ids = None
        if any(t is not None for t in types):
            type_ids = np.concatenate([t if t is not None else np.zeros(len(s.prompt_token_ids), np.int32)
                                       for t, s in zip(types, states)])
        keep = self._pooled_rows_only(states, cu)
        if keep is None:
            return self.encoder.forward(token_ids, cu, type_ids)
        # Only the pooled rows reach the pooler: the last layer computes them
        # alone; the other rows of the [tokens, hidden] states it is handed
        # stay zero (never read by a CLS or last-token pooler).
        rows = self.encoder.forward(token_ids, cu, type_ids, keep=keep)
        return mx.zeros((int(cu[-1]), rows.shape[1]), mx.float32).at[mx.array(keep)].add(rows)

    SEQUENCE_TASKS = ("embed", "classify", "score")

    def _pooled_rows_only(self, states, cu: np.ndarray) -> np.ndarray | None:
        """The packed row each prompt's pooler reads, when that is all it
        reads: a BERT-style encoder, CLS or last-token pooling, and a
        sequence task (one vector or score per prompt) for every request of
        the step; else None (every row is computed)."""
        kind = getattr(self.runner.vllm_config.model_config.pooler_config, "seq_pooling_type", None)
        if (self.encoder is None or not self.encoder.computes_rows_only or kind not in ("CLS", "LAST")
                or any(s.pooling.params.task not in self.SEQUENCE_TASKS for s in states)):
            return None
        return (cu[:-1] if kind == "CLS" else cu[1:] - 1).astype(np.int32)

    def execute(self, states, scheduled: list[int], tables=None) -> ModelRunnerOutput:
        runner = self.runner
        runner.forward_passes += 1
        hidden = self.hidden_states(states, scheduled, tables)
        runner._evaluate(hidden, *(runner.kv.arrays() if runner.kv is not None else []))
        hidden_t = torch.from_numpy(np.array(hidden, copy=False))
        seq_lens = np.array([s.num_computed_tokens + n for s, n in zip(states, scheduled)])
        outputs = pool(self.pooler, hidden_t, [s.pooling for s in states], np.array(scheduled), seq_lens)
        req_ids = [s.req_id for s in states]
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=[[] for _ in req_ids], pooler_output=outputs)

    def warm_up(self) -> None:
        """One small step per served task, into the null block (decoders):
        whatever the model or its head cannot do fails at start-up."""
        from vllm.pooling_params import PoolingParams

        from vllm_metal.engine.persistent_batch import RequestState

        runner = self.runner
        groups = len(runner.block_sizes)
        for task in self.tasks():
            params = PoolingParams(task=task)
            self.pooler.get_pooling_updates(task).apply(params)
            states = []
            for i, n in enumerate((4, 3)):
                state = RequestState(f"warm-up-{i}", list(range(1, n + 1)), None, None, [[0]] * groups, 0)
                state.pooling = PoolingRow(state.prompt_token_ids, params)
                states.append(state)
            tables = [(np.zeros((2, 1), np.int32), np.ones(2, np.int32)) for _ in range(groups)]
            out = self.execute(states, [4, 3], tables)
            for value in out.pooler_output:
                if value is None or not torch.isfinite(value).all():
                    raise RuntimeError(f"the warm-up step's {task} output is missing or not finite")
