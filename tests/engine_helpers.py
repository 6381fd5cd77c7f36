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
    keep_upstream_caches_only_for(model_dir)
    llm = LLM(model_dir, **args)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        # Garbage collection: a full collection of a test worker's ~740k objects takes 0.4-0.65 s,
        # and this used to run three per engine: vLLM's start-up (freeze_gc_heap: collect, then
        # gc.freeze), its shutdown (gc.unfreeze, collect) and one here. Now only the shutdown's:
        # nothing is collected here, and everything alive is frozen, so the next engine's start-up
        # collects only what was made since. Garbage made from here on (this engine once the
        # caller lets go of it, a model's tokenizers once uncached) stays until the next engine's
        # shutdown, or the file's end (release_upstream_caches), unfreezes and collects it.
        gc.freeze()


# Upstream caches a test process must not keep from one model to the next: vLLM keys
# tokenizers, processors and chat-template facts by model path in functools.lru_caches
# (vllm.tokenizers.registry.cached_get_tokenizer, vllm.transformers_utils.processor.
# get_processor, vllm.renderers.hf's chat-template helpers, ...), ~100 MB per tiny model with
# the renderer's tokenizer copies. A server holds one model and never notices; a test file that
# builds an engine per family grew a pytest worker by 3 GB (pooling and LoRA families, family
# parity: two xdist workers reached 8-10 GB and one was OOM-killed). The modules are named, not
# found by scanning the heap: a scan of the ~900k objects costs a second per engine.
# tests/engine/test_engine_teardown.py fails if vLLM moves the tokenizer cache elsewhere.
UPSTREAM_CACHE_MODULES = (
    "vllm.tokenizers.registry", "vllm.tokenizers.hf", "vllm.transformers_utils.processor",
    "vllm.transformers_utils.config", "vllm.transformers_utils.repo_utils", "vllm.transformers_utils.utils",
    "vllm.renderers.hf", "vllm.renderers.registry", "vllm.renderers.chat_utils.chat_template",
    # supports_kw's cache keys hold the renderer's per-tokenizer pool class's methods (and so its
    # tokenizer copies)
    "vllm.utils.func_utils",
)


def _upstream_caches() -> list:
    import functools
    import sys

    found = []
    for name in UPSTREAM_CACHE_MODULES:
        module = sys.modules.get(name)
        found += [v for v in vars(module).values() if isinstance(v, functools._lru_cache_wrapper)] if module else []
    return found


def upstream_caches_hold_entries() -> bool:
    return any(cache.cache_info().currsize for cache in _upstream_caches())


def clear_upstream_caches() -> None:
    """Empties the model-keyed lru_caches of UPSTREAM_CACHE_MODULES."""
    global _kept_for
    for cache in _upstream_caches():
        cache.cache_clear()
    _kept_for = None


# The model (its path and files as they were) whose upstream cache entries the engines of a test file
# share: engine() empties the caches when it starts an engine of another model, or of files changed
# since, and the file's end (conftest.py) empties them. Kept, a model's tokenizer is loaded once
# instead of once per engine: vLLM's renderer set-up took 17.1 s of a tiny model's 27 s engine start
# uncached, 7.9 s cached (profiled on a loaded core; what remains is the renderer's own deep copies).
_kept_for = None


def _model_key(model_dir: str) -> tuple:
    import os

    path = os.path.realpath(model_dir)
    if not os.path.isdir(path):
        return (path,)
    return (path, *sorted((e.name, e.stat().st_mtime_ns, e.stat().st_size) for e in os.scandir(path)))


def keep_upstream_caches_only_for(model_dir: str) -> None:
    """Empties the upstream caches unless they were kept for this model, as it is now on disk."""
    global _kept_for
    key = _model_key(model_dir)
    if key != _kept_for:
        clear_upstream_caches()
        _kept_for = key


def release_upstream_caches() -> None:
    """Empties the model-keyed lru_caches of UPSTREAM_CACHE_MODULES, collects garbage and
    hands freed heap back to the OS (release_free_memory)."""
    clear_upstream_caches()
    gc.unfreeze()  # what engine() froze
    gc.collect()
    release_free_memory()


def release_free_memory() -> None:
    """Hands the allocator's free heap back to the OS: tcmalloc's (scripts/test.sh's workers,
    which keep it otherwise: a worker reached 4.8 GB in a suite run before every file's end
    released it) or glibc's."""
    import ctypes
    import ctypes.util

    process = ctypes.CDLL(None)
    if hasattr(process, "MallocExtension_ReleaseFreeMemory"):
        process.MallocExtension_ReleaseFreeMemory()
    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)


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


def paged_run(loaded, prompt: list[int], num_tokens: int, chunk: int = 64, block: int = 16,
              kv_cache_dtype: str = "auto") -> tuple[np.ndarray, list[int]]:
    """Log-softmax rows (float64) for prompt[1:] and each greedy token, and
    the tokens, from `LoadedModel.forward` (the step the model runner
    evaluates): the prompt in chunks, then greedy decode steps."""
    import mlx.core as mx
    import numpy as np

    from vllm_metal.engine.step_inputs import ScheduledRow, build_step_inputs

    windows = sorted(set(loaded.sliding_windows), key=lambda w: w or 0)
    layer_group = [windows.index(w) for w in loaded.sliding_windows]
    block_sizes = [block] * len(windows)
    kv = loaded.allocate_kv(1 + (len(prompt) + num_tokens) // block + 1, block_sizes, layer_group, kv_cache_dtype)
    blocks = list(range(1, kv.keys[0].shape[0]))  # block 0 stays the null block
    rows, tokens, done = [], [], 0
    sequence = list(prompt)
    while len(tokens) < num_tokens:
        new = sequence[done:done + chunk]
        inputs = build_step_inputs([ScheduledRow(new, done, [blocks] * len(windows))], block_sizes)
        logits = loaded.forward(kv, inputs, np.arange(len(new)))
        mx.eval(logits, kv.keys, kv.values)
        lp = np.array(logits).astype(np.float64)
        lp -= lp.max(axis=-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(axis=-1, keepdims=True))
        done += len(new)
        if done < len(sequence):  # a chunk of the prompt: every row predicts the next prompt token
            rows.append(lp)
            continue
        rows.append(lp if len(new) > 1 else lp[-1:])
        tokens.append(int(np.argmax(lp[-1])))
        sequence.append(tokens[-1])
    return np.concatenate(rows)[: len(prompt) - 1 + num_tokens], tokens
