"""The worker's fit check before loading (MetalWorker.check_fit, native/fit.py)
on the embedded model's real config, with Metal's device info faked and with
the CPU device's budget; and the check's KV arithmetic against vLLM's own
per-layer sizes of the runner's specs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from vllm_metal.native import memory

GiB, MiB = 1 << 30, 1 << 20
# SmolLM2-135M: 30 layers of 3 KV heads of 64
PER_TOKEN = {"bfloat16": 30 * 2 * 3 * 64 * 2, "float32": 30 * 2 * 3 * 64 * 4}


def vllm_config(model, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, seed=0, **kwargs).create_engine_config()


def worker(config, device: str, pooling: bool = False):
    from vllm_metal.engine.worker import MetalWorker

    w = MetalWorker.__new__(MetalWorker)  # no device, no model: only what check_fit reads
    w.vllm_config, w.model_config, w.cache_config = config, config.model_config, config.cache_config
    w.parallel_config, w.device_name = config.parallel_config, device
    w.model_runner = SimpleNamespace(is_pooling=pooling)
    return w


def gguf_weights_by_hand(model_dir: str, dtype_bytes: int) -> int:
    """The embedded GGUF's tensors as loaded on Metal: Q4_1 as 4-bit and Q8_0 as
    8-bit MLX affine, a scale and a bias per 32 values in the model dtype; F32
    tensors in the model dtype."""
    from pathlib import Path

    from vllm_metal.formats.gguf_file import GGUFFile

    total = 0
    for t in GGUFFile(next(Path(model_dir).glob("*.gguf"))).tensors:
        n = math.prod(t.shape)
        bits = {"Q4_1": 4, "Q8_0": 8}.get(t.type_name)
        assert bits or t.type_name == "F32", t.type_name
        total += n * bits // 8 + n // 32 * 2 * dtype_bytes if bits else n * dtype_bytes
    return total


@pytest.fixture
def fake_metal(monkeypatch):
    def working_set(size):
        monkeypatch.setattr(memory, "metal_device_info", lambda: {"max_recommended_working_set_size": size})
    return working_set


def test_refused_on_metal_before_loading_with_the_numbers(model_dir, fake_metal):
    from vllm_metal.formats.checkpoint import open_checkpoint

    fake_metal(512 * MiB)  # a faked Mac: 512 MiB recommended working set
    config = vllm_config(model_dir, dtype="bfloat16", max_model_len=8192, gpu_memory_utilization=0.5)
    weights = gguf_weights_by_hand(model_dir, 2)
    needed = (8192 + 16) * PER_TOKEN["bfloat16"]  # the request and vLLM's null block
    available = int(0.5 * 512 * MiB) - weights
    assert weights < available < needed  # the weights fit, the request does not
    with pytest.raises(ValueError) as e:
        worker(config, "gpu").check_fit()
    longest = (available - 16 * PER_TOKEN["bfloat16"]) // PER_TOKEN["bfloat16"] // 16 * 16
    utilization = math.ceil((weights + needed) / (512 * MiB) * 100) / 100
    types = open_checkpoint(model_dir).details["tensor_types"]
    described = "GGUF " + ", ".join(f"{t} x{n}" for t, n in sorted(types.items()))  # "GGUF F32 x61, Q4_1 x..."
    assert str(e.value) == (
        f"vllm-metal: {model_dir} does not fit: one request of --max-model-len 8192 needs {needed / GiB:.2f} GiB "
        f"of KV cache (30 layers, --kv-cache-dtype auto), and --gpu-memory-utilization 0.50 x 0.50 GiB (Metal's "
        f"recommended working set) = 0.25 GiB, less {weights / GiB:.2f} GiB of weights ({described}, kept "
        f"packed, the rest in bfloat16), leaves {available / GiB:.2f} GiB. To serve it: --max-model-len {longest} "
        f"(the longest that fits); or --gpu-memory-utilization {utilization:.2f}; or --kv-cache-dtype fp8 (8-bit: "
        f"{needed / 2 / GiB:.2f} GiB for --max-model-len 8192); or --kv-cache-memory-bytes "
        f"{-(-needed // MiB) * MiB} ({-(-needed // MiB) / 1024:.2f} GiB).")
    # the same request with vLLM's utilization raised as named fits
    ok = vllm_config(model_dir, dtype="bfloat16", max_model_len=8192, gpu_memory_utilization=utilization)
    worker(ok, "gpu").check_fit()
    worker(vllm_config(model_dir, dtype="bfloat16", max_model_len=longest, gpu_memory_utilization=0.5),
           "gpu").check_fit()


def test_judged_by_kv_cache_memory_bytes_and_auto_length(model_dir, fake_metal):
    fake_metal(512 * MiB)
    # utilization alone would not fit it; the user's --kv-cache-memory-bytes does
    explicit = vllm_config(model_dir, dtype="bfloat16", max_model_len=8192, gpu_memory_utilization=0.5,
                           kv_cache_memory_bytes=256 * MiB)
    worker(explicit, "gpu").check_fit()
    # --max-model-len -1: vLLM finds the longest that fits itself
    auto = vllm_config(model_dir, dtype="bfloat16", max_model_len=-1, gpu_memory_utilization=0.5)
    worker(auto, "gpu").check_fit()
    # a pooling model's cache holds prompts in flight: only its weights are judged
    worker(vllm_config(model_dir, dtype="bfloat16", max_model_len=8192, gpu_memory_utilization=0.5),
           "gpu", pooling=True).check_fit()
    # weights that do not fit at all
    fake_metal(64 * MiB)
    with pytest.raises(ValueError, match=r"its weights take .* leaves nothing for the KV cache"):
        worker(vllm_config(model_dir, dtype="bfloat16", max_model_len=1024), "gpu").check_fit()


def test_cpu_device_budget(model_dir):
    """On MLX's CPU device: RAM, the cache capped at 4 GiB unless
    --kv-cache-memory-bytes sets it; the flag is named when it is too small."""
    worker(vllm_config(model_dir, dtype="float32", max_model_len=8192), "cpu").check_fit()
    small = vllm_config(model_dir, dtype="float32", max_model_len=8192, kv_cache_memory_bytes=64 * MiB)
    with pytest.raises(ValueError) as e:
        worker(small, "cpu").check_fit()
    needed = (8192 + 16) * PER_TOKEN["float32"]
    assert f"needs {needed / GiB:.2f} GiB of KV cache" in str(e.value)
    assert "--kv-cache-memory-bytes 67108864 gives it 0.06 GiB" in str(e.value)
    longest = (64 * MiB - 16 * PER_TOKEN["float32"]) // PER_TOKEN["float32"] // 16 * 16
    assert f"--max-model-len {longest} (the longest that fits)" in str(e.value)


@pytest.mark.parametrize("family", [None, "qwen3_next"])
def test_kv_arithmetic_is_vllms_per_layer_sizes(family, model_dir, tmp_path):
    """fit.kv_bytes of the footprint's layers equals the sum of vLLM's
    max_memory_usage_bytes over the specs the runner declares (kv_specs.py)
    for the same model: full attention, and a hybrid's linear-attention
    states (prefix caching's align mode) beside its attention layers."""
    from families import build

    from vllm_metal.models.footprint import checkpoint_footprint
    from vllm_metal.engine.kv_specs import kv_cache_spec
    from vllm_metal.models.loader import load_model

    path = model_dir if family is None else build(family, tmp_path / family, model_dir)
    config = vllm_config(path, dtype="float32", max_model_len=1000)
    loaded = load_model(path, dtype="float32", materialize=False)
    specs = kv_cache_spec(config, loaded, lambda i: f"model.layers.{i}.self_attn")
    expected = sum(spec.max_memory_usage_bytes(config) for spec in specs.values())
    fp = checkpoint_footprint(path, device="cpu", dtype="float32")
    cache = config.cache_config
    plan = fp.plan(1000, block_size=cache.block_size, in_flight_tokens=config.max_in_flight_tokens,
                   hybrid_manager=not config.scheduler_config.disable_hybrid_kv_cache_manager,
                   align=cache.mamba_cache_mode == "align")
    assert fp.kv_bytes(1000, block_size=plan.block_size, in_flight_tokens=plan.in_flight_tokens,
                       align=plan.align) == expected


def test_engine_refuses_before_loading(model_dir, monkeypatch):
    """vllm.LLM with a cache too small for one request of --max-model-len: the
    worker refuses before the runner loads any weight (vLLM's own check would
    come only after loading)."""
    from engine_helpers import engine

    from vllm_metal.engine.model_runner import MetalModelRunner

    def no_load(self):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(MetalModelRunner, "load_model", no_load)
    with pytest.raises(Exception, match=r"does not fit: one request of --max-model-len 2048 needs .* "
                                        r"--kv-cache-memory-bytes 8388608 gives it 0.01 GiB"):
        with engine(model_dir, max_model_len=2048, kv_cache_memory_bytes=8 << 20):
            pass
