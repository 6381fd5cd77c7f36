"""A checkpoint that carries multi-token-prediction layers is served plain:
its MTP layer, stored as DeepSeek-V3 stores it (the decoder layer after the
last, `model.layers.{num_hidden_layers}`, with enorm / hnorm / eh_proj /
shared_head and copies of the embedding and head beside its block; config
`num_nextn_predict_layers: 1`), is dropped at load (models/loader.py) for
every served family that ships one -- mlx-lm's own deepseek_v3 drops only
DeepSeek-V3's index 61. The reference: mlx-lm's forward of the same
checkpoint with that layer removed, built by mlx-lm alone. The loader still
refuses layers beyond num_hidden_layers where the config declares no MTP layer.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import GOLDEN, engine
from families import build

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from synthetic_mtp import add_mtp_layer  # noqa: E402

PROMPTS = [GOLDEN[0]["prompt_ids"][:30], GOLDEN[1]["prompt_ids"][:45]]
MAX_TOKENS = 10


def with_mtp_layer(model_type: str, out: Path, tokenizer_dir: str) -> str:
    build(model_type, out, tokenizer_dir, seed=1, overrides={"num_hidden_layers": 3})
    return add_mtp_layer(out, damp=1.0, copies=True)


def without_mtp_layer(model_dir: str, out: Path) -> str:
    """The checkpoint with its MTP layer's tensors removed (and no MTP layer in the config)."""
    shutil.copytree(model_dir, out)
    w = mx.load(str(out / "model.safetensors"))
    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: v for k, v in w.items() if not k.startswith("model.layers.2.")})
    config = json.loads((out / "config.json").read_text())
    config.pop("num_nextn_predict_layers")
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def mlx_lm_greedy(model_dir: str, prompt: list[int], n: int) -> list[int]:
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    model.set_dtype(mx.float32)
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(mx.argmax(model(mx.array(tokens)[None])[0, -1]).item()))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def deepseek(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-dropped")
    served = with_mtp_layer("deepseek_v3", root / "deepseek_v3", model_dir)
    return served, without_mtp_layer(served, root / "deepseek_v3-plain")


def test_mlx_lm_alone_cannot_load_it(deepseek):
    from mlx_lm.utils import load_model

    with pytest.raises(ValueError, match="parameters not in model"):
        load_model(Path(deepseek[0]))


@pytest.mark.slow
def test_deepseek_v3_with_an_mtp_layer_serves_plain(deepseek):
    served, plain = deepseek
    want = [mlx_lm_greedy(plain, p, MAX_TOKENS) for p in PROMPTS]
    with engine(served, max_model_len=512, max_num_batched_tokens=32) as llm:  # chunked prefill
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want


@pytest.mark.parametrize("model_type", ["kimi_k2", "glm4_moe_lite", "glm4_moe"])
def test_other_families_with_an_mtp_layer_load_plain(model_type, model_dir, tmp_path):
    """Loaded for the paged path with the decoder's layers only; the model the loader's classes
    build (mlx-lm's, dense) gives mlx-lm's logits without the MTP layer (mlx-lm's glm4_moe /
    glm4_moe_lite drop it themselves)."""
    from mlx_lm.utils import load_model as mlx_lm_load

    from vllm_metal.models.loader import _without_mtp_layers, load_model

    served = with_mtp_layer(model_type, tmp_path / model_type, model_dir)
    assert load_model(served, materialize=False).num_layers == 2
    config = json.loads((Path(served) / "config.json").read_text())
    ours, _ = mlx_lm_load(Path(served), **_without_mtp_layers(config, {}))
    reference, _ = mlx_lm_load(Path(without_mtp_layer(served, tmp_path / "plain")))
    ids = mx.array(PROMPTS[0])[None]
    np.testing.assert_array_equal(np.array(ours(ids)), np.array(reference(ids)))


def test_extra_layers_without_an_mtp_config_are_still_refused(deepseek, tmp_path):
    from vllm_metal.models.loader import load_model

    broken = tmp_path / "extra"
    shutil.copytree(deepseek[0], broken)
    config = json.loads((broken / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="parameters not in model"):
        load_model(str(broken))
