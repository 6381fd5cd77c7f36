"""GGUF checkpoints: the reader, each GGML type's repack, the layouts of the
families llama.cpp writes, served through the paged path against mlx-lm on
the weights the file dequantizes to, and the catalogue of bad files.

Reference: the `gguf` package dequantizes what tests/gguf_models.py wrote;
mlx-lm's own forward on those float32 weights gives float64 log-softmax rows.
transformers' GGUF loader (its own names, permutations and norm offsets, a
torch forward) checks independently that the files mean what llama.cpp means.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import GOLDEN, paged_run
from families import logprobs_of
from gguf_models import MODELS, config_of, encode, reference_model, write

from vllm_metal.formats import gguf_checkpoint, gguf_quants
from vllm_metal.formats.default_model import gguf_path
from vllm_metal.formats.gguf_file import GGUFFile
from vllm_metal.models.loader import load_model

PROMPT = GOLDEN[-1]["prompt_ids"][40:120]
NUM_TOKENS = 4
TOL = 1e-3


def logprobs(model, tokens) -> np.ndarray:
    return logprobs_of(model)(tokens)  # tests/families.py: float64 log-softmax of mlx-lm's forward


# -- reader and types ---------------------------------------------------------

def test_reader_matches_the_gguf_package():
    from gguf import GGUFReader

    path = gguf_path()
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert fields.keys() == ours.metadata.keys()
    for key, value in fields.items():
        assert ours.metadata[key] == value or np.float32(ours.metadata[key]) == np.float32(value), key
    assert [(t.name, t.tensor_type.name) for t in theirs.tensors] == [(t.name, t.type_name) for t in ours.tensors]
    for a, b in zip(theirs.tensors, ours.tensors):
        assert np.array_equal(np.asarray(a.data).reshape(-1).view(np.uint8), b.data.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_bits_is_mlx_layout(bits, rng):
    q = rng.integers(0, 1 << bits, (3, 64)).astype(np.uint8)
    packed = gguf_quants.pack_bits(q, bits)
    assert np.array_equal(gguf_quants.unpack_bits(packed, bits), q)
    scales, biases = np.ones((3, 2), np.float32), np.zeros((3, 2), np.float32)
    back = mx.dequantize(mx.array(packed), mx.array(scales), mx.array(biases), group_size=32, bits=bits)
    assert np.array_equal(np.array(back), q.astype(np.float32))  # MLX reads the same integers


def _blocks(type_name, rows, n, rng):
    """Blocks of `type_name` encoded from Gaussian weights (tests/gguf_models.py)."""
    return encode(rng.standard_normal((rows, n)).astype(np.float32) * 0.05, type_name)[0]


@pytest.mark.parametrize("type_name", sorted(gguf_quants.EXACT_BITS))
def test_kept_types_dequantize_bit_exactly(type_name, rng):
    raw = _blocks(type_name, 6, 512, rng)
    weight, scales, biases = gguf_quants.repack_exact(raw, type_name, (6, 512))
    got = mx.dequantize(mx.array(weight), mx.array(scales), mx.array(biases), group_size=32,
                        bits=gguf_quants.EXACT_BITS[type_name])
    want = gguf_quants.dequantize(raw, type_name, (6, 512))
    assert np.array_equal(np.array(got), want)


def test_q6_k_requantized_within_the_stated_loss(rng):
    w = rng.standard_normal((64, 1024)).astype(np.float32)
    raw = encode(w, "Q6_K")[0]
    file_values = gguf_quants.dequantize(raw, "Q6_K", w.shape)
    q, s, b = gguf_quants.requantize(raw, "Q6_K", w.shape)
    got = np.array(mx.dequantize(mx.array(q), mx.array(s), mx.array(b), group_size=32, bits=8))
    rel = lambda x: np.sqrt(((x - file_values) ** 2).mean() / (file_values ** 2).mean())  # noqa: E731
    own = np.sqrt(((file_values - w) ** 2).mean() / (w ** 2).mean())
    added = rel(got)
    assert added <= gguf_quants.REQUANT_LOSS["Q6_K"] and added < 0.5 * own, (added, own)


# -- families -----------------------------------------------------------------

def _recipe(model_type):
    """A type mix per family, as the quantized files people download mix them."""
    def recipe(name, w):
        if w.shape[-1] % 256:
            return "Q8_0"
        if model_type == "llama":  # Q4_K_M: Q4_K, with Q6_K for V, the down projection and the head
            return "Q6_K" if any(k in name for k in ("v_proj", "down_proj", "lm_head")) else "Q4_K"
        if model_type == "qwen3":  # the legacy block types
            return {"q_proj": "Q4_0", "k_proj": "Q4_1", "v_proj": "Q5_0", "o_proj": "Q5_1"}.get(
                name.split(".")[-2], "Q8_0")
        if model_type == "qwen2":
            return "F16" if "mlp" in name else "Q8_0"
        if model_type == "qwen3_moe":
            return "F32" if name.endswith("mlp.gate.weight") else "Q4_K" if "switch_mlp" in name else "Q8_0"
        if model_type in ("gemma3_text", "gemma2"):
            return "Q4_0"
        if model_type == "qwen2_moe":
            return "Q5_1" if "switch_mlp" in name else "F32" if name.endswith("mlp.gate.weight") else "Q8_0"
        return "Q5_K" if "qkv" in name or "gate_up" in name else "Q5_1"  # phi3: fused projections
    return recipe


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {t: write(t, root / t, str(gguf_path()), _recipe(t)) for t in MODELS}


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_family_served_from_gguf_matches_mlx_lm(model_type, files):
    f = files[model_type]
    path, weights, config = f.path, f.served, f.config
    derived = gguf_checkpoint.config_from_metadata(path)
    for key, value in config.items():  # the metadata says what the model is
        assert derived.get(key, value) == value, f"{model_type}: {key} {derived.get(key)} != {value}"
    reference = reference_model(derived, weights)
    dequantize = model_type != "qwen3"  # one family kept MLX-quantized, as Metal serves it
    loaded = load_model(str(path), dtype="float32", dequantize=dequantize)
    assert loaded.quantized == (not dequantize)
    got, tokens = paged_run(loaded, PROMPT, NUM_TOKENS)
    ref = logprobs(reference, PROMPT + tokens[:-1])
    rows = np.arange(len(PROMPT) - 1)
    np.testing.assert_allclose(got[rows, PROMPT[1:]], ref[rows, PROMPT[1:]], atol=TOL, err_msg=model_type)
    chosen = ref[len(PROMPT) - 1:][np.arange(NUM_TOKENS), tokens]
    assert (chosen >= ref[len(PROMPT) - 1:].max(axis=1) - TOL).all(), f"{model_type}: not mlx-lm's argmax"


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_transformers_reads_the_files_alike(model_type, files):
    """transformers' own GGUF loader (names, Q/K permutation, gemma norm
    offsets, expert stacking) on the same file, run in torch: the files mean
    what the reference weights mean, independently of vllm-metal's reader."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path, config = files[model_type].path, files[model_type].config
    hf_config = AutoConfig.for_model(**{**config, "torch_dtype": "float32"})
    if model_type == "qwen3_moe":
        hf_config.norm_topk_prob = True
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=hf_config,
                                                 torch_dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].double().numpy()
    logits -= logits.max(axis=-1, keepdims=True)
    got = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    want = logprobs(reference_model(config, files[model_type].exact), PROMPT)
    np.testing.assert_allclose(got, want, atol=2e-3, err_msg=model_type)


def test_requantized_q6_k_loss_on_the_model(files):
    """The Q4_K_M-like llama's Q6_K tensors (V, down projection, head) served
    as MLX 8-bit: the next-token distributions move from the file's own
    values by a small fraction of what the file's quantization moved them
    from the float weights (mean KL divergence over the prompt, nats)."""
    f = files["llama"]
    rows = {k: logprobs(reference_model(f.config, w), PROMPT) for k, w in
            (("served", f.served), ("file", f.exact), ("float", f.original))}

    def kl(p, q):
        return (np.exp(rows[p]) * (rows[p] - rows[q])).sum(axis=-1).mean()

    added, own = kl("file", "served"), kl("float", "file")
    assert added < 0.25 * own, (added, own)


def test_the_family_tensors_are_what_the_recipe_wrote(files):
    path = files["llama"].path
    assert gguf_checkpoint.tensor_types(path) == {"F32": 5, "Q4_K": 11, "Q6_K": 5}
    described = gguf_checkpoint.describe_types(gguf_checkpoint.tensor_types(path))
    assert described["kept"] == ["Q4_K"] and described["requantized"] == {"Q6_K": 8}


# -- served by vLLM -----------------------------------------------------------

def test_bare_gguf_served_by_vllm(files, tmp_path, monkeypatch):
    """`vllm serve model.gguf` with no config and no tokenizer: vLLM's config
    from the metadata (the registered "gguf" parser), the tokenizer from the
    GGUF's own vocabulary; tokens and prompt log-probabilities = mlx-lm's."""
    from engine_helpers import engine
    from transformers import AutoTokenizer

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    monkeypatch.setenv("VLLM_METAL_CACHE_DIR", str(tmp_path / "cache"))
    f = files["llama"]
    with engine(str(f.path), max_model_len=256, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=64) as llm:
        assert llm.llm_engine.model_config.architectures == ["LlamaForCausalLM"]
        tokenizer_dir = llm.llm_engine.model_config.tokenizer
        out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)],
                           SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, prompt_logprobs=0),
                           use_tqdm=False)[0]
    assert Path(tokenizer_dir).is_relative_to(tmp_path / "cache")
    text = "The library opened in 1912, café 日本語"
    assert AutoTokenizer.from_pretrained(tokenizer_dir).encode(text) == \
        AutoTokenizer.from_pretrained(str(Path(gguf_path()).parent), gguf_file=Path(gguf_path()).name).encode(text)
    tokens = list(out.outputs[0].token_ids)
    ref = logprobs(reference_model(f.config, f.served), PROMPT + tokens[:-1])
    got = np.array([out.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))])
    np.testing.assert_allclose(got, ref[np.arange(len(PROMPT) - 1), PROMPT[1:]], atol=TOL)
    chosen = ref[len(PROMPT) - 1:][np.arange(NUM_TOKENS), tokens]
    assert (chosen >= ref[len(PROMPT) - 1:].max(axis=1) - TOL).all()


# -- bad files ----------------------------------------------------------------

def _tiny_gguf(path: Path, arch="llama", extra_tensor=None, drop_key=None, rope_scaling=None):
    """A minimal one-layer GGUF (float tensors) to break in one way."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    keys = {"add_block_count": 1, "add_context_length": 64, "add_embedding_length": 32,
            "add_feed_forward_length": 64, "add_head_count": 2, "add_head_count_kv": 2,
            "add_layer_norm_rms_eps": 1e-5, "add_rope_freq_base": 10000.0, "add_vocab_size": 64}
    for name, value in keys.items():
        if name != drop_key:
            getattr(writer, name)(value)
    if rope_scaling:
        writer.add_string(f"{arch}.rope.scaling.type", rope_scaling)
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": (64, 32), "output_norm.weight": (32,), "blk.0.attn_norm.weight": (32,)}
    if extra_tensor:
        tensors[extra_tensor[0]] = extra_tensor[1]
    for name, shape in tensors.items():
        dtype = np.float64 if name.endswith(".f64") else np.float32
        writer.add_tensor(name.removesuffix(".f64"), rng.standard_normal(shape).astype(dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _truncated(tmp_path, files):
    data = files["qwen3"].path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    return tmp_path / "cut.gguf"


BAD_FILES = [
    ("not-gguf", lambda d, f: _bytes(d / "x.gguf", b"PK\x03\x04" + bytes(64)),
     "not a readable GGUF file: .*no GGUF magic"),
    ("version", lambda d, f: _bytes(d / "v.gguf", b"GGUF" + (9).to_bytes(4, "little") + bytes(32)),
     "GGUF version 9"),
    ("truncated", lambda d, f: _truncated(d, f), "runs past the end of the file"),
    ("architecture", lambda d, f: _tiny_gguf(d / "b.gguf", arch="bert"), "GGUF architecture 'bert' is not mapped"),
    ("tensor-type", lambda d, f: _tiny_gguf(d / "t.gguf", extra_tensor=("blk.0.ffn_norm.weight.f64", (32,))),
     "blk.0.ffn_norm.weight is of GGML type F64, which vllm-metal cannot serve"),
    ("tensor-name", lambda d, f: _tiny_gguf(d / "n.gguf", extra_tensor=("rope_freqs.weight", (16,))),
     "GGUF tensor 'rope_freqs.weight' of architecture 'llama' has no known place"),
    ("metadata", lambda d, f: _tiny_gguf(d / "m.gguf", drop_key="add_embedding_length"),
     "GGUF metadata lacks hidden_size"),
    ("rope-scaling", lambda d, f: _tiny_gguf(d / "r.gguf", rope_scaling="longrope"), "rope scaling 'longrope'"),
]


@pytest.mark.parametrize("case", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_bad_gguf_files_are_refused_naming_the_problem(case, files, tmp_path):
    _, make, message = case
    path = make(tmp_path, files)
    with pytest.raises((ValueError, NotImplementedError), match=message):
        load_model(str(path))


def test_a_directory_with_two_gguf_files_is_refused(files, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(files["qwen3"].path.read_bytes())
    with pytest.raises(ValueError, match="holds 2 GGUF files .*name the one to serve"):
        load_model(str(tmp_path))


def test_a_directory_with_config_json_uses_it(files, tmp_path):
    """A directory of one GGUF plus config.json / tokenizer files (how the
    default model is laid out; vLLM's --hf-config-path likewise): that config."""
    import json
    import shutil

    f = files["qwen3"]
    shutil.copy(f.path, tmp_path / "model.gguf")
    (tmp_path / "config.json").write_text(json.dumps({**f.config, "rope_theta": 1234.0}))
    assert load_model(str(tmp_path), materialize=False).config["rope_theta"] == 1234.0
    assert load_model(str(f.path), materialize=False, config_path=str(tmp_path)).config["rope_theta"] == 1234.0


def test_doctor_describes_a_gguf(files, tmp_path):
    from vllm_metal.doctor.capabilities import model_check

    report = model_check(str(files["llama"].path))
    assert report["served"] and report["format"] == "gguf" and report["model_type"] == "llama"
    assert "kept quantized as MLX affine (exact): Q4_K" in report["quantization"]
    assert "re-quantized to MLX affine: Q6_K -> 8-bit" in report["quantization"]
    loaded = load_model(str(files["llama"].path), dtype="float32", dequantize=True)
    assert report["memory"]["cpu_float32"] == loaded.weights_bytes  # what the CPU device holds
    assert report["memory"]["metal_float16"] < loaded.weights_bytes / 4
    refused = model_check(str(_tiny_gguf(tmp_path / "b.gguf", arch="bert")))
    assert not refused["served"] and "GGUF architecture 'bert' is not mapped" in refused["reason"]


def test_docs_table_of_ggml_types_is_generated():
    text = (Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md").read_text()
    block = text.split("<!-- BEGIN GENERATED: ggml-types -->\n", 1)[1].split("\n<!-- END GENERATED", 1)[0]
    assert block == gguf_quants.markdown_table(), "regenerate: python -m vllm_metal.formats.gguf_quants"
