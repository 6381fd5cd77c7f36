"""Prompts that invite copying, for the speculative-decoding benchmark
(issue 32): repeat a list, rename a variable through code, quote a
paragraph. Each goes through the model's chat template (one user message)
and is written as the JSONL `vllm bench serve --dataset-name custom` reads,
like benchmarks/sonnet_dataset.py.

    python benchmarks/copy_dataset.py --model DIR --num-prompts 12 --out copy.jsonl
"""

from __future__ import annotations

import argparse
import ast
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import sonnet_dataset  # noqa: E402
from sonnet_dataset import SonnetPrompt  # noqa: E402

KINDS = ("list", "code", "quote")
# Functions of this repository's benchmark code, each with a variable to rename.
CODE = [(HERE / "sonnet_dataset.py", "_fill", "budget", "remaining_tokens"),
        (HERE / "sonnet_dataset.py", "build_prompts", "picked", "chosen_lines"),
        (HERE / "serving_results.py", "roofline_row", "row", "result")]


def function_source(path: Path, name: str) -> str:
    text = path.read_text()
    node = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(text, node)


def message(kind: str, i: int, lines: list[str], rng: random.Random) -> str:
    if kind == "list":
        start = rng.randrange(len(lines) - 16)
        items = "".join(f"{n + 1}. {line}" for n, line in enumerate(lines[start:start + 12]))
        return f"Repeat this list exactly, keeping the numbers, one item per line:\n\n{items}"
    if kind == "code":
        path, name, old, new = CODE[i % len(CODE)]
        return (f"Rename the variable `{old}` to `{new}` in this Python function. Output the whole "
                f"function, changed only there:\n\n```python\n{function_source(path, name)}\n```")
    start = rng.randrange(len(lines) - 10)
    paragraph = " ".join(line.strip() for line in lines[start:start + 8])
    return f"Quote this paragraph word for word:\n\n{paragraph}"


def build_prompts(tokenizer, num_prompts: int, output_len: int, seed: int = 0) -> list[SonnetPrompt]:
    lines = sonnet_dataset.load_lines()
    rng = random.Random(seed)
    out = []
    for i in range(num_prompts):
        text = tokenizer.apply_chat_template([{"role": "user", "content": message(KINDS[i % 3], i // 3, lines, rng)}],
                                             add_generation_prompt=True, tokenize=False)
        out.append(SonnetPrompt(prompt=text, prompt_tokens=len(tokenizer(text).input_ids), prefix_tokens=0,
                                output_tokens=output_len))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    prompts = build_prompts(sonnet_dataset.load_tokenizer(args.model), args.num_prompts, args.output_len, args.seed)
    sonnet_dataset.write_jsonl(prompts, args.out)
    print(sonnet_dataset.summary(prompts))


if __name__ == "__main__":
    main()
