"""The package layout reads as the architecture (docs/architecture.md): one
folder per job, imports only downward, no module over 400 lines. Fast: the
sources are parsed, nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_metal"

# Lowest first. A module may import (at top level or inside a function) only
# from its own folder or a lower rank. A new folder needs a rank here.
RANKS = {"": 0, "native": 1, "formats": 2, "distributed": 3, "models": 4, "multimodal": 5, "adapters": 6,
         "pooling": 7, "kv": 8, "speculative": 9, "engine": 10, "doctor": 11}
# The package root arms the fast-BLAS import hook; __main__ runs the doctor CLI.
EXEMPT = {"__init__.py", "__main__.py"}
MAX_LINES = 400


def folder_of(module: str) -> str:
    """'vllm_metal.native.ops' (or 'vllm_metal.native') -> 'native'; a
    top-level module (or the package itself) -> ''."""
    parts = module.split(".")[1:]
    return parts[0] if parts and parts[0] in RANKS else ""


def imported_modules(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every vllm_metal module `source` (the text of `module`) imports,
    anywhere in the file; relative imports resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "vllm_metal"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "vllm_metal":
                continue
            # `from vllm_metal import envs`, `from vllm_metal.native import ops`: the names may be modules.
            found += [f"{target}.{a.name}" for a in node.names]
    return found


def upward_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """'module (folder rank r) imports target (folder rank s > r)' for each upward import."""
    own = folder_of(module)
    out = []
    for target in imported_modules(source, module, is_package):
        folder = folder_of(target)
        if RANKS[folder] > RANKS[own]:
            out.append(f"{module} ({own or 'base'}: {RANKS[own]}) imports {target} ({folder or 'base'}: {RANKS[folder]})")
    return out


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        yield path, ".".join(parts), is_package


def test_imports_only_go_down():
    offenders = []
    for path, module, is_package in _modules():
        if path.parent == PACKAGE and path.name in EXEMPT:
            continue
        offenders += upward_imports(path.read_text(), module, is_package)
    assert not offenders, "upward imports (move the imported thing down):\n" + "\n".join(offenders)


def test_the_checker_sees_upward_imports():
    lazy = "def f():\n    from vllm_metal.engine.platform import MetalPlatform\n"
    assert upward_imports(lazy, "vllm_metal.models.loader")
    assert upward_imports("import vllm_metal.doctor.cli\n", "vllm_metal.native.ops")
    assert upward_imports("from vllm_metal import engine\n", "vllm_metal.kv.layout")
    assert upward_imports("from ..engine import worker\n", "vllm_metal.kv.layout")
    assert upward_imports("from vllm_metal.native import ops\n", "vllm_metal.envs")
    assert not upward_imports("from vllm_metal.native import ops\nfrom vllm_metal import envs\n",
                              "vllm_metal.models.loader")
    assert not upward_imports("from . import block_file\n", "vllm_metal.kv.layout")


def test_no_module_is_too_long():
    long = [f"{path.relative_to(PACKAGE.parent)}: {n} lines" for path, _, _ in _modules()
            if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines (split them by job):\n" + "\n".join(long)


def test_every_folder_has_a_rank():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(RANKS) - {""}, "give a new folder its rank in RANKS (and docs/architecture.md)"


def test_tests_mirror_the_package():
    """Each folder of the package has its tests in the folder of the same name."""
    tests = Path(__file__).resolve().parent
    missing = [name for name in RANKS if name and not any((tests / name).glob("test_*.py"))]
    assert not missing, f"no tests/<folder>/test_*.py for: {missing}"
