"""cpu_usage.Sampler: CPU per process over the client's own window, not its lifetime."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import cpu_usage
import pytest


def synthetic(rows: list[tuple[float, dict]]) -> cpu_usage.Sampler:
    sampler = cpu_usage.Sampler(server_sid=-1)
    for t, row in rows:
        sampler.times.append(t)
        sampler.rows.append(row)
    return sampler


def test_window_interpolates_between_samples_and_ignores_what_lies_outside():
    # A client that burns 1 core for 10 s of start-up, then a 2 s benchmark during which
    # the engine uses 1.5 cores and the client 0.5; then the client exits.
    def row(engine, client, busy, own=0.0):
        return {"VLLM::EngineCore:11": engine, "vllm:10": 0.0, cpu_usage.CLIENT: client, " busy": busy, " own": own}

    sampler = synthetic([(0.0, row(0.0, 0.0, 0.0)), (10.0, row(0.0, 10.0, 10.0)),
                         (11.0, row(1.5, 10.5, 12.2)), (12.0, row(3.0, 11.0, 14.4)),
                         (13.0, row(3.0, 11.0, 14.4))])
    usage = sampler.window(10.0, 12.0)
    assert usage["cores_by_process"] == {"VLLM::EngineCore": 1.5, cpu_usage.CLIENT: 0.5, "vllm": 0.0}
    assert usage["foreign_cores"] == pytest.approx(0.2)
    # Half-way points interpolate: 10.5 -> 11.5 covers half of each of the two busy seconds.
    assert sampler.window(10.5, 11.5)["cores_by_process"]["VLLM::EngineCore"] == pytest.approx(1.5)
    # The client's whole lifetime (what a before/after read gives) dilutes the engine: 3 / 13.
    assert sampler.window(0.0, 13.0)["cores_by_process"]["VLLM::EngineCore"] == pytest.approx(3 / 13, abs=1e-3)
    # Outside the samples: clamped to the first and last.
    assert sampler.at(-5.0) == sampler.rows[0] and sampler.at(99.0) == sampler.rows[-1]


def test_processes_of_one_name_are_summed_and_foreign_use_never_goes_negative():
    a = {"VLLM::Worker:20": 0.0, "VLLM::Worker:21": 0.0, cpu_usage.CLIENT: 0.0, " busy": 0.0, " own": 0.0}
    b = {"VLLM::Worker:20": 1.0, "VLLM::Worker:21": 0.5, cpu_usage.CLIENT: 0.25, " busy": 1.0, " own": 0.1}
    usage = synthetic([(0.0, a), (1.0, b)]).window(0.0, 1.0)
    assert usage["cores_by_process"]["VLLM::Worker"] == 1.5
    assert usage["foreign_cores"] == 0.0  # the machine's counter lags the processes' here: never below 0


def test_sampler_sees_a_real_client_sessions_cpu_and_keeps_it_after_the_client_exits():
    sampler = cpu_usage.Sampler(server_sid=os.getsid(0), period=0.05)
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass"], start_new_session=True)
    sampler.start(client_sid=child.pid)
    start = time.time()
    child.wait(timeout=60)
    time.sleep(0.15)  # a sample or two after it exited
    sampler.stop()
    usage = sampler.window(start - 1.0, time.time())
    client = usage["cores_by_process"][cpu_usage.CLIENT]
    assert client * (time.time() - start + 1.0) >= 0.2  # most of its 0.3 CPU seconds, read before it exited
    assert all(b[cpu_usage.CLIENT] >= a[cpu_usage.CLIENT] for a, b in zip(sampler.rows, sampler.rows[1:]))


def test_foreign_cpu_is_machine_busy_time_minus_ours():
    before, after = (100.0, 10.0, 5.0), (130.0, 25.0, 7.0)  # 30 s busy, 15 + 2 s of it ours
    assert cpu_usage.foreign_cores(before, after, wall_s=13.0) == 1.0
    assert cpu_usage.foreign_cores(after, after, wall_s=1.0) == 0.0


def test_cpu_snapshot_reads_this_session():
    import os

    sum(i * i for i in range(200_000))  # burn a little CPU in this process
    busy, session, own = cpu_usage.cpu_snapshot(os.getsid(0))
    assert busy > 0 and own > 0
    assert session > 0  # this test process is in its own session's process list
