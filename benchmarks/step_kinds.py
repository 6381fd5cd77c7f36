"""An engine run's steps by kind (step_phases.py in-process, bench_serving.py
--step-stamps served): decode-only steps by their rows, steps with prompt
tokens by their scheduled tokens (in 512s), each step timed from the previous
step's stamp (its output reaching the scheduler)."""

from __future__ import annotations

from pathlib import Path


def step_kinds(finished: list, start: float) -> dict:
    """finished: (stamp, scheduled tokens, rows, decode rows) per step, in order;
    start: the stamp the first step is timed from. Count, total and mean ms a kind."""
    kinds: dict = {}
    prev = start
    for stamp, tokens, rows, _decode_rows in finished:
        kind = ("empty" if tokens == 0 else f"decode {rows}" if tokens == rows
                else f"prefill {(tokens + 511) // 512 * 512}")
        k = kinds.setdefault(kind, {"steps": 0, "total_s": 0.0})
        k["steps"] += 1
        k["total_s"] += stamp - prev
        prev = stamp
    for k in kinds.values():
        k["mean_ms"] = 1e3 * k["total_s"] / k["steps"]
    return dict(sorted(kinds.items()))


def read_stamps(path: Path, t0: float, t1: float) -> tuple[list, float]:
    """The stamps served_steps/sitecustomize.py wrote (wall clock) within [t0, t1],
    and the time the first of them is timed from: t0 (the stamp before it may end
    an idle gap, the warm-up's; a step already running at t0 counts from t0)."""
    inside = []
    for line in Path(path).read_text().splitlines():
        _pid, stamp, tokens, rows, decode_rows = line.split()
        s = float(stamp)
        if t0 <= s <= t1:
            inside.append((s, int(tokens), int(rows), int(decode_rows)))
    return inside, t0
