"""The speculative benchmark's draft-model and --method sides: the layer-skipping draft, the synthetic
targets with their drafters (built tiny), and the servers' command lines (no server runs here)."""

from __future__ import annotations

import json
from pathlib import Path

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


# --method: each drafter on its synthetic target (benchmarks/synthetic_heads.py), built tiny here.
TINY = {"deepseek": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16,
                         qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=4, moe_intermediate_size=32),
        "qwen3_5": dict(hidden_size=64, num_hidden_layers=2, full_attention_interval=2, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
                        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16),
        "gemma4": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
                       head_dim=16, global_head_dim=32, num_key_value_heads=2, num_global_key_value_heads=2,
                       num_kv_shared_layers=2, sliding_window=24, sliding_window_pattern=2,
                       layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=8),
        "llama": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)}
TINY_TUNING = {"gemma4_assistant": dict(hidden=48, rank=32)}  # the assistant narrower than the tiny target


@pytest.fixture(scope="module")
def tiny_heads(tmp_path_factory, model_dir):
    import synthetic_heads

    root = tmp_path_factory.mktemp("heads")
    return {m: synthetic_heads.build(m, root / m, model_dir, configs=TINY, **TINY_TUNING.get(m, {}))
            for m in synthetic_heads.METHODS}


def test_each_synthetic_target_carries_its_drafter_in_the_layout_vllm_reads(tiny_heads, tmp_path, model_dir):
    import synthetic_heads

    from vllm_metal.models.loader import load_model

    def config(path):
        return json.loads((Path(path) / "config.json").read_text())

    deepseek = tiny_heads["deepseek_mtp"]
    assert deepseek["draft"] is None and config(deepseek["target"])["num_nextn_predict_layers"] == 1
    w = mx.load(str(Path(deepseek["target"]) / "model.safetensors"))
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.shared_head.head.weight",
            "model.layers.2.embed_tokens.weight"} <= set(w)  # DeepSeek's own MTP tensors, its copies
    qwen = tiny_heads["qwen3_5_mtp"]
    assert config(qwen["target"])["text_config"]["mtp_num_hidden_layers"] == 1
    w = mx.load(str(Path(qwen["target"]) / "model.safetensors"))
    assert "mtp.fc.weight" in w and any(k.startswith("mtp.layers.0.self_attn.") for k in w)
    assert not any(k.startswith("language_model.model.layers.2.") for k in w)  # the extra layers dropped
    assistant = config(tiny_heads["gemma4_assistant"]["draft"])
    assert assistant["model_type"] == "gemma4_assistant" and assistant["use_ordered_embeddings"]
    assert assistant["backbone_hidden_size"] == 64 and assistant["text_config"]["hidden_size"] == 48
    head = tiny_heads["eagle3"]["draft"]
    assert config(head)["architectures"] == ["LlamaForCausalLMEagle3"]
    d2t = np.array(mx.load(str(Path(head) / "model.safetensors"))["d2t"])
    assert sorted(d2t + np.arange(synthetic_heads.DRAFT_VOCAB)) == list(range(synthetic_heads.DRAFT_VOCAB))
    for m in synthetic_heads.METHODS:  # every target loads as vllm-metal serves it
        assert load_model(tiny_heads[m]["target"]) is not None
    again = synthetic_heads.build("eagle3", Path(head).parent, model_dir, configs=TINY)
    assert again == tiny_heads["eagle3"]  # built once (the same marker)
    with pytest.raises(ValueError, match="unknown method 'medusa'"):
        synthetic_heads.build("medusa", tmp_path / "x", model_dir)


def test_each_method_is_vllm_metal_with_its_speculative_config(tiny_heads, monkeypatch):
    monkeypatch.setattr(bs, "SYSTEMS", dict(bs.SYSTEMS))
    monkeypatch.setattr(bench_speculative, "PLAIN", dict(bench_speculative.PLAIN))
    k = bench_speculative.MTP_DRAFTS
    want = {"deepseek_mtp": {"method": "mtp", "num_speculative_tokens": k},
            "qwen3_5_mtp": {"method": "mtp", "num_speculative_tokens": k},
            "gemma4_assistant": {"model": tiny_heads["gemma4_assistant"]["draft"], "num_speculative_tokens": k},
            "eagle3": {"method": "eagle3", "model": tiny_heads["eagle3"]["draft"], "num_speculative_tokens": k}}
    for method, config in want.items():
        system, got = bench_speculative.register_method_system(method, tiny_heads[method]["draft"])
        assert got == config and bench_speculative.PLAIN[system] == "vllm-metal"
        cmd, env = bs.server_command(system, "/m", 1234, 1 << 30, preload=False)
        assert cmd[-2:] == ["--speculative-config", json.dumps(config)] and env == {"VLLM_METAL_DEVICE": "cpu"}
        assert cmd[:-2] == bs.server_command("vllm-metal", "/m", 1234, 1 << 30, preload=False)[0]
    assert bench_speculative.register_method_system("mtp", None) == ("vllm-metal-mtp",
                                                                      bench_speculative.register_mtp_system())
    assert bench_speculative.method_markers("mtp") == (bench_speculative.MTP_BEGIN, bench_speculative.MTP_END)
    assert bench_speculative.method_markers("eagle3")[0].startswith("<!-- eagle3-results:begin")


def test_a_method_run_writes_its_own_results_side_by_side_with_plain(tiny_heads, tmp_path, monkeypatch, model_dir):
    """main(--method eagle3) end to end with the servers faked: plain and eagle3 in each cell, the
    results file named after the method, the first-draft acceptance from the per-position counter."""
    import synthetic_heads

    monkeypatch.setattr(bs, "SYSTEMS", dict(bs.SYSTEMS))
    monkeypatch.setattr(bench_speculative, "PLAIN", dict(bench_speculative.PLAIN))
    monkeypatch.setattr(bs, "BENCH_HOME", tmp_path / "home")
    monkeypatch.setattr(bench_speculative.convert_fp32, "convert", lambda source, out: source)
    monkeypatch.setattr(synthetic_heads, "build", lambda method, out, tok: tiny_heads[method])
    monkeypatch.setattr(bs, "isa", lambda: "avx512")
    monkeypatch.setattr(bs, "versions", lambda: {})
    monkeypatch.setattr(bs, "check_setup", lambda systems: None)
    monkeypatch.setattr("vllm_metal.formats.default_model.ensure_default_model", lambda: model_dir)
    calls = []

    def run_one(system, c, n, opts, model, model_dir_, path, warmup, run_dir):
        calls.append((system, c, n, model, path.name))
        spec = {"vllm:spec_decode_num_drafts": 10.0, "vllm:spec_decode_num_draft_tokens": 30.0,
                "vllm:spec_decode_num_accepted_tokens": 12.0,
                "vllm:spec_decode_num_accepted_tokens_per_pos[0]": 7.0} if system != "vllm-metal" else {}
        return {"system": system, "concurrency": c, "output_tok_s": 20.0 if spec else 10.0, "ttft_p50_ms": 1.0,
                "tpot_p50_ms": 1.0, "foreign_cores": 0.0, "spec_decode": spec}

    monkeypatch.setattr(bs, "run_one", run_one)
    with pytest.raises(SystemExit):
        bench_speculative.main(["--method", "eagle3", "--mtp"])
    out = tmp_path / "results"
    assert bench_speculative.main(["--method", "eagle3", "--quick", "--results-dir", str(out)]) == 0
    target = tiny_heads["eagle3"]["target"]
    assert calls == [("vllm-metal", 1, 2, target, "copy.jsonl"), ("vllm-metal-eagle3", 1, 2, target, "copy.jsonl"),
                     ("vllm-metal", 8, 8, target, "sonnet.jsonl"),
                     ("vllm-metal-eagle3", 8, 8, target, "sonnet.jsonl")]
    assert not out.exists()  # --quick: the run's folder only
    (run_dir,) = (tmp_path / "home" / "runs").iterdir()
    report = json.loads((run_dir / "eagle3.json").read_text())
    assert report["meta"]["method"] == "eagle3" and report["meta"]["config"]["model"] == tiny_heads["eagle3"]["draft"]
    assert {"date", "commit", "cpu", "isa", "host"} <= set(report["meta"])
    text = (run_dir / "eagle3.md").read_text()
    assert "| copy | 1 | vllm-metal, eagle3 | 20.0 | 2.00x |" in text and "40% of 30" in text
    assert "First drafts accepted (per drafting step): copy c=1 70%, sonnet c=8 70%." in text


def test_a_published_method_run_gets_its_summary_block(tmp_path, monkeypatch):
    """benchmarks/summaries.py renders a --method run's table once its raw JSON exists, under the
    markers bench_speculative writes into docs/benchmarks.md."""
    import summaries

    monkeypatch.setattr(summaries, "REPO", tmp_path)
    assert summaries.method_blocks("benchmarks/results/") == []
    raw = tmp_path / "benchmarks" / "results" / "speculative" / "eagle3.json"
    raw.parent.mkdir(parents=True)
    raw.write_text("{}")
    (block,) = summaries.method_blocks("benchmarks/results/")
    assert block.name == "eagle3-results" and block.raw == ("benchmarks/results/speculative/eagle3.json",)
    assert block.begin_end() == bench_speculative.method_markers("eagle3")
    assert block.begin_end()[0].startswith("<!-- eagle3-results:begin ")
