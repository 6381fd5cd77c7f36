"""Tables for the raw results whose benchmark script has no renderer of its own.

Pure functions over the committed JSON (no MLX, no servers): each takes what
`json.loads` gave for a raw file (and the file's repository path) and returns
Markdown. Every table opens with what the raw file records of its measurement
(date, commit, host) and says "not recorded" for what it lacks; nothing is
filled in from elsewhere. `benchmarks/summaries.py` puts them into
docs/benchmarks.md and benchmarks/results/summaries/.
"""

from __future__ import annotations

from pathlib import Path

NOT_RECORDED = "not recorded"


def provenance(raw: str | list[str], date=None, commit=None, host=None, extra: str = "") -> str:
    """'Raw: `x.json`. Date: ...; commit: ...; host: ....' with the missing ones named."""
    files = [raw] if isinstance(raw, str) else raw
    known = [(k, v) for k, v in (("date", date), ("commit", commit), ("host", host)) if v]
    missing = [k for k, v in (("date", date), ("commit", commit), ("host", host)) if not v]
    parts = [f"{k} {v}" if k != "commit" else f"vllm-metal at `{v}`" for k, v in known]
    if missing:
        names = ", ".join(missing[:-1]) + (" and " if len(missing) > 1 else "") + missing[-1]
        parts.append(f"{names} {NOT_RECORDED}")
    said = "; ".join(parts)
    text = "Raw: " + ", ".join(f"`{f}`" for f in files) + ". " + said[:1].upper() + said[1:] + "."
    return text + (f" {extra}" if extra else "")


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _head(names: list[str], right_from: int = 1) -> list[str]:
    return [_row(names), "|" + "|".join("---" if i < right_from else "---:" for i in range(len(names))) + "|"]


# --- prefill GEMM (benchmarks/bench_prefill_gemm.py) ---------------------------------------------

def prefill_gemm(data: dict, raw: str) -> str:
    shapes = [s for s in data["runs"][0]["shapes"]]
    by_rows: dict[str, list[str]] = {}
    for s in shapes:
        by_rows.setdefault(s.split()[1].split("x")[0], []).append(s)
    rows = sorted(by_rows, key=int)
    names = " / ".join(s.split()[0] for s in by_rows[rows[0]])
    lines = [provenance(raw, data.get("date"), None, f"{data.get('cpu')} ({data.get('cores')} cores; ISA not recorded)"
                        if data.get("cpu") else None,
                        "Fresh processes per setting, interleaved rounds, through MLX and the BLAS shim; "
                        "GFLOP/s of each product."), ""]
    lines += _head(["round", "products of 33+ rows on", f"chain of {data['runs'][0]['chain']['products']} products",
                    *[f"{names} at {r} rows" for r in rows], "foreign cores"], 2)
    for run in data["runs"]:
        chain = run["chain"]
        per = [" / ".join(f"{run['shapes'][s]['gflops']:.0f}" for s in by_rows[r]) for r in rows]
        lines.append(_row([run["round"], run["large"], f"{chain['ms']:,.0f} ms ({chain['gflops']:.0f} GFLOP/s)",
                           *per, f"{run.get('foreign_cores', 0):.2f}"]))
    return "\n".join(lines)


# --- GEMM ceiling (benchmarks/gemm_ceiling.py) ---------------------------------------------------

def gemm_ceiling(data: dict, raw: str) -> str:
    cores, peak = data["cores"], data["fma_peak_per_core"]
    micro = [c for c in data["cases"] if c["case"] == "micro"]
    best = max(micro, key=lambda c: c["gflops"])
    blis = [c["gflops"] for c in data["cases"] if c["case"] == "blis"]
    lines = [provenance(raw, extra=f"{cores} cores; products of {data['rows']:,} rows on the four shapes "
                        + ", ".join(f"{n} x {k}" for n, k in data["shapes_nk"]) + " (N x K)."), ""]
    lines += _head(["what", "GFLOP/s", f"of {cores} cores' FMA peak"])
    rows = [("one core's FMA peak (register-only chains)", peak, None),
            (f"best register-blocked micro-kernel, operands in L1 ({best['mr']} x {best['nr']}), one core",
             best["gflops"], best["gflops"] / peak),
            ("single-threaded BLIS-style GEMM, one core", f"{min(blis):.0f}-{max(blis):.0f}",
             max(blis) / peak),
            (f"MLX's matmul through the BLAS shim, {cores} cores", data["mlx_shim_gflops"],
             data["mlx_shim_gflops"] / (cores * peak))]
    if data.get("onednn"):
        g = data["onednn"]["gflops"]
        rows.append((f"vLLM CPU's `onednn_mm` (prepacked weights), {data['onednn'].get('torch_threads', cores)} "
                     "threads", g, g / (cores * peak)))
    for what, value, frac in rows:
        lines.append(_row([what, value if isinstance(value, str) else f"{value:.0f}",
                           "-" if frac is None else f"{100 * frac:.0f}%"]))
    return "\n".join(lines)


# --- step profile (benchmarks/profile_step.py) ---------------------------------------------------

PHASES = ("prep", "graph", "eval", "matmul", "attention", "logits", "rest", "sample", "total")


def profile_step(files: list[tuple[str, dict]]) -> str:
    """One table over several profile_step.py JSON files, a row per (file, case)."""
    lines = [provenance([f for f, _ in files], extra="Each file: "
                        + "; ".join(f"`{Path(f).name}` {Path(d['model']).name}, MLX {d.get('mlx', '?')}, "
                                    f"{(d.get('malloc') or 'malloc not recorded').split(' (')[0]}, "
                                    f"{d['context']} tokens of context"
                                    for f, d in files)
                        + ". Milliseconds per step (median); matmul, attention, logits and rest split eval."), ""]
    lines += _head(["raw file", "case", *PHASES], 2)
    for f, d in files:
        for case, v in d["cases"].items():
            lines.append(_row([Path(f).name, case, *(f"{v[p]:,.1f}" if p in v else "-" for p in PHASES)]))
    return "\n".join(lines)


# --- allocator A/B (benchmarks/profile_step.py under three allocators) ---------------------------

def allocator(data: dict, raw: str) -> str:
    names = {"glibc": "glibc malloc", "glibc_mallopt_mmap256MiB_trim1GiB": "glibc, `mallopt` mmap 256 MiB / trim 1 GiB",
             "tcmalloc_ld_preload": "tcmalloc"}
    lines = [provenance(raw, data.get("date"), data.get("vllm_metal_commit"), data.get("host"),
                        "Step totals in ms, one value per interleaved round."), ""]
    lines += _head(["case", *(names.get(k, k) for k in data["rounds"])], 1)
    for i, case in enumerate(data["cases"]):
        lines.append(_row([case, *(" / ".join(f"{r[i]:,.1f}" for r in rounds) for rounds in data["rounds"].values())]))
    served = data.get("served_by_hand_preload")
    if served:
        lines += ["", "Served (the sonnet benchmark, vllm-metal only), output tok/s at concurrency 1 / 8 "
                  "(TPOT p50 ms): " + "; ".join(f"{k} {v['c1_output_tok_s']} / {v['c8_output_tok_s']} ({v['c1_tpot_p50_ms']} / "
                              f"{v['c8_tpot_p50_ms']})" for k, v in served.items()) + "."]
    return "\n".join(lines)


# --- pipeline parallel (benchmarks/bench_pipeline.py) --------------------------------------------

def pipeline(data: dict, raw: str) -> str:
    host = f"{data.get('machine')}, {data.get('cpus')} CPUs" if data.get("machine") else None
    lines = [provenance(raw, data.get("when"), None, host,
                        f"Model `{data['model']}`, {data['max_tokens']} tokens per stream; load average "
                        f"{data.get('load_before', 0):.1f} at the start; each value the better of two runs "
                        "(both in the raw file)."), ""]
    lines += _head(["nodes", "added one-way latency", "decode tok/s, concurrency 1",
                    "decode tok/s, concurrency = nodes", "ratio"], 0)
    for r in data["rows"]:
        cn = r.get("cn")
        lines.append(_row([r["nodes"], f"{r['delay_ms']:g} ms", f"{r['c1']['tok_s']:.1f}",
                           f"{cn['tok_s']:.1f}" if cn else "-",
                           f"{cn['tok_s'] / r['c1']['tok_s']:.2f}x" if cn else "-"]))
    fits = data.get("fits") or {}
    if fits:
        lines += [""] + _head(["nodes", "fitted compute ms/token", "fitted ms per ms of latency",
                               "hops a token crosses"], 0)
        for n, f in fits.items():
            lines.append(_row([n, f"{f['compute_ms']:.1f}", f"{f['hops_per_token']:.2f}", f["expected_hops"]]))
    return "\n".join(lines)


# --- disk KV cache (benchmarks/bench_kv_disk.py) -------------------------------------------------

def kv_disk(rows: list[dict], raw: str) -> str:
    lines = [provenance(raw, extra=f"Model `{rows[0]['model']}`."), ""]
    lines += _head(["tokens", "files", "MB", "recompute TTFT", "restored TTFT", "save (GB/s)", "load (GB/s)",
                    "direct / staged write", "dd write", "same first token"], 0)
    for r in rows:
        lines.append(_row([r["tokens"], r["files"], f"{r['bytes'] / 1e6:,.0f}",
                           f"{r['recompute_ttft_ms'] / 1e3:,.1f} s", f"{r['restored_ttft_ms'] / 1e3:.2f} s", f"{r['save_ms']:,.0f} ms ({r['save_gb_s']:.2f})",
                           f"{r['load_ms']:,.0f} ms ({r['load_gb_s']:.2f})",
                           f"{r['direct_write_ms']:,.0f} / {r['staged_write_ms']:,.0f} ms",
                           f"{r['dd_write_gb_s']:.2f} GB/s", "yes" if r["same_first_token"] else "no"]))
    return "\n".join(lines)


# --- hybrid models (bench_hybrid_state.py, bench_hybrid_prefix.py) -------------------------------

def hybrid_state(rows: list[dict], raw: str) -> str:
    lines = [provenance(raw, extra="A decode step with 512 tokens of context through `LoadedModel.forward`."), ""]
    lines += _head(["state slots", "state pools", "batch", "in place", "copied", "copied / in place"], 0)
    for r in rows:
        lines.append(_row([r["slots"], f"{r['state_pool_mib']:,.0f} MiB", r["batch"], f"{r['inplace_ms']:,.0f} ms",
                           f"{r['copy_ms']:,.0f} ms", f"{r['copy_ms'] / r['inplace_ms']:.1f}x"]))
    return "\n".join(lines)


def hybrid_prefix(data: dict, raw: str) -> str:
    host = f"{data['host']}, {data['cores']} cores" if data.get("host") else None
    runs = data["runs"]
    lines = [provenance(raw, data.get("when"), None, host,
                        f"Model `{data['model']}`, {data['prompt_tokens']:,}-token prompts, block size "
                        f"{data['block_size']}, prefix caching mode `{data['mamba_cache_mode']}`; other processes "
                        f"used {data.get('other_cpu_cores_before', 0):.2f} cores before and "
                        f"{data.get('other_cpu_cores_after', 0):.2f} after."), ""]
    lines += _head(["prompt", "cached tokens", "TTFT (median)", "runs"], 1)[:1] + ["|---|---:|---:|---|"]
    shared = data["shared_prefix_tokens"]
    lines.append(_row([f"miss: {data['prompt_tokens']:,} new tokens", runs[0]["miss_cached_tokens"],
                       f"{data['miss_median_s']:.1f} s", ", ".join(f"{r['miss_s']:.1f}" for r in runs) + " s"]))
    lines.append(_row(["checkpointing the shared boundary", runs[0]["junction_cached_tokens"], "-",
                       ", ".join(f"{r['junction_s']:.1f}" for r in runs) + " s"]))
    lines.append(_row([f"hit: {shared:,} shared + {data['prompt_tokens'] - shared:,} new",
                       f"{runs[0]['hit_cached_tokens']:,}", f"**{data['hit_median_s']:.2f} s**", ", ".join(f"{r['hit_s']:.2f}" for r in runs) + " s"]))
    lines += ["", f"A hit reaches its first token {data['speedup']:.1f}x sooner than a miss."]
    return "\n".join(lines)


# --- encoder attention (benchmarks/bench_encoder_attention.py) -----------------------------------

def encoder_attention(data: dict, raw: str) -> str:
    lines = [provenance(raw, extra=f"{data['heads']} heads of {data['head_dim']}, {data['dtype']}, one layer; "
                        "half the prompts at half length; the paged path includes its block layout."), ""]
    lines += _head(["prompts x longest", "tokens", "dense ms", "paged, non-causal ms", "paged, causal ms",
                    "dense / paged"], 1)
    for r in data["rows"]:
        lines.append(_row([f"{r['sequences']} x {r['longest']}", f"{r['tokens']:,}", f"{r['dense_ms']:,.1f}",
                           f"{r['paged_ms']:,.1f}", f"{r['paged_causal_ms']:,.1f}",
                           f"{r['dense_ms'] / r['paged_ms']:.1f}x"]))
    return "\n".join(lines)


# --- paged attention (benchmarks/bench_paged_attention.py --tiles, --decode-stream) -------------------------

def _tile_cases(data: dict) -> dict:
    """(head dim, case) -> (ms, rows per tile): prefill-like cases at their fastest rows per tile."""
    out: dict = {}
    for t in data["tiles"]:
        key = (t["head_dim"], t["case"])
        if key not in out or t["ms"] < out[key][0]:
            out[key] = (t["ms"], t["rows_per_tile"])
    return out


def _tile_cell(value) -> str:
    if value is None:
        return "-"
    ms, rows = value
    return f"{ms:.3g}" + (f" ({rows})" if rows else "")


def tiles(files: list[tuple[str, dict]], what: str) -> str:
    """A column per raw file (its build in the header), a row per (head dim, case)."""
    cases = [_tile_cases(d) for _, d in files]
    keys = list(dict.fromkeys(k for c in cases for k in c))
    lines = [provenance([f for f, _ in files], extra=what + " Milliseconds per call; where a case was swept over "
                        "rows per tile, its fastest, with the rows in parentheses (0: the tile table's choice)."), ""]
    lines += _head(["head dim", "case", *(f"{d['variant']} build (`{Path(f).name}`)" for f, d in files)], 2)
    for key in keys:
        lines.append(_row([key[0], key[1], *(_tile_cell(c.get(key)) for c in cases)]))
    return "\n".join(lines)


def tiles_by_head_dim(data: dict, raw: str, cases: list[str], what: str) -> str:
    """A row per head dim, a column per case (the build's own file, one variant)."""
    by = _tile_cases(data)
    lines = [provenance(raw, extra=f"{data['variant']} build. {what} Milliseconds per call; where a case was swept "
                        "over rows per tile, its fastest, with the rows in parentheses."), ""]
    lines += _head(["head dim", *cases], 0)
    for dim in sorted({k[0] for k in by}):
        lines.append(_row([dim, *(_tile_cell(by.get((dim, c))) for c in cases)]))
    return "\n".join(lines)


def decode_stream(data: dict, raw: str) -> str:
    what = f"{data['variant']} build; {data['kv_bytes'] / 1e6:,.0f} MB of K/V read per step."
    lines = [provenance(raw, extra=what), ""]
    lines += _head(["case", "ms per step"], 1)
    lines += [_row([case, f"{ms:.1f}"]) for case, ms in data["cases"].items()]
    return "\n".join(lines)


# --- GGUF requantization (benchmarks/gguf_requant_loss.py) ---------------------------------------

def gguf_requant(rows: list[dict], raw: str) -> str:
    lines = [provenance(raw, extra="What re-quantizing each GGML type to MLX affine adds: relative RMS of "
                        "(served - the file's values) over the file's values, on random valid blocks; the bound is "
                        "`REQUANT_LOSS` in `formats/gguf_quants.py`."), ""]
    lines += _head(["GGUF type", "MLX bits", "rows", "relative RMS error", "bound"], 1)
    lines += [_row([r["type"], r["mlx_bits"], r["rows"], f"{r['relative_rms_error']:.4f}", r["bound"]]) for r in rows]
    return "\n".join(lines)
