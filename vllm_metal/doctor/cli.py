"""The `vllm-metal` command (also `python -m vllm_metal`)."""

from __future__ import annotations

import argparse
import json
import sys


def _gib(n) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "?"


def format_report(r: dict) -> str:
    h, m, e, a = r["host"], r["mlx"], r["extension"], r["attention_path"]
    lines = [
        f"vllm-metal {r['vllm_metal']}",
        f"host        {h['chip']} ({h['machine']}), {h['os']}, {h['cpu_count']} cores, "
        f"{_gib(h['memory_bytes'])} {'unified' if h['unified_memory'] else 'system'} memory",
        f"python      {h['python']['version']} ({h['python']['arch']}) {h['python']['executable']}",
        f"mlx         {m['version']}; plugin device: {m['device']}"
        + (f"; default device {m['default_device']}; Metal {'available' if m['metal_available'] else 'absent'}"
           if "default_device" in m else ""),
    ]
    if "blas" in m:
        lines.append(f"blas        {m['blas']}")
    if r.get("allocator"):
        lines.append(f"malloc      served engine: {r['allocator']['reason']}; this process: "
                     f"{r['allocator']['this_process']}")
    lines.append(f"extension   built against MLX {e['built_against_mlx']}; "
                 f"Metal kernels {'compiled' if e['metal_kernels'] else 'not compiled'}"
                 + ("" if e["loaded"] else " (not loadable)"))
    lines.append(f"attention   {a['name']}: {a['reason']}")
    if "cpu_kernels" in r:
        from vllm_metal.engine.startup_line import cpu_kernels_line

        lines.append(f"cpu kernels {cpu_kernels_line(r['cpu_kernels'])}")
    if "kv_cache" in r:
        kv = r["kv_cache"]
        lines.append(f"kv cache    {_gib(kv['budget_bytes_before_weights'])} at --gpu-memory-utilization "
                     f"{kv['gpu_memory_utilization']} of {_gib(kv['device_memory_bytes'])}, before weights")
    if r.get("hybrid_state_writeback", {}).get("mode"):
        lines.append(f"hybrid      state write-back {r['hybrid_state_writeback']['mode']}: "
                     f"{r['hybrid_state_writeback']['reason']}")
    if r.get("gated_delta_path", {}).get("name"):
        lines.append(f"hybrid      gated delta {r['gated_delta_path']['name']}: {r['gated_delta_path']['reason']}")
    if r.get("pooling"):
        p = r["pooling"]
        lines.append(f"pooling     served ({p['runner']}): encoders {p['encoders']}; decoders: {p['decoders']}")
        lines.append(f"            refused: {'; '.join(p['refused'])}")
    if r.get("lora"):
        lora = r["lora"]
        lines.append(f"lora        served (--enable-lora): {'; '.join(lora['formats'])}; {lora['batching']}")
        lines.append(f"            refused: {'; '.join(lora['refused'])}")
    if r.get("speculative"):
        spec = r["speculative"]
        lines.append(f"speculative served (--speculative-config method {', '.join(spec['served'])}): {spec['how']}")
        lines.append(f"            refused: {'; '.join(spec['refused'])}")
    lines.append(f"plugin      {'active' if r['plugin']['active'] else 'inactive'}: {r['plugin']['reason']}")
    lines.append("cuda paths  (inert: turned off with a warning; refused: asking for it is an error)")
    for p in r["cuda_paths"]:
        env = f"  [set: {', '.join(p['requested_by_env'])}]" if p["requested_by_env"] else ""
        not_served = " (not served yet)" if p.get("kind") == "unserved" else ""
        lines.append(f"  - {p['name']}: {p['status']}{not_served} -> {p['instead']}{env}")
    if r["problems"]:
        lines.append("problems")
        lines += [f"  ! {p}" for p in r["problems"]]
    lines.append("verdict     " + ("ready to serve" if r["can_serve"] else "cannot serve (see problems)"))
    return "\n".join(lines)


def config_doctor(args, path) -> int:
    """`doctor --model CONFIG`: the model's memory from its config alone."""
    from vllm_metal.doctor.model_memory import format_memory, memory_report, read_config

    try:
        report = memory_report(read_config(path), quant=args.quant, max_model_len=args.max_model_len,
                               cache_dtype=args.kv_cache_dtype)
    except (OSError, ValueError) as e:  # unreadable JSON, an unknown --quant or quantization method
        print(f"vllm-metal doctor: {path}: {e}", file=sys.stderr)
        return 2
    report["path"] = str(path)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(format_memory(report)))
    return 0 if report["served"] and report.get("here", {}).get("fits", True) else 1


def doctor(args) -> int:
    from vllm_metal.doctor.capabilities import capabilities, model_check
    from vllm_metal.doctor.model_memory import config_only

    config = config_only(args.model) if args.model else None
    if config is not None:
        return config_doctor(args, config)
    report = capabilities()
    if args.model:
        report["model"] = model_check(args.model)
        if not report["model"]["served"]:
            report["can_serve"] = False
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
        if args.model:
            m = report["model"]
            print(f"model       {m['path']} ({m['model_type']}): "
                  + ("will be served: " if m["served"] else "refused: ") + m["reason"])
            if m.get("quantization"):
                print(f"format      {m['quantization']}")
            if m.get("memory"):
                gib = {k: v / 2**30 for k, v in m["memory"].items()}
                print(f"memory      weights {gib['metal_float16']:.2f} GiB on Metal (quantized weights kept packed, "
                      f"the rest float16), {gib['cpu_float32']:.2f} GiB on the CPU device (expanded to float32)")
            pooling = m.get("pooling")
            if pooling and not pooling["encoder"] and m["served"] and pooling["how"]:
                print(f"pooling     {'served' if pooling['served'] else 'refused'}: {pooling['how']}")
    return 0 if report["can_serve"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-metal", description="vllm-metal tools")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="report what runs on this machine and what is inert")
    d.add_argument("--json", action="store_true", help="print the report as one JSON object")
    d.add_argument("--model", metavar="PATH", help="also say whether this model (a directory, a GGUF file) will "
                   "be served, its format, quantization and bytes in memory (the load-time checks); a config.json "
                   "(or a directory holding only one): its memory computed from the config alone")
    d.add_argument("--quant", metavar="Q", help="with --model CONFIG: the weights quantized as asked "
                   "(3bit, 4bit, 5bit, 6bit, 8bit: MLX affine, group 64; q4_k_m, q8_0: a llama.cpp GGUF)")
    d.add_argument("--max-model-len", type=int, default=32768, help="with --model CONFIG: the context whose KV "
                   "cache is sized (default 32768)")
    d.add_argument("--kv-cache-dtype", default="auto", help="with --model CONFIG: auto (the model dtype), fp8, "
                   "fp8_e4m3, fp8_e5m2, fp8_per_token_head")
    d.set_defaults(func=doctor)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
