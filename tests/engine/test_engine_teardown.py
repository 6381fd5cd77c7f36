"""An engine that is shut down leaves nothing of its model behind in the process: no model
runner, no MLX memory, and (once the upstream caches are emptied, which a test engine of another
model does first and every test file's end does, and the next garbage collection) no tokenizer of
its model path. The suite builds hundreds of engines in two processes; what one keeps, all keep
(3 GB per family-sweeping file, measured)."""

from __future__ import annotations

import gc
import os
import weakref

import mlx.core as mx
from engine_helpers import engine, greedy, keep_upstream_caches_only_for, runner_of


def tokenizers_of(path: str) -> list:
    """Live tokenizer objects loaded from `path` (frozen ones too: engine_helpers.engine and vLLM
    freeze the heap, and gc.get_objects does not list what is frozen)."""
    gc.unfreeze()
    gc.collect()
    return [obj for obj in gc.get_objects()
            if "Tokenizer" in type(obj).__name__ and getattr(obj, "name_or_path", None) == path]


def test_a_shut_down_engine_leaves_no_runner_memory_or_tokenizer(model_dir, tmp_path):
    # The model under a path of its own (links to the same files), so nothing another test
    # file holds can be mistaken for what this engine left.
    own = tmp_path / "model"
    own.mkdir()
    for name in os.listdir(model_dir):
        os.symlink(os.path.join(model_dir, name), own / name)
    held = mx.get_active_memory()  # what this process's earlier tests left (module constants)
    with engine(str(own), max_model_len=256) as llm:
        tokens, _ = greedy(llm, [[1, 2, 3, 4]], max_tokens=4)
        assert len(tokens[0]) == 4
        assert tokenizers_of(str(own)), "the probe finds the live engine's tokenizer"
        runner = weakref.ref(runner_of(llm))
        assert mx.get_active_memory() > held + (1 << 20)
    del llm  # the with-target outlives the block
    assert runner() is None, gc.get_referrers(runner())
    # Kept for the next engine of the same model; what an engine of another model does first:
    keep_upstream_caches_only_for(model_dir)
    assert tokenizers_of(str(own)) == []
    # (a first engine in a process creates an 8-byte module constant; the model's weights and
    # cache are > 100 MB)
    assert mx.get_active_memory() <= held + 1024
