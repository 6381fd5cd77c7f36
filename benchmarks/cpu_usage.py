"""CPU used by a benchmark's processes, over exactly the window its client measured.

`vllm bench serve` spends seconds importing vLLM and torch and loading its dataset
before its clock starts, and a small model's whole benchmark can be shorter than that
(bench_overhead.py: 2-22 s). Counters read before and after the client process
would average the servers' work over the client's idle start-up as well: on
2026-11-28 the tiny model's 6 s concurrency-64 benchmark read 0.39 cores for our
engine that way, 1.20 over the window below (docs/benchmarks.md#engine-overhead). A `Sampler` reads the counters every 0.2 s while the
client runs; `window(start, end)` interpolates them at the benchmark's own start and
end (the end: when the client wrote its result file; the start: that minus the
duration it reports).

Also here, for the benchmarks that time a window of their own: `cpu_snapshot` and
`foreign_cores` (other processes' use between two snapshots).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path

CLIENT = "client (vllm bench serve)"


def _proc_stats():
    """(comm, pid, session, utime + stime ticks) for every live process."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        # After the command name: state, ppid, pgrp, session, ...; utime, stime are 11 and 12.
        yield text[text.index("(") + 1:text.rindex(")")], stat.parent.name, int(fields[3]), \
            int(fields[11]) + int(fields[12])


def session_cpu_seconds(sid: int) -> float:
    """CPU seconds used so far by the live processes of session `sid` (a server and its engine)."""
    return sum(ticks for _, _, session, ticks in _proc_stats() if session == sid) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all but idle and iowait)."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except OSError:
        return 0.0
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds(children: bool = True) -> float:
    t = os.times()
    return t.user + t.system + ((t.children_user + t.children_system) if children else 0.0)


def cpu_snapshot(server_sid: int) -> tuple[float, float, float]:
    """(machine busy CPU s, server session CPU s, this process + its waited children CPU s)."""
    return machine_busy_seconds(), session_cpu_seconds(server_sid), own_cpu_seconds()


def foreign_cores(before: tuple, after: tuple, wall_s: float) -> float:
    """Average cores used by processes other than this benchmark while it measured."""
    ours = (after[1] - before[1]) + (after[2] - before[2])
    return max(after[0] - before[0] - ours, 0.0) / max(wall_s, 1e-9)


class Sampler:
    """Reads the machine's, a server session's (per process) and a client session's CPU
    counters every `period` s on a thread of its own. Counters only grow: a process that
    exits keeps the last value read, so a window's figures never go negative."""

    def __init__(self, server_sid: int, period: float = 0.2):
        self.server_sid, self.period = server_sid, period
        self.client_sid: int | None = None
        self.times: list[float] = []
        self.rows: list[dict[str, float]] = []
        self._last: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self, now: float | None = None) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        row = dict(self._last)
        client = 0.0
        for comm, pid, session, ticks in _proc_stats():
            if session == self.server_sid:
                key = f"{comm}:{pid}"
                row[key] = max(row.get(key, 0.0), ticks / tick)
            elif self.client_sid is not None and session == self.client_sid:
                client += ticks / tick
        row[CLIENT] = max(row.get(CLIENT, 0.0), client)
        row[" busy"] = machine_busy_seconds()
        row[" own"] = own_cpu_seconds(children=False)
        self._last = row
        self.times.append(time.time() if now is None else now)
        self.rows.append(row)

    def start(self, client_sid: int | None = None) -> None:
        self.client_sid = client_sid
        self.sample()

        def loop():
            while not self._stop.wait(self.period):
                self.sample()

        self._thread = threading.Thread(target=loop, name="cpu-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def at(self, t: float) -> dict[str, float]:
        """Every counter at wall-clock time t, interpolated between the samples around it
        (clamped to the first and last sample)."""
        if not self.times:
            raise ValueError("no samples")
        i = bisect.bisect_left(self.times, t)
        if i == 0:
            return dict(self.rows[0])
        if i == len(self.times):
            return dict(self.rows[-1])
        t0, t1 = self.times[i - 1], self.times[i]
        f = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
        a, b = self.rows[i - 1], self.rows[i]
        return {k: a.get(k, 0.0) + f * (b[k] - a.get(k, 0.0)) for k in b}

    def window(self, start: float, end: float) -> dict:
        """{'cores_by_process': {name: cores}, 'foreign_cores': cores} between two wall-clock
        times: the server's processes by name (pid dropped), the client, and what the rest
        of the machine used (everything busy minus the server, the client and this process)."""
        a, b = self.at(start), self.at(end)
        span = max(end - start, 1e-9)
        used = {k: (b[k] - a.get(k, 0.0)) / span for k in b}
        cores: dict[str, float] = {}
        for key, value in used.items():
            if not key.startswith(" "):
                name = key if key == CLIENT else key.rsplit(":", 1)[0]
                cores[name] = cores.get(name, 0.0) + value
        ours = sum(cores.values()) + used[" own"]
        return {"cores_by_process": {k: round(v, 3) for k, v in sorted(cores.items(), key=lambda kv: -kv[1])},
                "foreign_cores": round(max(used[" busy"] - ours, 0.0), 3)}
