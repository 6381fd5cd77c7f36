"""bench_serving.py --step-stamps: a served engine stamps each step
(benchmarks/served_steps/sitecustomize.py), and the stamps within the client's
window become the run's steps by kind (benchmarks/step_kinds.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import step_kinds

SERVED_STEPS = Path(__file__).resolve().parents[2] / "benchmarks" / "served_steps"


def load_sitecustomize(monkeypatch):
    monkeypatch.delenv("BENCH_STEP_STAMPS", raising=False)  # import without installing
    spec = importlib.util.spec_from_file_location("served_steps_site", SERVED_STEPS / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_step_is_stamped_with_its_tokens_and_rows(monkeypatch, tmp_path):
    site = load_sitecustomize(monkeypatch)

    class Scheduler:
        def update_from_output(self, scheduler_output, model_output):
            return ("outputs", model_output)

    stamps = tmp_path / "steps"
    site.install(Scheduler, str(stamps))
    sched = Scheduler()
    prompt_and_decodes = SimpleNamespace(num_scheduled_tokens={"a": 300, "b": 1, "c": 1}, total_num_scheduled_tokens=302)
    decodes = SimpleNamespace(num_scheduled_tokens={"b": 1, "c": 1}, total_num_scheduled_tokens=2)
    assert sched.update_from_output(prompt_and_decodes, 7) == ("outputs", 7)
    assert sched.update_from_output(decodes, 8) == ("outputs", 8)
    lines = [line.split() for line in stamps.read_text().splitlines()]
    assert [line[0] for line in lines] == [str(os.getpid())] * 2
    assert [line[2:] for line in lines] == [["302", "3", "2"], ["2", "2", "2"]]
    assert float(lines[0][1]) <= float(lines[1][1])
    assert Scheduler.update_from_output.__wrapped__ is not None


def test_the_window_and_its_first_step(tmp_path):
    stamps = tmp_path / "steps"
    # warm-up steps, an idle gap, the client's window [100, 110], a step after it
    stamps.write_text("1 10.0 16 1 0\n1 11.0 1 1 1\n1 101.0 2048 3 0\n1 101.5 8 8 8\n1 102.0 8 8 8\n1 120.0 8 8 8\n")
    inside, start = step_kinds.read_stamps(stamps, 100.0, 110.0)
    assert start == 100.0  # the warm-up's last stamp ended an idle gap: not the first step's start
    assert [s[0] for s in inside] == [101.0, 101.5, 102.0]
    kinds = step_kinds.step_kinds(inside, start)
    assert kinds["prefill 2048"]["steps"] == 1 and abs(kinds["prefill 2048"]["total_s"] - 1.0) < 1e-9
    assert kinds["decode 8"]["steps"] == 2 and abs(kinds["decode 8"]["mean_ms"] - 500.0) < 1e-6
    # a step running when the window opened counts from the window's start
    inside, start = step_kinds.read_stamps(stamps, 101.2, 110.0)
    assert start == 101.2 and [s[0] for s in inside] == [101.5, 102.0]


def test_the_server_environment_and_the_wrap_in_a_vllm_process(tmp_path, monkeypatch):
    import bench_serving

    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = bench_serving.step_stamps_env(tmp_path / "steps")
    assert env["BENCH_STEP_STAMPS"] == str(tmp_path / "steps")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SERVED_STEPS), "/elsewhere"]
    # A Python started with it wraps vLLM's scheduler at start-up.
    probe = ("import vllm.v1.core.sched.scheduler as s; "
             "print(hasattr(s.Scheduler.update_from_output, '__wrapped__'))")
    base = {k: v for k, v in os.environ.items() if k not in ("BENCH_STEP_STAMPS", "PYTHONPATH")}
    on = subprocess.run([sys.executable, "-c", probe], env={**base, **env}, capture_output=True, text=True,
                        timeout=300)
    assert on.stdout.strip().splitlines()[-1] == "True", on.stderr[-2000:]


def test_without_the_variable_nothing_is_wrapped(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    before = Scheduler.update_from_output
    load_sitecustomize(monkeypatch)  # as Python would at start-up, BENCH_STEP_STAMPS unset
    assert Scheduler.update_from_output is before and not hasattr(before, "__wrapped__")
