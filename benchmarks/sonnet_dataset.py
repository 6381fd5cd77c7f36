"""Builds sonnet prompts the way vLLM's old sonnet benchmark did, as a JSONL file
for `vllm bench serve --dataset-name custom --skip-chat-template`.

Each prompt is the instruction "Pick as many lines as you can from these poem
lines:", the same first lines of the sonnets for every prompt (the shared
prefix, which prefix caching can reuse), then lines drawn at random, all as one
user message through the model's chat template. Unlike the old benchmark, which
only guaranteed `<= input_len`, the random lines are chosen so that the templated
prompt hits `--input-len` tokens exactly whenever the line lengths allow it.

    python benchmarks/sonnet_dataset.py --model DIR --input-len 1024 --output-len 128 \
        --prefix-len 200 --num-prompts 100 --seed 0 --out prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

INSTRUCTION = "Pick as many lines as you can from these poem lines:\n"
SONNET_PATH = Path(__file__).resolve().parent / "data" / "sonnet.txt"


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer this module uses."""

    def __call__(self, text: str): ...  # .input_ids

    def apply_chat_template(self, conversation, **kwargs): ...


@dataclass
class SonnetPrompt:
    prompt: str          # already through the chat template
    prompt_tokens: int   # as the server counts them (tokenizer defaults)
    prefix_tokens: int   # tokens all prompts share (template head + instruction + prefix lines)
    output_tokens: int

    def to_json(self) -> dict:
        return asdict(self)


def load_lines(path: Path = SONNET_PATH) -> list[str]:
    """Non-empty lines of the sonnet text, each keeping its newline."""
    lines = [line.rstrip("\n") + "\n" for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line.strip()]


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _count(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer(text).input_ids)


def _template(tokenizer: Tokenizer, content: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True, tokenize=False)


def _fill(rng: random.Random, line_tokens: list[int], budget: int) -> list[int]:
    """Indices of random lines whose token counts add up to `budget` (or just under it).

    Draws freely while far from the budget, then only lines that keep the rest
    fillable (0, or at least the shortest line), which lands exactly whenever
    the line lengths are contiguous, as they are for the sonnets.
    """
    shortest, longest = min(line_tokens), max(line_tokens)
    chosen: list[int] = []
    while budget >= 2 * longest + shortest:
        i = rng.randrange(len(line_tokens))
        chosen.append(i)
        budget -= line_tokens[i]
    while budget >= shortest:
        fits = [i for i, n in enumerate(line_tokens) if n == budget or n <= budget - shortest]
        if not fits:
            break
        i = rng.choice(fits)
        chosen.append(i)
        budget -= line_tokens[i]
    return chosen


def build_prompts(tokenizer: Tokenizer, lines: list[str], *, input_len: int, output_len: int,
                  prefix_len: int, num_prompts: int, seed: int) -> list[SonnetPrompt]:
    """`num_prompts` templated prompts of about `input_len` tokens sharing a `prefix_len` prefix."""
    if num_prompts < 1 or output_len < 1:
        raise ValueError("num_prompts and output_len must be positive")
    if prefix_len > input_len:
        raise ValueError(f"prefix_len ({prefix_len}) must not exceed input_len ({input_len})")
    line_tokens = [_count(tokenizer, line) for line in lines]
    bare = _template(tokenizer, INSTRUCTION)
    base_tokens = _count(tokenizer, bare)  # template head + instruction + template tail
    head_tokens = _count(tokenizer, bare[:bare.index(INSTRUCTION) + len(INSTRUCTION)])
    if input_len <= base_tokens:
        raise ValueError(f"input_len must exceed the {base_tokens} tokens of the bare instruction")

    # The shared prefix: the first lines of the text, as in vLLM's benchmark. It is
    # what every prompt's tokens have in common: template head, instruction, lines.
    num_prefix_lines, prefix_tokens = 0, head_tokens
    while (num_prefix_lines < len(lines)
           and prefix_tokens + line_tokens[num_prefix_lines] <= prefix_len):
        prefix_tokens += line_tokens[num_prefix_lines]
        num_prefix_lines += 1
    prefix = INSTRUCTION + "".join(lines[:num_prefix_lines])
    prefix_line_tokens = prefix_tokens - head_tokens

    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        budget = input_len - base_tokens - prefix_line_tokens
        for _attempt in range(8):
            picked = _fill(rng, line_tokens, budget)
            text = _template(tokenizer, prefix + "".join(lines[i] for i in picked))
            count = _count(tokenizer, text)
            if count <= input_len:
                break
            # Merges across line joins made it longer than the sum: aim lower.
            budget -= count - input_len
        prompts.append(SonnetPrompt(prompt=text, prompt_tokens=count,
                                    prefix_tokens=prefix_tokens, output_tokens=output_len))
    return prompts


def write_jsonl(prompts: list[SonnetPrompt], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(p.to_json(), ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[SonnetPrompt]:
    with open(path, encoding="utf-8") as f:
        return [SonnetPrompt(**json.loads(line)) for line in f if line.strip()]


def summary(prompts: list[SonnetPrompt]) -> dict:
    lengths = [p.prompt_tokens for p in prompts]
    return {"num_prompts": len(prompts), "prompt_tokens_min": min(lengths),
            "prompt_tokens_mean": statistics.mean(lengths), "prompt_tokens_max": max(lengths),
            "prefix_tokens": prompts[0].prefix_tokens, "output_tokens": prompts[0].output_tokens}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model directory (its tokenizer and chat template)")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefix-len", type=int, default=200)
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sonnet", type=Path, default=SONNET_PATH)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    prompts = build_prompts(load_tokenizer(args.model), load_lines(args.sonnet),
                            input_len=args.input_len, output_len=args.output_len,
                            prefix_len=args.prefix_len, num_prompts=args.num_prompts, seed=args.seed)
    write_jsonl(prompts, args.out)
    print(json.dumps({"out": str(args.out), **summary(prompts)}))


if __name__ == "__main__":
    main()
