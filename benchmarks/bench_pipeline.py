"""Pipeline parallel over slow links: llama.cpp RPC's table on this machine.

For nodes N in (1, 2, 3, 4) and an added one-way latency d in (0, 1, 5, 10,
20) ms: `vllm serve MODEL --pipeline-parallel-size N` (one worker process a
stage on this host; vLLM's multiprocess executor), every rank's MLX ring
socket behind a delaying TCP proxy (benchmarks/delay_proxy.py, reached
through VLLM_METAL_RING_VIA), so every stage-to-stage hop pays d. Measured
with streaming completions: decode tokens/s of one request (concurrency 1),
and of N requests started a little apart (concurrency N: each its own
micro-batch when they arrive, vLLM's pipeline keeps N batches in flight)
counted over the window in which all N stream. Each measurement runs
twice and the faster run is kept (both are recorded). Layers are split to balance
compute (VLLM_PP_LAYER_PARTITION: the last stage's head counts as layers). Then `ms per token = compute + k x d` is fitted per N to
the concurrency-1 numbers (k: the hops a token pays; N - 1 expected).

    python benchmarks/bench_pipeline.py [--nodes 1 2 3 4] [--delays 0 1 5 10 20] [--out FILE]

The model is random-weight (benchmarks/random_model.py "llama-pipeline":
16 layers, ~0.25B parameters, ~1 GiB float32). Only the data plane is
delayed: the control plane (scheduler broadcast, the last stage's answer)
is shared memory on one host, where across hosts it would cross the network
too (about 2 x d more a step).

Hosts are emulated by cores: each stage's worker process gets one thread
budget (VLLM_METAL_CPU_THREADS=1, OPENBLAS_NUM_THREADS=1) and is pinned to
core r mod cores (`taskset`), the single-node baseline too. With more stages
than cores (3 and 4 nodes on a 2-core VM) stages share a core, which caps
what concurrency N can overlap: the numbers at 3-4 nodes understate what
separate hosts would gain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

MAX_TOKENS = 64
REPEATS = 2  # each measurement; the best is kept (this VM's noise only ever slows a run down)
STAGGER_S = 0.4
PROMPT = "The history of the ancient city begins"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ports_block(n: int) -> int:
    """A base port with n free ports after it."""
    for _ in range(100):
        base = free_port()
        if base + n < 65000 and all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no block of free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


async def stream(base: str, model: str, max_tokens: int) -> list[float]:
    import aiohttp

    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times = []
    async with aiohttp.ClientSession() as session:
        async with session.post(base + "/v1/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    times.append(time.perf_counter())
    return times


async def measure(base: str, model: str, concurrency: int) -> dict:
    async def one(i):
        await asyncio.sleep(i * STAGGER_S)
        return await stream(base, model, MAX_TOKENS)

    runs = await asyncio.gather(*(one(i) for i in range(concurrency)))
    if concurrency == 1:
        t = runs[0]
        return dict(tok_s=(len(t) - 1) / (t[-1] - t[0]), ms_per_token=1000 * (t[-1] - t[0]) / (len(t) - 1))
    lo, hi = max(r[1] for r in runs), min(r[-1] for r in runs)  # all N streaming (after each one's first token)
    count = sum(sum(1 for x in r if lo < x <= hi) for r in runs)
    return dict(tok_s=count / (hi - lo), window_s=hi - lo)


def serve(model_dir: str, nodes: int, delay_ms: float, log: Path):
    """Starts the server (and the proxies); returns (base_url, processes)."""
    port = free_port()
    env = dict(os.environ, VLLM_METAL_DEVICE="cpu", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               VLLM_METAL_CPU_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    procs = []
    if nodes > 1:
        env["VLLM_PP_LAYER_PARTITION"] = ",".join(map(str, balanced_split(nodes)))
        ring, relay = ports_block(nodes), ports_block(nodes)
        env["VLLM_METAL_RING_PORT"] = str(ring)
        env["VLLM_METAL_RING_VIA"] = ",".join(f"{r}=127.0.0.1:{relay + r}" for r in range(nodes))
        for r in range(nodes):
            procs.append(subprocess.Popen([sys.executable, str(HERE / "delay_proxy.py"), str(relay + r),
                                           f"127.0.0.1:{ring + r}", str(delay_ms)]))
    vllm = Path(sys.executable).parent / "vllm"
    cmd = [str(vllm), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), "--served-model-name",
           "bench", "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20),
           "--pipeline-parallel-size", str(nodes), "--disable-log-requests"]
    procs.insert(0, subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if procs[0].poll() is not None:
            raise RuntimeError(f"server exited: {log}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                pin_workers(procs[0].pid, nodes)
                return base, procs
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"server not ready: {log}")


def balanced_split(nodes: int, layers: int = 16, head_layers: int = 4) -> list[int]:
    """Layers per stage that balance compute rather than memory: the last
    stage also runs the tied head (49,152 x 1024 = ~4 layers' weights of
    this model), so it counts as `head_layers` layers."""
    units = layers + head_layers
    split = [round(units * (s + 1) / nodes) - round(units * s / nodes) for s in range(nodes)]
    split[-1] -= head_layers
    while split[-1] < 1:  # keep a layer on the last stage
        i = max(range(nodes - 1), key=lambda s: split[s])
        split[i] -= 1
        split[-1] += 1
    return split


def pin_workers(server_pid: int, nodes: int) -> None:
    """Each stage's worker (all its threads) on core r mod cores: one core a host."""
    import psutil

    # One node: the model runs in the engine process (vLLM's in-process executor).
    marker = "VLLM::Worker" if nodes > 1 else "VLLM::EngineCore"
    workers = [p for p in psutil.Process(server_pid).children(recursive=True)
               if marker in p.name() or marker in " ".join(p.cmdline())]
    workers.sort(key=lambda p: " ".join(p.cmdline()))
    if len(workers) != nodes:
        raise RuntimeError(f"found {len(workers)} worker processes for {nodes} nodes")
    cores = os.cpu_count() or 1
    for r, w in enumerate(workers):
        subprocess.run(["taskset", "-apc", str(r % cores), str(w.pid)], check=True, capture_output=True)


def stop(procs) -> None:
    import signal

    server = procs[0]
    try:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(60)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    for p in procs[1:]:
        p.kill()
        p.wait()


def fit(rows: list[dict]) -> dict:
    """Per N: least squares of concurrency-1 ms/token on the delay."""
    import numpy as np

    out = {}
    for n in sorted({r["nodes"] for r in rows}):
        pts = [(r["delay_ms"], r["c1"]["ms_per_token"]) for r in rows if r["nodes"] == n]
        if len(pts) < 2:
            continue
        d, t = np.array(pts).T
        k, c = np.polyfit(d, t, 1)
        out[n] = dict(compute_ms=float(c), hops_per_token=float(k), expected_hops=n - 1)
    return out


def table(rows: list[dict], fits: dict) -> str:
    lines = ["| nodes | added one-way latency | decode tok/s, concurrency 1 | decode tok/s, concurrency = nodes | "
             "ratio |", "|---|---|---|---|---|"]
    for r in rows:
        cn = r.get("cn")
        lines.append(f"| {r['nodes']} | {r['delay_ms']:g} ms | {r['c1']['tok_s']:.1f} | "
                     + (f"{cn['tok_s']:.1f} | {cn['tok_s'] / r['c1']['tok_s']:.2f}x |" if cn else "- | - |"))
    lines += ["", "| nodes | fitted compute ms/token | fitted ms per ms of latency | hops a token crosses |",
              "|---|---|---|---|"]
    for n, f in fits.items():
        lines.append(f"| {n} | {f['compute_ms']:.1f} | {f['hops_per_token']:.2f} | {f['expected_hops']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--delays", type=float, nargs="+", default=[0, 1, 5, 10, 20])
    ap.add_argument("--out", default=str(HERE / "results" / "pipeline.json"))
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/vllm-metal/bench-llama-pipeline"))
    ap.add_argument("--table", metavar="JSON", help="print the tables of an earlier run and exit")
    args = ap.parse_args()
    if args.table:
        result = json.loads(Path(args.table).read_text())
        print(table(result["rows"], {int(k): v for k, v in result["fits"].items()}))
        return
    from random_model import build_named

    model_dir = args.model_dir if Path(args.model_dir, "config.json").exists() else \
        build_named("llama-pipeline", Path(args.model_dir))
    rows = []
    logs = Path(args.out).parent / "pipeline-logs"
    logs.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    for nodes in args.nodes:
        for delay in (args.delays if nodes > 1 else [0.0]):
            base, procs = serve(model_dir, nodes, delay, logs / f"n{nodes}-d{delay:g}.log")
            try:
                asyncio.run(measure(base, "bench", 1))  # warm-up
                runs = [asyncio.run(measure(base, "bench", 1)) for _ in range(REPEATS)]
                row = dict(nodes=nodes, delay_ms=delay, c1=max(runs, key=lambda r: r["tok_s"]),
                           c1_runs=[round(r["tok_s"], 2) for r in runs])
                if nodes > 1:
                    runs = [asyncio.run(measure(base, "bench", nodes)) for _ in range(REPEATS)]
                    row["cn"] = max(runs, key=lambda r: r["tok_s"])
                    row["cn_runs"] = [round(r["tok_s"], 2) for r in runs]
            finally:
                stop(procs)
            rows.append(row)
            print(json.dumps(row), flush=True)
    fits = fit(rows)
    result = dict(when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=platform.processor() or
                  platform.machine(), cpus=os.cpu_count(), load_before=load_start, model="llama-pipeline",
                  max_tokens=MAX_TOKENS, rows=rows, fits={str(k): v for k, v in fits.items()})
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(rows, fits))


if __name__ == "__main__":
    main()
