"""Plugin activation and the platform's forced configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_metal import activation


def run_register(env_overrides: dict) -> dict:
    """register() in a fresh interpreter: its result and what it imported."""
    code = ("import json, sys, vllm_metal; r1 = vllm_metal.register(); r2 = vllm_metal.register(); "
            "print(json.dumps({'result': r1, 'again': r2, 'mlx': any(m == 'mlx' or m.startswith('mlx.') "
            "for m in sys.modules), 'torch': 'torch' in sys.modules}))")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_METAL_DEVICE"}
    env.update(env_overrides)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_inactive_where_vllms_own_platform_claims_the_host():
    """VLLM_TARGET_DEVICE=cpu makes vLLM's own CPU platform claim this host:
    the plugin then stays out (without VLLM_METAL_DEVICE), importing no MLX."""
    got = run_register({"VLLM_TARGET_DEVICE": "cpu"})
    assert got["result"] is None and got["again"] is None
    assert not got["mlx"]
    got = run_register({})  # nothing claims it: active by itself, still without MLX
    assert got["result"] == "vllm_metal.engine.platform.MetalPlatform" and not got["mlx"]


def test_active_with_cpu_opt_in_and_imports_no_mlx():
    got = run_register({"VLLM_METAL_DEVICE": "cpu"})
    assert got["result"] == got["again"] == "vllm_metal.engine.platform.MetalPlatform"
    assert not got["mlx"], "register() must not import MLX (vLLM forks after it)"


def test_bad_device_value_is_inactive_with_reason():
    active, why = activation.activation_reason(system="linux", machine="x86_64", device="tpu", has_mlx=True)
    assert not active and "'tpu'" in why


@pytest.mark.parametrize(
    "system,machine,device,has_mlx,active",
    [
        ("darwin", "arm64", "", True, True),  # Apple Silicon: on by default
        ("darwin", "arm64", "cpu", True, True),
        ("darwin", "arm64", "", False, False),  # no MLX installed
        ("darwin", "x86_64", "", True, False),  # Rosetta / Intel Mac: only native arm64 works
        ("linux", "aarch64", "", True, False),  # vLLM's CUDA platform claims it (others faked below)
        ("linux", "x86_64", "cpu", True, True),
        ("linux", "x86_64", "gpu", True, False),
    ],
)
def test_activation_matrix(system, machine, device, has_mlx, active):
    assert activation.activation_reason(system=system, machine=machine, device=device,
                                        has_mlx=has_mlx, others=["cuda"])[0] is active


@pytest.mark.parametrize("others,active", [([], True), (["cuda"], False), (["cpu"], False), (["rocm"], False)])
def test_unclaimed_host_activates_on_mlx_cpu_only(others, active):
    """Without VLLM_METAL_DEVICE, a non-Apple host none of vLLM's platforms
    claims (vLLM alone: "Failed to infer device type") is served on MLX's CPU
    device; one that vLLM's CUDA, ROCm or CPU build serves is left to it."""
    got, why = activation.activation_reason(system="linux", machine="x86_64", device="", has_mlx=True, others=others)
    assert got is active
    assert ("MLX's CPU device" in why) if active else (others[0] in why and "VLLM_METAL_DEVICE=cpu" in why)


def test_vllm_serve_without_the_device_variable_starts_here():
    """The real detectors on this host (vLLM's CUDA wheel, no GPU): no other
    platform claims it, so the plugin activates by itself, and vLLM resolves
    to it (not UnspecifiedPlatform)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "VLLM_METAL_DEVICE"}
    code = ("from vllm_metal import activation; print(activation.other_platforms()); "
            "from vllm.platforms import current_platform as p; print(type(p).__name__, p.device_type)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["[]", "MetalPlatform cpu"], out.stdout


def test_env_vars_known_to_vllm(monkeypatch):
    monkeypatch.setenv("VLLM_METAL_DEVICE", "cpu")
    import vllm.envs as vllm_envs

    import vllm_metal

    vllm_metal.register()
    from vllm_metal.envs import ENV_VARS

    for name in ENV_VARS:
        assert name in vllm_envs.environment_variables


def test_spawn_forced_on_apple_silicon(monkeypatch):
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.setattr(activation, "is_apple_silicon", lambda *a, **k: True)
    monkeypatch.setattr(activation, "activation_reason", lambda *a, **k: (True, "faked"))
    import vllm_metal

    assert vllm_metal.register() == activation.PLATFORM_CLASS
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def test_platform_defaults(monkeypatch):
    import torch

    from vllm_metal.engine import platform

    monkeypatch.setenv("VLLM_METAL_DEVICE", "cpu")
    assert platform.MetalPlatform().supported_dtypes[0] == torch.float32
    monkeypatch.setenv("VLLM_METAL_DEVICE", "gpu")
    assert platform.MetalPlatform().supported_dtypes[0] == torch.bfloat16
    assert platform.MetalPlatform().is_cpu() is False  # keeps vLLM off torch.ops._C sampling kernels


@pytest.mark.parametrize("device", ["gpu", "cpu"])
def test_sliding_window_models_keep_the_hybrid_manager_on_both_devices(monkeypatch, device):
    """The same rule on Metal as on MLX's CPU device: a sliding-window model
    keeps vLLM's hybrid KV-cache manager (windows sized to the window; on
    Metal the shared arrays' later writers use the KV-write kernel in place),
    a model without windows does not need it."""
    from types import SimpleNamespace

    from vllm_metal.engine import platform

    monkeypatch.setenv("VLLM_METAL_DEVICE", device)
    assert platform.mlx_device_name() == device

    def config(window):
        return SimpleNamespace(model_config=SimpleNamespace(get_sliding_window=lambda: window))

    assert platform.MetalPlatform._shares_window_blocks(config(24))
    assert not platform.MetalPlatform._shares_window_blocks(config(None))
    assert not platform.MetalPlatform._shares_window_blocks(SimpleNamespace(model_config=None))


KERNEL_IMPORTS = """
import importlib.abc, json, sys
attempts = []
class Recorder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("vllm._") and name.split(".")[1].endswith("_C"):
            attempts.append(name)  # recorded whether or not the import would succeed
        return None
sys.meta_path.insert(0, Recorder())
from vllm_metal.engine.platform import MetalPlatform
from vllm.platforms.interface import Platform
getattr(%s, "import_kernels")()
print(json.dumps(attempts))
"""


@pytest.mark.parametrize("cls,expect_attempts", [("MetalPlatform", False), ("Platform", True)])
def test_import_kernels_never_touches_vllm_compiled_extensions(cls, expect_attempts):
    # In a fresh interpreter, with every import attempt of vLLM's compiled
    # extensions recorded: ours attempts none; vLLM's base class (the control,
    # what the platform would do without its override) attempts vllm._C.
    env = dict(os.environ, VLLM_METAL_DEVICE="cpu")
    out = subprocess.run([sys.executable, "-c", KERNEL_IMPORTS % cls], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    attempts = json.loads(out.stdout.strip().splitlines()[-1])
    assert bool(attempts) is expect_attempts, attempts
    if expect_attempts:
        assert "vllm._C" in attempts


def test_v1_runner_contract_is_forced(model_dir, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    import vllm_metal

    monkeypatch.setenv("VLLM_METAL_DEVICE", "cpu")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    vllm_metal.register()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert EngineArgs(model=model_dir, max_model_len=256).create_engine_config().use_v2_model_runner is False
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(Exception, match="V1 model-runner contract.*unset VLLM_USE_V2_MODEL_RUNNER"):
        EngineArgs(model=model_dir, max_model_len=256).create_engine_config()


def test_bad_sgemm_choice_refused_at_engine_start(model_dir, monkeypatch):
    """VLLM_METAL_SGEMM is read by the BLAS set-up before MLX loads (which only
    reports a bad value); the platform refuses it by name when the engine starts."""
    from vllm.engine.arg_utils import EngineArgs

    import vllm_metal

    monkeypatch.setenv("VLLM_METAL_DEVICE", "cpu")
    monkeypatch.setenv("VLLM_METAL_SGEMM", "fastest")
    vllm_metal.register()
    with pytest.raises(Exception, match="VLLM_METAL_SGEMM='fastest': use 'auto', 'mkl', 'openblas'"):
        EngineArgs(model=model_dir, max_model_len=256).create_engine_config()
