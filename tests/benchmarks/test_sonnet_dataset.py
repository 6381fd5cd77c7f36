"""The sonnet prompt builder: lengths, shared prefix, seeding, and vLLM's loader reading it."""

from __future__ import annotations

import pytest

import sonnet_dataset as sd


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return sd.load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def lines():
    return sd.load_lines()


def _build(tokenizer, lines, **overrides):
    kwargs = dict(input_len=1024, output_len=128, prefix_len=200, num_prompts=6, seed=0)
    kwargs.update(overrides)
    return sd.build_prompts(tokenizer, lines, **kwargs)


def test_sonnet_text_is_the_full_collection(lines):
    assert len(lines) > 500
    assert lines[0].startswith("FROM fairest creatures we desire increase")
    assert all(line.endswith("\n") and line.strip() for line in lines)


@pytest.mark.parametrize("input_len", [256, 1024, 1500])
def test_lengths_hit_the_target(tokenizer, lines, input_len):
    prompts = _build(tokenizer, lines, input_len=input_len)
    for p in prompts:
        # Recount independently of the builder's bookkeeping.
        counted = len(tokenizer(p.prompt).input_ids)
        assert counted == p.prompt_tokens
        assert input_len - 3 <= counted <= input_len
        assert p.output_tokens == 128


def test_prompt_is_instruction_and_lines_through_the_chat_template(tokenizer, lines):
    p = _build(tokenizer, lines, num_prompts=1)[0]
    content = p.prompt[p.prompt.index(sd.INSTRUCTION):]
    body = content[len(sd.INSTRUCTION):]
    end = max(i for i in range(len(body)) if body[:i].endswith("\n") and
              all(line + "\n" in set(lines) for line in body[:i].splitlines()))
    user_content = sd.INSTRUCTION + body[:end]
    expected = tokenizer.apply_chat_template([{"role": "user", "content": user_content}],
                                             add_generation_prompt=True, tokenize=False)
    assert p.prompt == expected
    assert len(body[:end].splitlines()) > 50  # about 1024 tokens of ~12-token lines


def test_prefix_is_shared(tokenizer, lines):
    prompts = _build(tokenizer, lines)
    prefix_tokens = prompts[0].prefix_tokens
    assert 200 - max(len(tokenizer(line).input_ids) for line in lines) < prefix_tokens <= 200
    ids = [tokenizer(p.prompt).input_ids for p in prompts]
    shared = 0
    while all(len(x) > shared and x[shared] == ids[0][shared] for x in ids):
        shared += 1
    assert shared >= prefix_tokens - 1  # the next random line may share a first token or not
    # ...and past the prefix the prompts differ: the rest is random lines.
    assert shared < prefix_tokens + 20
    first_lines = "".join(lines[:5])
    assert all(sd.INSTRUCTION + first_lines in p.prompt for p in prompts)


def test_no_prefix(tokenizer, lines):
    prompts = _build(tokenizer, lines, prefix_len=0, num_prompts=3)
    assert all(p.prompt_tokens <= 1024 for p in prompts)
    bare = tokenizer.apply_chat_template([{"role": "user", "content": sd.INSTRUCTION}],
                                         add_generation_prompt=True, tokenize=False)
    head = bare[:bare.index(sd.INSTRUCTION) + len(sd.INSTRUCTION)]
    # Only the template head and the instruction are shared; the template's tail
    # ("<|im_end|>...assistant") follows the random lines.
    assert prompts[0].prefix_tokens == len(tokenizer(head).input_ids)
    assert len(tokenizer(head).input_ids) < len(tokenizer(bare).input_ids)


def test_seeded_reproducibility(tokenizer, lines):
    a = _build(tokenizer, lines, seed=7)
    b = _build(tokenizer, lines, seed=7)
    c = _build(tokenizer, lines, seed=8)
    assert [p.prompt for p in a] == [p.prompt for p in b]
    assert [p.prompt for p in a] != [p.prompt for p in c]
    assert len({p.prompt for p in a}) == len(a)  # prompts within a set differ too


def test_bad_lengths_are_rejected(tokenizer, lines):
    with pytest.raises(ValueError, match="prefix_len"):
        _build(tokenizer, lines, input_len=100, prefix_len=200)
    with pytest.raises(ValueError, match="input_len"):
        _build(tokenizer, lines, input_len=10, prefix_len=0)


def test_jsonl_round_trip_and_vllm_custom_dataset(tokenizer, lines, tmp_path):
    prompts = _build(tokenizer, lines, input_len=512, num_prompts=4)
    path = tmp_path / "sonnet.jsonl"
    sd.write_jsonl(prompts, path)
    assert sd.read_jsonl(path) == prompts
    pytest.importorskip("pandas")
    datasets = pytest.importorskip("vllm.benchmarks.datasets")
    # What `vllm bench serve --dataset-name custom --skip-chat-template --disable-shuffle
    # --custom-output-len -1` samples from the file.
    dataset = datasets.CustomDataset(dataset_path=str(path), disable_shuffle=True)
    samples = dataset.sample(tokenizer, num_requests=4, output_len=-1, skip_chat_template=True)
    assert [s.prompt for s in samples] == [p.prompt for p in prompts]
    assert [s.prompt_len for s in samples] == [p.prompt_tokens for p in prompts]
    assert [s.expected_output_len for s in samples] == [128] * 4


def test_cli_writes_the_file(model_dir, tmp_path):
    out = tmp_path / "p.jsonl"
    sd.main(["--model", model_dir, "--input-len", "300", "--output-len", "16", "--prefix-len", "100",
             "--num-prompts", "3", "--seed", "1", "--out", str(out)])
    prompts = sd.read_jsonl(out)
    assert len(prompts) == 3 and all(297 <= p.prompt_tokens <= 300 for p in prompts)
