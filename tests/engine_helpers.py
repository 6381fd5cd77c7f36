"""Helpers for the plugin tests: in-process engines and greedy generation."""

from __future__ import annotations

import gc
import json
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).parent
GOLDEN = json.loads((HERE / "golden_tokens.json").read_text())


@contextmanager
def engine(model_dir: str, **kwargs):
    """An in-process vllm.LLM on the embedded model; torn down on exit."""
    from vllm import LLM

    args = dict(dtype="float32", max_model_len=2048, kv_cache_memory_bytes=192 << 20, seed=0)
    args.update(kwargs)
    llm = LLM(model_dir, **args)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def runner_of(llm):
    """The MetalModelRunner behind an in-process LLM."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner


def greedy(llm, prompts, max_tokens=32):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs
