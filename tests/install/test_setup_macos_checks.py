"""scripts/setup.sh's checks on a Mac, with the Mac faked: `uname`, `sysctl`,
`sw_vers`, `xcode-select` and the Python are stand-ins on PATH. Each wrong
machine is refused before anything is installed, with a one-line fix; a right
one passes the checks (and then fails at the first install step, which the
stand-in Python cannot do)."""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GOOD = dict(machine="arm64", translated="0", macos="15.1", py_arch="arm64", py_minor=12, clt=True)


def _tool(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def run_setup(tmp_path: Path, mode: str = "", **mac) -> subprocess.CompletedProcess:
    """setup.sh from a copy of the scripts (no .venv beside it) on a faked Mac."""
    mac = {**GOOD, **mac}
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", tree / "scripts" / "setup.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir, "uname", f'[[ "$1" == "-m" ]] && echo {mac["machine"]} || echo Darwin')
    _tool(bin_dir, "sysctl", f'echo {mac["translated"]}')
    _tool(bin_dir, "sw_vers", f'echo {mac["macos"]}')
    _tool(bin_dir, "xcode-select", "exit 0" if mac["clt"] else "exit 2")
    # The Python: answers the architecture/version probe, fails anything else (the installs).
    _tool(bin_dir, "python3", f'if [[ "$1" == "-c" ]]; then echo {mac["py_arch"]} 3.{mac["py_minor"]} '
                              f'{mac["py_minor"]}; else echo "stand-in python: $*" >&2; exit 7; fi')
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    args = ["bash", str(tree / "scripts" / "setup.sh")] + ([mode] if mode else [])
    return subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("mac, says", [
    (dict(translated="1"), "under Rosetta; MLX's Metal backend needs native arm64"),
    (dict(machine="x86_64"), "needs a Mac with Apple Silicon (arm64); this one is x86_64"),
    (dict(macos="13.6"), "MLX needs macOS 14 (Sonoma) or later; this is macOS 13.6"),
    (dict(py_arch="x86_64"), "this Python runs as x86_64 under Rosetta"),
    (dict(py_minor=10), "is Python 3.10; vLLM 0.33 needs Python 3.11 to 3.14"),
    (dict(py_minor=15), "is Python 3.15; vLLM 0.33 needs Python 3.11 to 3.14"),
    (dict(clt=False), "xcode-select --install"),
], ids=["rosetta-shell", "intel-mac", "old-macos", "rosetta-python", "python-3.10", "python-3.15", "no-clt"])
def test_a_wrong_mac_is_refused_before_anything_is_installed(tmp_path, mac, says):
    done = run_setup(tmp_path, **mac)
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("setup.sh: ")]
    assert len(lines) == 1 and says in lines[0], done.stderr
    assert "stand-in python" not in done.stderr  # nothing was attempted
    assert not (tmp_path / "tree" / ".venv").exists()


def test_a_right_mac_passes_the_checks(tmp_path):
    done = run_setup(tmp_path)
    assert "setup.sh: " not in done.stderr, done.stderr
    # The checks passed: the first install step (the virtual environment) was tried.
    assert "stand-in python: -m venv .venv" in done.stderr
    assert done.returncode == 7


def test_core_mode_accepts_python_3_10(tmp_path):
    done = run_setup(tmp_path, "--core", py_minor=10)
    assert "setup.sh: " not in done.stderr and "stand-in python: -m venv .venv" in done.stderr, done.stderr

