"""Adapter directories as users bring them: both formats read right, and the
catalogue of what cannot be served refused with the reason (never loaded
half, never a crash)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from families import build
from lora_adapters import make_mlx_adapter, make_peft_adapter

from vllm.exceptions import LoRAAdapterNotFoundError

from vllm_metal.adapters.adapter_files import REFUSED, AdapterError, read_adapter


@pytest.fixture(scope="module")
def base(model_dir, tmp_path_factory) -> str:
    return build("llama", tmp_path_factory.mktemp("lora-files") / "llama", model_dir)


@pytest.fixture(scope="module")
def mlx_adapter(base, tmp_path_factory) -> str:
    return make_mlx_adapter(base, tmp_path_factory.mktemp("lora-files") / "mlx", rank=4, scale=3.0)


@pytest.fixture(scope="module")
def peft_adapter(base, tmp_path_factory) -> str:
    return make_peft_adapter(base, tmp_path_factory.mktemp("lora-files") / "peft", rank=4, alpha=12,
                             target_modules=("q_proj", "k_proj", "down_proj"), rank_pattern={"down_proj": 2})


def copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(adapter: Path, **changes) -> None:
    config = json.loads((adapter / "adapter_config.json").read_text())
    config.update(changes)
    (adapter / "adapter_config.json").write_text(json.dumps(config))


def edit_mlx_weights(adapter: Path, change) -> None:
    weights = dict(mx.load(str(adapter / "adapters.safetensors")))
    change(weights)
    mx.save_safetensors(str(adapter / "adapters.safetensors"), weights)


def edit_peft_weights(adapter: Path, change) -> None:
    from safetensors.numpy import load_file, save_file

    weights = load_file(str(adapter / "adapter_model.safetensors"))
    change(weights)
    save_file(weights, str(adapter / "adapter_model.safetensors"))


def test_mlx_lm_adapter_reads_as_mlx_lm_wrote_it(mlx_adapter):
    weights = dict(mx.load(str(Path(mlx_adapter) / "adapters.safetensors")))
    got = read_adapter("a", mlx_adapter, max_rank=16)
    assert got.format == "mlx-lm" and {m.a.shape[1] for m in got.modules} == {4}
    # mlx-lm's default keys (every Linear) in its num_layers=2 last layers of the model's 3
    assert len(got.modules) == 14 and {m.layer for m in got.modules} == {1, 2}
    for m in got.modules:
        name = f"model.layers.{m.layer}.{m.path}"
        np.testing.assert_array_equal(m.a, np.array(weights[name + ".lora_a"]))
        np.testing.assert_array_equal(m.b, np.array(weights[name + ".lora_b"]))
        assert m.scale == 3.0


def test_peft_adapter_reads_with_peft_scaling_and_rank_pattern(peft_adapter):
    from safetensors.numpy import load_file

    tensors = load_file(str(Path(peft_adapter) / "adapter_model.safetensors"))
    got = read_adapter("p", peft_adapter, max_rank=16)
    assert got.format == "peft"
    by_path = {(m.layer, m.path): m for m in got.modules}
    assert set(by_path) == {(i, p) for i in (0, 1, 2) for p in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj")}
    q = by_path[(1, "self_attn.q_proj")]
    a = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    np.testing.assert_array_equal(q.a, a.T)
    assert q.scale == 12 / 4 and q.a.shape[1] == 4
    down = by_path[(0, "mlp.down_proj")]
    assert down.a.shape[1] == 2 and down.scale == 12 / 2  # rank_pattern: its own rank, alpha / r


def test_peft_rslora_scaling(base, tmp_path):
    adapter = make_peft_adapter(base, tmp_path / "rs", rank=4, alpha=8, use_rslora=True)
    assert {m.scale for m in read_adapter("rs", adapter, 16).modules} == {8 / 2}  # alpha / sqrt(r)


# ---- the catalogue -----------------------------------------------------------------

def mlx_case(name, edit):
    return pytest.param("mlx", edit, id=name)


def peft_case(name, edit):
    return pytest.param("peft", edit, id=name)


def drop(key_part):
    return lambda w: [w.pop(k) for k in [k for k in w if key_part in k]]


BAD = [
    # (format, edit(adapter_dir), the message's words)
    (mlx_case("not-json", lambda d: (d / "adapter_config.json").write_text("{nope")), "cannot be read as JSON"),
    (mlx_case("config-a-list", lambda d: (d / "adapter_config.json").write_text("[1, 2]")), "holds list"),
    (mlx_case("neither-format", lambda d: (d / "adapter_config.json").write_text('{"hello": 1}')),
     "neither PEFT's"),
    (mlx_case("full-fine-tune", lambda d: edit_config(d, fine_tune_type="full")), "full fine-tune"),
    (mlx_case("dora", lambda d: edit_config(d, fine_tune_type="dora")), "DoRA"),
    (mlx_case("unknown-type", lambda d: edit_config(d, fine_tune_type="ia3")), "not one of lora, dora, full"),
    (mlx_case("alpha-not-scale", lambda d: edit_config(d, lora_parameters={"rank": 4, "alpha": 8})),
     "uses 'scale'"),
    (mlx_case("rank-not-int", lambda d: edit_config(d, lora_parameters={"rank": "4", "scale": 1.0})),
     "not a positive integer"),
    (mlx_case("rank-above-max", lambda d: edit_config(d, lora_parameters={"rank": 32, "scale": 1.0})),
     "above --max-lora-rank 16"),
    (mlx_case("rank-mismatch", lambda d: edit_config(d, lora_parameters={"rank": 8, "scale": 1.0})),
     "rank 4 in the weights, 8 in adapter_config.json"),
    (mlx_case("truncated-weights", lambda d: (d / "adapters.safetensors").write_bytes(
        (d / "adapters.safetensors").read_bytes()[:100])), "cannot be read as safetensors"),
    (mlx_case("lora-b-missing", lambda d: edit_mlx_weights(d, drop("layers.1.mlp.up_proj.lora_b"))),
     "needs lora_a and lora_b"),
    (mlx_case("non-finite", lambda d: edit_mlx_weights(d, lambda w: w.__setitem__(
        "model.layers.1.self_attn.q_proj.lora_b", mx.full(w["model.layers.1.self_attn.q_proj.lora_b"].shape,
                                                          float("nan"))))), "non-finite"),
    (mlx_case("dora-magnitude", lambda d: edit_mlx_weights(d, lambda w: w.__setitem__(
        "model.layers.1.self_attn.q_proj.m", mx.ones((64,))))), "DoRA magnitudes"),
    (mlx_case("full-weight-inside", lambda d: edit_mlx_weights(d, lambda w: w.__setitem__(
        "model.layers.0.self_attn.q_proj.weight", mx.ones((64, 64))))), "not a LoRA weight"),
    (mlx_case("moe-experts", lambda d: edit_mlx_weights(d, lambda w: w.update({
        "model.layers.0.mlp.switch_mlp.gate_proj.lora_a": mx.ones((4, 64, 4)),
        "model.layers.0.mlp.switch_mlp.gate_proj.lora_b": mx.ones((4, 4, 128))}))), "MoE expert projections"),
    (mlx_case("embedding", lambda d: edit_mlx_weights(d, lambda w: w.update({
        "model.embed_tokens.lora_a": mx.ones((49152, 4)), "model.embed_tokens.lora_b": mx.ones((4, 64))}))),
     "embedding or the output head"),
    (mlx_case("wrong-pair-shapes", lambda d: edit_mlx_weights(d, lambda w: w.__setitem__(
        "model.layers.1.self_attn.q_proj.lora_b", mx.ones((3, 64))))), "not a rank-r pair"),
    (peft_case("dora", lambda d: edit_config(d, use_dora=True)), "DoRA"),
    (peft_case("bias", lambda d: edit_config(d, bias="all")), "bias"),
    (peft_case("modules-to-save", lambda d: edit_config(d, modules_to_save=["lm_head"])), "modules_to_save"),
    (peft_case("rank-above-max", lambda d: edit_config(d, r=32, rank_pattern={})), "greater than max_lora_rank"),
    (peft_case("not-lora", lambda d: edit_config(d, peft_type="PREFIX_TUNING")), "is not LoRA"),
    (peft_case("pickle-only", lambda d: (d / "adapter_model.safetensors").rename(d / "adapter_model.bin")),
     "adapter_model.bin (a pickle)"),
    (peft_case("rank-pattern-mismatch", lambda d: edit_config(d, rank_pattern={})),
     "rank 2 in the weights, 4 in adapter_config.json"),
    (peft_case("embedding-lora", lambda d: edit_peft_weights(d, lambda w: w.update({
        "base_model.model.model.embed_tokens.lora_embedding_A": np.ones((4, 49152), np.float32),
        "base_model.model.model.embed_tokens.lora_embedding_B": np.ones((64, 4), np.float32)}))),
     "embedding adapters"),
    (peft_case("lm-head-lora", lambda d: edit_peft_weights(d, lambda w: w.update({
        "base_model.model.lm_head.lora_A.weight": np.ones((4, 64), np.float32),
        "base_model.model.lm_head.lora_B.weight": np.ones((49152, 4), np.float32)}))),
     "embedding or the output head"),
    (peft_case("saved-full-module", lambda d: edit_peft_weights(d, lambda w: w.__setitem__(
        "base_model.model.lm_head.weight", np.ones((8, 64), np.float32)))), "not a LoRA weight"),
    (peft_case("per-expert", lambda d: edit_peft_weights(d, lambda w: w.update({
        "base_model.model.model.layers.0.mlp.experts.3.up_proj.lora_A.weight": np.ones((4, 64), np.float32),
        "base_model.model.model.layers.0.mlp.experts.3.up_proj.lora_B.weight": np.ones((128, 4), np.float32)}))),
     "MoE expert projections"),
]


@pytest.mark.parametrize("fmt,edit,words", [(c.values[0], c.values[1], w) for c, w in BAD],
                         ids=[f"{c.values[0]}-{c.id}" for c, _ in BAD])
def test_bad_adapter_is_refused_with_the_reason(fmt, edit, words, mlx_adapter, peft_adapter, tmp_path):
    adapter = copy(mlx_adapter if fmt == "mlx" else peft_adapter, tmp_path / "bad")
    edit(adapter)
    with pytest.raises(AdapterError) as e:
        read_adapter("bad-one", str(adapter), max_rank=16)
    message = str(e.value)
    assert message.startswith(f"{REFUSED} 'bad-one' at {adapter}: "), message
    assert words in message, message


@pytest.mark.parametrize("missing", ["directory", "config", "mlx-weights", "peft-weights"])
def test_missing_files_are_vllms_not_found(missing, mlx_adapter, peft_adapter, tmp_path):
    adapter = copy(peft_adapter if missing == "peft-weights" else mlx_adapter, tmp_path / "gone")
    if missing == "directory":
        shutil.rmtree(adapter)
    elif missing == "config":
        (adapter / "adapter_config.json").unlink()
    else:
        (adapter / ("adapters.safetensors" if missing == "mlx-weights" else "adapter_model.safetensors")).unlink()
    with pytest.raises(LoRAAdapterNotFoundError):
        read_adapter("gone", str(adapter), max_rank=16)
