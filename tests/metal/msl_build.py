"""Builds the MSL executor (see msl_executor.py): the real Metal kernels
compiled as C++ and linked with the runtime that runs them on the CPU.

The kernel source is the very text the extension embeds (produced by
cmake/embed_metal_source.cmake); it is compiled as C++ by clang (>= 18) against
the shim in msl/include/metal_stdlib and linked with msl/msl_runtime.cpp,
which runs every threadgroup's threads as fibers with real barrier and
simdgroup semantics. Two mechanical steps stand between the .metal text and
the C++ compiler, both here:

* `threadgroup T name[N];` declarations become references into the
  threadgroup's shared (poisoned) memory: C++ has no threadgroup storage class.
* Glue: for every `[[host_name]]` instantiation, a thunk that passes
  `[[buffer(n)]]` slots and thread-position attributes to the kernel, found by
  parsing the preprocessed kernel signature. It is registered under its host
  name, which is how the drivers (msl/paged_attention_driver.cpp,
  msl/gated_delta_driver.cpp and msl/write_kv_driver.cpp, the stand-ins for
  eval_gpu) find kernels, as eval_gpu does through MLX.

Each kernel library of metal/ (KERNEL_SOURCES) is its own translation unit,
as it is its own Metal library in the extension.

Builds are cached under the system temp dir, keyed by every input's content.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MSL = HERE / "msl"
METAL = REPO / "metal"
EMBED_SCRIPT = REPO / "cmake" / "embed_metal_source.cmake"
SELFTEST_SOURCE = HERE / "kernels" / "shim_selftest.metal"

CXX_FLAGS = [
    "-std=c++20", "-O2", "-g0", "-fPIC", "-pthread",
    # Each half/bfloat operation rounds to its type, as on the GPU.
    "-fexcess-precision=16",
    "-Wno-unknown-attributes", "-Wno-ignored-attributes",
]
THREAD_ATTRIBUTES = {
    "thread_position_in_grid", "threadgroup_position_in_grid",
    "thread_position_in_threadgroup", "threads_per_threadgroup", "threadgroups_per_grid",
    "threads_per_grid", "thread_index_in_threadgroup", "simdgroup_index_in_threadgroup",
    "thread_index_in_simdgroup", "simdgroups_per_threadgroup", "threads_per_simdgroup",
}


class ExecutorUnavailable(RuntimeError):
    """A tool the executor needs (clang >= 18, cmake) is missing."""


def find_compiler() -> str:
    """A clang++ (>= 18): _Float16, __bf16 and __builtin_vectorelements on this host."""
    for name in ("clang++-19", "clang++-18", "clang++-20", "clang++"):
        path = shutil.which(name)
        if path is None:
            continue
        out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"clang version (\d+)", out)
        if m and int(m.group(1)) >= 18:
            return path
    raise ExecutorUnavailable("the MSL executor needs clang++ >= 18 (Debian: apt-get install clang-19)")


def find_cmake() -> str:
    for candidate in (Path(sys.executable).parent / "cmake", shutil.which("cmake")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise ExecutorUnavailable("the MSL executor needs cmake (pip install cmake)")


# Kernel libraries (as cmake/metal_kernels.cmake embeds them): name ->
# (source in metal/, variable of the generated header).
KERNEL_SOURCES = {
    "paged_attention": ("paged_attention.metal", "kPagedAttentionMetalSource"),
    "gated_delta": ("gated_delta.metal", "kGatedDeltaMetalSource"),
    "write_kv": ("write_kv.metal", "kWriteKVMetalSource"),
}


def embedded_metal_source(out_dir: Path, library: str = "paged_attention") -> str:
    """The Metal source of `library` exactly as the build embeds it into the extension."""
    source, variable = KERNEL_SOURCES[library]
    header = out_dir / f"{library}_metal_source.h"
    subprocess.run(
        [find_cmake(), f"-DINPUT={METAL / source}", f"-DOUTPUT={header}",
         f"-DVARIABLE={variable}", "-P", str(EMBED_SCRIPT)],
        check=True, capture_output=True, text=True)
    literals = re.findall(r'R"vllm_msl\((.*?)\)vllm_msl"', header.read_text(), flags=re.S)
    if len(literals) != 1:
        raise RuntimeError(f"{header}: expected exactly one raw string literal")
    return literals[0]


_TG_ARRAY = re.compile(
    r"^(?P<indent>[ \t]*)threadgroup\s+(?P<type>[A-Za-z_][\w:]*(?:<[^;]*?>)?)\s+"
    r"(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\]]+\])+)\s*;", re.M)


def rewrite_threadgroup_arrays(source: str) -> str:
    def repl(m: re.Match) -> str:
        t, name, dims = m["type"], m["name"], m["dims"]
        return (f"{m['indent']}threadgroup {t} (&{name}){dims} = *(threadgroup {t} (*){dims})"
                f"::msl_rt::threadgroup_alloc(sizeof({t}{dims}), alignof({t}));")
    out = _TG_ARRAY.sub(repl, source)
    # Anything else spelled `threadgroup` must be a pointer or reference
    # qualifier; a declaration form the rewrite missed would otherwise become
    # a per-thread array, silently.
    code = re.sub(r"//[^\n]*|/\*.*?\*/", lambda c: re.sub(r"[^\n]", " ", c.group()), out,
                  flags=re.S)
    for m in re.finditer(r"\bthreadgroup\b(?!_)([^;,)=]*)", code):
        if "*" not in m.group(1) and "&" not in m.group(1):
            line = out.count("\n", 0, m.start()) + 1
            raise RuntimeError(f"unsupported threadgroup declaration at line {line}: "
                               f"{out[m.start():m.end()]!r}")
    return out


@dataclass
class Instantiation:
    host_name: str
    function: str
    template_args: str


def find_instantiations(preprocessed: str) -> list[Instantiation]:
    """Kernels by host name: `[[host_name]]` instantiations of templates, and
    plain (non-template) kernels under their function name, as Metal does."""
    found = []
    plain = re.compile(r"(template\s*<[^{;]*?>\s*)?\[\[\s*kernel\s*\]\]\s*void\s+(\w+)\s*\(")
    for m in plain.finditer(preprocessed):
        if m.group(1) is None:
            found.append(Instantiation(m.group(2), m.group(2), ""))
    pattern = re.compile(
        r'template\s*\[\[\s*host_name\s*\(\s*((?:"[^"]*"\s*)+)\)\s*\]\]\s*\[\[\s*kernel\s*\]\]\s*'
        r"decltype\s*\(\s*(\w+)\s*<(.*?)>\s*\)\s*\w+\s*<.*?>\s*;", re.S)
    for m in pattern.finditer(preprocessed):
        name = "".join(re.findall(r'"([^"]*)"', m.group(1)))
        found.append(Instantiation(name, m.group(2), " ".join(m.group(3).split())))
    return found


def _split_params(text: str) -> list[str]:
    params, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([<":
            depth += 1
        elif ch in ")]>":
            depth -= 1
        elif ch == "," and depth == 0:
            params.append(text[start:i])
            start = i + 1
    params.append(text[start:])
    return [p.strip() for p in params if p.strip()]


def kernel_parameters(preprocessed: str, function: str) -> list[tuple[str, str | int]]:
    """[("buffer", n) or ("id", attribute)] for each parameter of `function`."""
    m = re.search(r"\[\[\s*kernel\s*\]\]\s*void\s+" + re.escape(function) + r"\s*\(", preprocessed)
    if m is None:
        raise RuntimeError(f"kernel {function} not found")
    depth, i = 1, m.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(preprocessed[i], 0)
        i += 1
    result = []
    for param in _split_params(preprocessed[m.end():i - 1]):
        attrs = re.findall(r"\[\[\s*(\w+)\s*(?:\(\s*(\d+)\s*\))?\s*\]\]", param)
        if len(attrs) != 1:
            raise RuntimeError(f"{function}: parameter {param!r} needs exactly one attribute")
        attr, index = attrs[0]
        if attr == "buffer":
            result.append(("buffer", int(index)))
        elif attr in THREAD_ATTRIBUTES:
            result.append(("id", attr))
        else:
            raise RuntimeError(f"{function}: the executor does not support [[{attr}]]")
    return result


def glue(preprocessed: str) -> str:
    lines = ["namespace {"]
    instantiations = find_instantiations(preprocessed)
    if not instantiations:
        raise RuntimeError("no [[host_name]] kernel instantiations found")
    for k, inst in enumerate(instantiations):
        fn = f"{inst.function}<{inst.template_args}>" if inst.template_args else inst.function
        args = []
        for j, (kind, what) in enumerate(kernel_parameters(preprocessed, inst.function)):
            p = f"msl_glue::param_t<{j}, F>"
            args.append(f"msl_glue::buffer<{p}>(b[{what}])" if kind == "buffer"
                        else f"msl_glue::id<{p}>(ids.{what})")
        lines += [
            f"void thunk_{k}(void* const* b, const msl_rt::ThreadIds& ids) {{",
            f"  using F = decltype(&{fn});",
            f"  {fn}({', '.join(args)});",
            "}",
            f'const msl_rt::KernelRegistration registration_{k}("{inst.host_name}", thunk_{k});',
        ]
    lines.append("} // namespace")
    return "\n".join(lines) + "\n"


def include_flags() -> list[str]:
    return [f"-I{MSL / 'include'}", f"-I{MSL}", f"-I{METAL}"]


_INSTANTIATION_ATTRIBUTES = re.compile(
    r'(template)\s*\[\[\s*host_name\s*\(\s*(?:"[^"]*"\s*)+\)\s*\]\]\s*\[\[\s*kernel\s*\]\]')


def kernel_translation_unit(cxx: str, source: str, work: Path, stem: str, name: str) -> Path:
    """Writes <stem>.cpp: the preprocessed shim and source, plus glue.

    Works on the preprocessed text because clang (unlike Metal) rejects
    attributes on explicit instantiations, and those come out of macros: they
    are read (for the glue) and then dropped.
    """
    probe = work / f"{stem}_source.cpp"
    probe.write_text(f'#include <metal_stdlib>\n#line 1 "{name}"\n' +
                     rewrite_threadgroup_arrays(source))
    pre = subprocess.run([cxx, *CXX_FLAGS, *include_flags(), "-E", str(probe)],
                         capture_output=True, text=True)
    if pre.returncode != 0:
        raise RuntimeError(f"preprocessing {stem} failed:\n{pre.stderr}")
    without_markers = re.sub(r"(?m)^#.*$", "", pre.stdout)
    tu = work / f"{stem}.cpp"
    tu.write_text(_INSTANTIATION_ATTRIBUTES.sub(r"\1", pre.stdout) +
                  "\n// ---- executor glue\n" + glue(without_markers))
    return tu


def _fingerprint(cxx: str, texts: list[str]) -> str:
    h = hashlib.sha256()
    h.update(subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.encode())
    h.update(" ".join(CXX_FLAGS).encode())
    for t in texts:
        h.update(hashlib.sha256(t.encode()).digest())
    return h.hexdigest()[:20]


def build(cache_root: Path | None = None) -> Path:
    """Builds (or finds cached) the executor library; returns its path."""
    cxx = find_compiler()
    with tempfile.TemporaryDirectory() as scratch:
        metal_sources = {name: embedded_metal_source(Path(scratch), name)
                         for name in KERNEL_SOURCES}
    support = sorted(p for p in list(MSL.rglob("*")) + list(METAL.glob("*.h")) if p.is_file())
    texts = [*metal_sources.values(), SELFTEST_SOURCE.read_text(), Path(__file__).read_text()]
    texts += [f"{p.name}\n{p.read_text()}" for p in support]
    root = cache_root or Path(tempfile.gettempdir()) / "vllm_metal_msl_executor"
    lib = root / _fingerprint(cxx, texts) / "libmsl_executor.so"
    if lib.exists():
        return lib
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=root))
    try:
        units = [
            *(kernel_translation_unit(cxx, text, work, f"kernels_{name}",
                                      KERNEL_SOURCES[name][0])
              for name, text in metal_sources.items()),
            kernel_translation_unit(cxx, SELFTEST_SOURCE.read_text(), work, "kernels_selftest",
                                    SELFTEST_SOURCE.name),
            MSL / "msl_runtime.cpp",
            MSL / "msl_host_api.cpp",
            MSL / "paged_attention_driver.cpp",
            MSL / "gated_delta_driver.cpp",
            MSL / "write_kv_driver.cpp",
        ]
        jobs = [(u, work / f"{u.stem}.o") for u in units]
        procs = [subprocess.Popen([cxx, *CXX_FLAGS, *include_flags(), "-c", str(u), "-o", str(o)],
                                  stderr=subprocess.PIPE, text=True) for u, o in jobs]
        errors = [(u, p.communicate()[1]) for (u, _), p in zip(jobs, procs)]
        failed = [(u, err) for (u, err), p in zip(errors, procs) if p.returncode != 0]
        if failed:
            raise RuntimeError("\n".join(f"compiling {u.name} failed:\n{err}" for u, err in failed))
        tmp_lib = work / "libmsl_executor.so"
        # compiler-rt's builtins: float -> __bf16 (__truncsfbf2) is not in
        # older libgcc.
        builtins = subprocess.run([cxx, "-rtlib=compiler-rt", "-print-libgcc-file-name"],
                                  capture_output=True, text=True).stdout.strip()
        if not Path(builtins).exists():
            raise ExecutorUnavailable("the MSL executor needs compiler-rt's builtins "
                                      "(Debian: apt-get install libclang-rt-19-dev)")
        subprocess.run([cxx, "-shared", "-pthread", "-o", str(tmp_lib),
                        *(str(o) for _, o in jobs), builtins],
                       check=True, capture_output=True, text=True)
        lib.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp_lib, lib)
        return lib
    finally:
        shutil.rmtree(work, ignore_errors=True)
