"""The speculative benchmark's draft-model side: the layer-skipping draft and the servers' command lines."""

from __future__ import annotations

import json

import bench_serving as bs
import bench_speculative
import layer_skip_draft
import mlx.core as mx
import numpy as np
import pytest


def test_layer_skip_draft_keeps_and_renumbers_the_layers(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    weights = {"model.embed_tokens.weight": mx.arange(6, dtype=mx.float32).reshape(2, 3),
               "model.norm.weight": mx.ones((3,))}
    for i in range(4):
        weights[f"model.layers.{i}.mlp.down_proj.weight"] = mx.full((3, 3), float(i))
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4}))
    (target / "tokenizer.json").write_text("{}")
    draft = layer_skip_draft.make_draft(target, tmp_path / "draft", layer_skip_draft.parse_layers("0,2-3"))
    got = mx.load(str(draft / "model.safetensors"))
    assert sorted(k for k in got if k.startswith("model.layers.")) == \
        [f"model.layers.{i}.mlp.down_proj.weight" for i in range(3)]
    assert [float(got[f"model.layers.{i}.mlp.down_proj.weight"][0, 0]) for i in range(3)] == [0.0, 2.0, 3.0]
    np.testing.assert_array_equal(np.array(got["model.embed_tokens.weight"]), np.arange(6).reshape(2, 3))
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 3
    assert (draft / "tokenizer.json").exists()
    for bad in ("3-1", "1,1", ""):
        with pytest.raises(ValueError):
            layer_skip_draft.parse_layers(bad)
    with pytest.raises(ValueError, match="past the target's 4 layers"):
        layer_skip_draft.make_draft(target, tmp_path / "d2", [0, 4])


def test_both_servers_get_the_same_draft_model(tmp_path, monkeypatch):
    monkeypatch.setattr(bs, "SYSTEMS", dict(bs.SYSTEMS))  # registered for this test only
    config = bench_speculative.register_draft_systems(tmp_path / "draft")
    assert config == {"method": "draft_model", "model": str(tmp_path / "draft"),
                      "num_speculative_tokens": bench_speculative.NUM_DRAFTS}
    metal, env = bs.server_command("vllm-metal-draft", "/m", 1234, 1 << 30, preload=False)
    assert metal[-2:] == ["--speculative-config", json.dumps(config)]
    assert metal[:-2] == bs.server_command("vllm-metal", "/m", 1234, 1 << 30, preload=False)[0]
    assert env == {"VLLM_METAL_DEVICE": "cpu"}
    mlx_cmd, _ = bs.server_command("mlx-lm-draft", "/m", 1234, 1 << 30, preload=False)
    assert mlx_cmd[-4:] == ["--draft-model", str(tmp_path / "draft"), "--num-draft-tokens",
                            str(bench_speculative.NUM_DRAFTS)]
    assert bs.extra_body("mlx-lm-draft", tmp_path) == bs.extra_body("mlx-lm", tmp_path)  # EOS suppressed alike


def test_the_mtp_run_serves_a_synthetic_glm_checkpoint_with_its_mtp_layer(tmp_path, monkeypatch, model_dir):
    """The synthetic checkpoint is what vllm-metal's MTP loader reads (a small config here), and
    the MTP system is vllm-metal with vLLM's method "mtp"."""
    import synthetic_mtp

    from vllm_metal.models.loader import load_model
    from vllm_metal.speculative.mtp import load_mtp

    monkeypatch.setattr(bs, "SYSTEMS", dict(bs.SYSTEMS))
    config = bench_speculative.register_mtp_system()
    assert config == {"method": "mtp", "num_speculative_tokens": bench_speculative.MTP_DRAFTS}
    metal, env = bs.server_command("vllm-metal-mtp", "/m", 1234, 1 << 30, preload=False)
    assert metal[-2:] == ["--speculative-config", json.dumps(config)] and env == {"VLLM_METAL_DEVICE": "cpu"}
    small = {**synthetic_mtp.BENCH_CONFIG, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
             "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    path = synthetic_mtp.build(tmp_path / "glm", model_dir, config=small)
    saved = json.loads((tmp_path / "glm" / "config.json").read_text())
    assert saved["num_hidden_layers"] == 2 and saved["num_nextn_predict_layers"] == 1
    assert synthetic_mtp.build(tmp_path / "glm", model_dir, config=small) == path  # built once
    target = load_model(path)
    spec = type("Spec", (), {"num_speculative_tokens": 3,
                             "target_model_config": type("T", (), {"max_model_len": 256})()})()
    drafter = load_mtp(target, path, spec, "float32", False, False, False)
    assert drafter.model.num_layers == 1 and drafter.model.weights_bytes > 0
