"""AutoAWQ / GPTQ checkpoints repacked to MLX affine at load: a tiny llama
quantized here (per group of the input: a zero point and a float16 scale),
packed by vLLM's own packers (awq_pack / gptq_pack / pack_cols: the layouts
its CUDA kernels read), served through the paged path against mlx-lm's
forward on the dequantized weights (w = s * (q - z)); the preflight's
refusals name the field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_helpers import GOLDEN, paged_run
from families import logprobs_of
from gguf_models import random_model, reference_model

from vllm_metal.formats.awq_gptq import UnsupportedQuantization
from vllm_metal.models.loader import load_model

PROMPT = GOLDEN[-1]["prompt_ids"][40:100]
NUM_TOKENS = 4
TOL = 1e-3
CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256, num_hidden_layers=2,
              intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
              rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False, vocab_size=49152,
              torch_dtype="float16")
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize(w: np.ndarray, bits: int, group: int, symmetric: bool):
    """[out, in] float -> (q [in, out], zeros [in / group, out], float16 scales
    [in / group, out]) as the AWQ / GPTQ quantizers lay them out."""
    top = (1 << bits) - 1
    g = w.T.reshape(w.shape[1] // group, group, w.shape[0])  # [groups, group, out]
    if symmetric:
        scale = np.abs(g).max(axis=1) / (top // 2)
        zero = np.full(scale.shape, (top + 1) // 2)
    else:
        lo, hi = g.min(axis=1), g.max(axis=1)
        scale = (hi - lo) / top
        zero = np.clip(np.rint(-lo / scale), 0, top)
    scale = scale.astype(np.float16)
    q = np.clip(np.rint(g / scale.astype(np.float32)[:, None]) + zero[:, None], 0, top)
    return q.reshape(w.shape[1], w.shape[0]).astype(np.int64), zero.astype(np.int64), scale


def write_checkpoint(out: Path, method: str, bits: int = 4, group: int = 128, symmetric: bool = False,
                     fmt: str = "gptq", config_overrides: dict | None = None) -> dict:
    """The checkpoint directory, and the mlx-lm float weights it means."""
    from safetensors.numpy import save_file
    from vllm.model_executor.layers.quantization.utils.quant_utils import awq_pack, gptq_pack, pack_cols

    weights = random_model(CONFIG)
    tensors, meant = {}, {}
    for name, w in weights.items():
        module = name.rsplit(".", 1)[0]
        if not module.endswith(LINEAR):
            tensors[name] = w.astype(np.float16)
            meant[name] = w.astype(np.float16).astype(np.float32)
            continue
        q, z, s = _quantize(w, bits, group, symmetric)
        n_in, n_out = q.shape
        meant[name] = ((q.reshape(n_in // group, group, n_out) - z[:, None]) * s.astype(np.float32)[:, None]) \
            .reshape(n_in, n_out).T.copy()
        tq, tz = torch.from_numpy(q.astype(np.int32)), torch.from_numpy(z.astype(np.int32))
        if method == "awq":
            tensors[f"{module}.qweight"] = awq_pack(tq, bits, n_in, n_out).numpy()
            tensors[f"{module}.qzeros"] = awq_pack(tz, bits, n_in // group, n_out).numpy()
        else:
            stored = tz - (1 if fmt == "gptq" else 0)  # GPTQ v1 stores z - 1
            tensors[f"{module}.qweight"] = gptq_pack(tq, bits, n_in, n_out).numpy()
            tensors[f"{module}.qzeros"] = pack_cols(stored, bits, n_in // group, n_out).numpy()
            tensors[f"{module}.g_idx"] = (np.arange(n_in) // group).astype(np.int32)
        tensors[f"{module}.scales"] = s
    quant = ({"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
             if method == "awq" else
             {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False, "sym": symmetric,
              "checkpoint_format": fmt})
    quant.update(config_overrides or {})
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": quant}, indent=1))
    return meant


def logprobs(model, tokens) -> np.ndarray:
    return logprobs_of(model)(tokens)  # tests/families.py: float64 log-softmax of mlx-lm's forward


CASES = {
    "awq-4bit-g128": dict(method="awq"),
    "gptq-4bit-g128-sym": dict(method="gptq", symmetric=True),
    "gptq-4bit-g64-asym-v2": dict(method="gptq", group=64, fmt="gptq_v2"),
    "gptq-8bit-g128": dict(method="gptq", bits=8, symmetric=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpoint_matches_its_dequantized_weights(case, tmp_path):
    meant = write_checkpoint(tmp_path / case, **CASES[case])
    reference = reference_model(CONFIG, meant)
    for dequantize in (True, False):  # as the CPU device serves it, and kept quantized as Metal does
        loaded = load_model(str(tmp_path / case), dtype="float32", dequantize=dequantize)
        assert loaded.quantized == (not dequantize)
        got, tokens = paged_run(loaded, PROMPT, NUM_TOKENS)
        ref = logprobs(reference, PROMPT + tokens[:-1])
        rows = np.arange(len(PROMPT) - 1)
        np.testing.assert_allclose(got[rows, PROMPT[1:]], ref[rows, PROMPT[1:]], atol=TOL, err_msg=case)
        chosen = ref[len(PROMPT) - 1:][np.arange(NUM_TOKENS), tokens]
        assert (chosen >= ref[len(PROMPT) - 1:].max(axis=1) - TOL).all(), case


def test_quantization_changes_the_model(tmp_path):
    """The references differ from the float model: the repack is tested on
    weights whose quantization matters."""
    meant = write_checkpoint(tmp_path / "awq", method="awq")
    original = random_model(CONFIG)
    a, b = logprobs(reference_model(CONFIG, meant), PROMPT), logprobs(reference_model(CONFIG, original), PROMPT)
    assert np.abs(a - b).max() > 0.05


def _permuted_g_idx(d: Path):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    key = next(k for k in tensors if k.endswith(".g_idx"))
    tensors[key] = np.random.default_rng(0).permutation(tensors[key])
    save_file(tensors, str(d / "model.safetensors"))


def _no_zeros(d: Path):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.endswith(".qzeros")}, str(d / "model.safetensors"))


REFUSED = [  # (id, checkpoint, what quantization_config then says, damage to the files, message)
    ("desc_act", dict(method="gptq"), dict(desc_act=True), None, r"quantization_config.desc_act = True: act-order"),
    ("3-bit", dict(method="gptq"), dict(bits=3), None, r"quantization_config.bits = 3"),
    ("per-channel", dict(method="gptq"), dict(group_size=-1), None, r"quantization_config.group_size = -1"),
    ("awq-gemv", dict(method="awq"), dict(version="gemv"), None, r"quantization_config.version = 'gemv'"),
    ("awq-no-zero-point", dict(method="awq"), dict(zero_point=False), None, r"quantization_config.zero_point = False"),
    ("marlin-format", dict(method="gptq"), dict(checkpoint_format="marlin"), None,
     r"quantization_config.checkpoint_format = 'marlin'"),
    ("g_idx", dict(method="gptq"), None, _permuted_g_idx, r"g_idx is not input // group_size .*act-order"),
    ("no-qzeros", dict(method="awq"), None, _no_zeros, r"has no qzeros"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_unsupported_variants_are_refused_naming_the_field(case, tmp_path):
    _, kwargs, overrides, damage, message = case
    write_checkpoint(tmp_path, **kwargs, config_overrides=overrides)
    if damage:
        damage(tmp_path)
    with pytest.raises(UnsupportedQuantization, match=message):
        load_model(str(tmp_path))


def _with_tokenizer(directory: Path, model_dir: str) -> str:
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(Path(model_dir) / name, directory / name)
    return str(directory)


def test_awq_checkpoint_served_by_vllm(model_dir, tmp_path):
    """vLLM names the checkpoint's method (auto_awq); the platform serves it
    repacked instead of refusing it as a CUDA kernel. vLLM allows AWQ float16
    / bfloat16 activations only, so this runs in float16: the exact float32
    comparison is test_checkpoint_matches_its_dequantized_weights'; here the
    float16 engine stays within float16's noise of the float32 reference."""
    from engine_helpers import engine

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    meant = write_checkpoint(tmp_path / "awq", method="awq")
    with engine(_with_tokenizer(tmp_path / "awq", model_dir), dtype="float16", max_model_len=256,
                kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=32) as llm:
        assert llm.llm_engine.model_config.quantization in ("awq", "auto_awq", "awq_marlin")
        out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)],
                           SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, prompt_logprobs=0),
                           use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    ref = logprobs(reference_model(CONFIG, meant), PROMPT + tokens[:-1])
    got = np.array([out.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))])
    np.testing.assert_allclose(got, ref[np.arange(len(PROMPT) - 1), PROMPT[1:]], atol=0.05)
    chosen = ref[len(PROMPT) - 1:][np.arange(NUM_TOKENS), tokens]
    assert (chosen >= ref[len(PROMPT) - 1:].max(axis=1) - 0.05).all()


def test_vllm_refuses_unsupported_variants_before_loading(model_dir, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    write_checkpoint(tmp_path / "act", method="gptq", config_overrides=dict(desc_act=True))
    # vLLM's own GPTQ config refuses act-order first; vllm-metal's preflight says the same where it does not
    with pytest.raises(Exception, match=r"desc_act=True\) is no longer supported|quantization_config.desc_act = True"):
        EngineArgs(model=_with_tokenizer(tmp_path / "act", model_dir)).create_engine_config()
    with pytest.raises(Exception, match="Cannot find the config file for awq|serves AWQ / GPTQ only as the checkpoint"):
        EngineArgs(model=model_dir, quantization="awq").create_engine_config()


def test_doctor_describes_awq_and_refusals(tmp_path):
    from vllm_metal.doctor.capabilities import model_check

    write_checkpoint(tmp_path / "awq", method="awq")
    report = model_check(str(tmp_path / "awq"))
    assert report["served"] and report["format"] == "awq"
    assert report["quantization"] == "AWQ 4-bit, group 128: repacked to MLX affine at load"
    write_checkpoint(tmp_path / "act", method="gptq", config_overrides=dict(desc_act=True))
    refused = model_check(str(tmp_path / "act"))
    assert not refused["served"] and "quantization_config.desc_act = True" in refused["reason"]


def test_gptq_checkpoint_served_by_vllm(model_dir, tmp_path):
    """GPTQ through vLLM's config path (its method name for the checkpoint),
    float16 activations as vLLM allows them; exact in float32 above."""
    from engine_helpers import engine

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    meant = write_checkpoint(tmp_path / "gptq", method="gptq", symmetric=True)
    with engine(_with_tokenizer(tmp_path / "gptq", model_dir), dtype="float16", max_model_len=256,
                kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=32) as llm:
        assert llm.llm_engine.model_config.quantization in ("gptq", "auto_gptq", "gptq_marlin")
        out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)],
                           SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, prompt_logprobs=0),
                           use_tqdm=False)[0]
    ref = logprobs(reference_model(CONFIG, meant), PROMPT)
    got = np.array([out.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))])
    np.testing.assert_allclose(got, ref[np.arange(len(PROMPT) - 1), PROMPT[1:]], atol=0.05)
