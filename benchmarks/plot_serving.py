"""Plots the serving benchmark: output tok/s and TPOT per system and concurrency.

Runs in the plot venv (matplotlib only; see setup_peers.sh), so it reads the
report JSON written by bench_serving.py and imports nothing from the project.

    python benchmarks/plot_serving.py benchmarks/results/serving.json benchmarks/results/serving.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(report: dict, out: str) -> None:
    meta = report["meta"]
    systems = [s["name"] for s in meta["systems"]]
    labels = {s["name"]: s["label"] for s in meta["systems"]}
    levels = sorted({r["concurrency"] for r in report["runs"]})
    by_key = {(r["system"], r["concurrency"]): r for r in report["runs"] if "error" not in r}

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(len(systems), 1)
    panels = [("output_tok_s", "output tokens/s (higher is better)"),
              ("tpot_mean_ms", "TPOT mean, ms (lower is better)")]
    for ax, (key, title) in zip(axes, panels):
        for i, system in enumerate(systems):
            xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(levels))]
            ys = [(by_key.get((system, c)) or {}).get(key) or 0.0 for c in levels]
            bars = ax.bar(xs, ys, width, label=labels[system])
            ax.bar_label(bars, fmt="%.1f" if key.endswith("tok_s") else "%.0f", fontsize=7)
        ax.set_xticks(range(len(levels)), [f"concurrency {c}" for c in levels])
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(systems), fontsize=8, frameon=False)
    dataset = meta["dataset"]
    counts = meta["num_prompts"] if isinstance(meta["num_prompts"], list) else [meta["num_prompts"]]
    fig.suptitle(f"Sonnet serving, {meta['model_name']} float32, {dataset['prompt_tokens_mean']:.0f} in / "
                 f"{dataset['output_tokens']} out, {'/'.join(map(str, counts))} prompts — {meta['cpu']}, "
                 f"{meta['cores']} cores, {meta['date']}", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out, dpi=110)


def main() -> None:
    report_path, out = sys.argv[1], sys.argv[2]
    with open(report_path) as f:
        plot(json.load(f), out)


if __name__ == "__main__":
    main()
