#!/usr/bin/env bash
# Installs vLLM into PYTHON's environment without compiling any of it: vLLM's
# source release built for its `empty` target (VLLM_TARGET_DEVICE=empty: no
# C++/CUDA kernels, no Rust frontend), a pure-Python wheel. A platform plugin
# needs none of vLLM's kernels. scripts/setup.sh uses it on macOS, where vLLM
# publishes no wheel; tests/install/test_vllm_empty_route.py runs it on Linux.
#
#   scripts/install_vllm_empty.sh PYTHON [VERSION]     (VERSION: vllm_metal/versions.py's pin)
#
# PYTHON's environment must hold torch when the wheel is built (vLLM's setup.py
# imports it even when it builds nothing). vLLM goes in with --no-deps: its
# requirements are the caller's (scripts/setup.sh installs what
# scripts/vllm_requirements.py prints).
# The wheel is built once and kept in $VLLM_METAL_WHEEL_CACHE (default
# ~/.cache/vllm-metal/vllm-empty) as vllm-VERSION+empty-py3-none-any.whl; a
# re-run only installs it. Building it takes the sdist (47 MB) and a few small
# build tools from the package index, and 1-3 minutes; nothing is compiled.
#
# What vLLM 0.33's setup.py does, and the two lines changed in the unpacked sdist:
#  - VLLM_TARGET_DEVICE=empty: no CMake extension, requirements/common.txt only
#    (no torch), version VERSION+empty. Honoured on Linux; but on macOS setup.py
#    turns every target except `cpu` into `cpu` (which compiles vLLM's CPU
#    kernels against torch's headers with CMake): patched to leave `empty` alone.
#  - It builds its Rust frontend (vllm-rs, with cargo) for every target when a
#    Rust toolchain is found (skipped with a warning without one): patched to
#    build none for `empty`.
# Each patch must match exactly once; the patched setup.py is then run as macOS
# runs it (sys.platform "darwin", on any host) and must ask for no extension;
# and the wheel must hold no compiled file. A vLLM release that moves either
# line fails here, with the reason, instead of compiling. (bash 3.2: macOS's.)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)

PY=${1:?usage: scripts/install_vllm_empty.sh PYTHON [VERSION]}
# An absolute path (the build runs in other folders); a venv's python stays as it is, unresolved.
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac
VERSION=${2:-$("$PY" "$ROOT/vllm_metal/versions.py" --pin vllm)}
CACHE=${VLLM_METAL_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-metal/vllm-empty}
WHEEL="$CACHE/vllm-$VERSION+empty-py3-none-any.whl"
export PIP_DISABLE_PIP_VERSION_CHECK=1

build() (
  # (A subshell: its exports and its trap end with it.)
  if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "install_vllm_empty.sh: $PY has no torch; install it first (vLLM's setup.py imports it):" \
         "$PY -m pip install torch==$("$PY" "$ROOT/vllm_metal/versions.py" --pin torch)" >&2
    exit 1
  fi
  work=$(mktemp -d "${TMPDIR:-/tmp}/vllm-empty.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  # vLLM's build-system requirements less torch (PYTHON's own is used: no build
  # isolation, so no second torch is downloaded) and cmake/ninja (`empty` runs
  # no CMake). In a folder of their own, first on PYTHONPATH: PYTHON's
  # environment gets none of them.
  "$PY" -m pip install -q --only-binary=:all: --no-warn-conflicts --target "$work/build-tools" \
    "setuptools>=77.0.3,<81" "setuptools-scm>=8" "setuptools-rust>=1.9" "packaging>=24.2" wheel "jinja2>=3.1.6"
  export PYTHONPATH="$work/build-tools${PYTHONPATH:+:$PYTHONPATH}"
  export VLLM_TARGET_DEVICE=empty
  # The source release, from the package index. pip runs setup.py for its
  # metadata (nothing is built) and wants the plain version there: with the
  # `+empty` (on macOS `+cpu`) suffix setup.py adds, pip discards the sdist
  # ("inconsistent version").
  VLLM_SKIP_VERSION_SUFFIX=1 \
  "$PY" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation "vllm==$VERSION" -d "$work/sdist" \
    || { echo "install_vllm_empty.sh: could not fetch vLLM $VERSION's sdist from the package index (see above)" >&2
         exit 1; }
  "$PY" - "$work" "$VERSION" <<'EOF'
import pathlib, sys, tarfile

work, version = pathlib.Path(sys.argv[1]), sys.argv[2]
(sdist,) = (work / "sdist").glob(f"vllm-{version}.tar.gz")
with tarfile.open(sdist) as tar:
    if hasattr(tarfile, "data_filter"):
        tar.extractall(work / "src", filter="data")
    else:
        tar.extractall(work / "src")
setup_py = work / "src" / f"vllm-{version}" / "setup.py"
text = setup_py.read_text()
PATCHES = [
    # macOS: `empty` stays `empty` (vLLM turns every other target into `cpu` there).
    ('if sys.platform.startswith("darwin") and VLLM_TARGET_DEVICE != "cpu":',
     'if sys.platform.startswith("darwin") and VLLM_TARGET_DEVICE not in ("cpu", "empty"):'),
    # No Rust frontend (cargo) for an `empty` build.
    ("\nsetup(\n",
     "\nif _no_device():  # vllm-metal: an `empty` build compiles nothing, Rust included\n"
     "    rust_extensions = []\n\nsetup(\n"),
]
for old, new in PATCHES:
    if text.count(old) != 1:
        sys.exit(f"install_vllm_empty.sh: vLLM {version}'s setup.py no longer holds this line once "
                 f"(found {text.count(old)}); the `empty` route needs revisiting:\n  {old.strip()}")
    text = text.replace(old, new)
setup_py.write_text(text)
EOF
  # The patched setup.py as macOS runs it (on a Mac that is the platform
  # anyway): the arguments it hands setuptools must ask for nothing compiled.
  (cd "$work/src/vllm-$VERSION" && "$PY" - "$VERSION" <<'EOF'
import runpy, sys

import packaging.version, setuptools, setuptools.command.build_ext, setuptools_rust.build, setuptools_scm, torch  # noqa: F401

version = sys.argv[1]
asked = {}
setuptools.setup = lambda **kwargs: asked.update(kwargs)
sys.platform, sys.argv = "darwin", ["setup.py", "bdist_wheel"]
runpy.run_path("setup.py", run_name="__main__")
problems = []
if asked.get("version") != f"{version}+empty":
    problems.append(f"version {asked.get('version')!r} (the target was not `empty`)")
if asked.get("ext_modules"):
    problems.append(f"extensions {[e.name for e in asked['ext_modules']]}")
if asked.get("rust_extensions"):
    problems.append(f"Rust extensions {[str(r.target) for r in asked['rust_extensions']]}")
if problems:
    sys.exit("install_vllm_empty.sh: on macOS vLLM's patched setup.py would build: " + "; ".join(problems))
EOF
  )
  "$PY" -m pip wheel -q --no-deps --no-build-isolation "$work/src/vllm-$VERSION" -w "$work/wheel"
  # The wheel must be pure Python: named +empty, tagged py3-none-any, holding no
  # compiled file (no extension module, no shared library, no vllm-rs binary).
  "$PY" - "$work/wheel" "$VERSION" <<'EOF'
import pathlib, sys, zipfile

wheel_dir, version = pathlib.Path(sys.argv[1]), sys.argv[2]
wheels = sorted(p.name for p in wheel_dir.glob("*.whl"))
want = f"vllm-{version}+empty-py3-none-any.whl"
if wheels != [want]:
    sys.exit(f"install_vllm_empty.sh: built {wheels}, not {want}: VLLM_TARGET_DEVICE=empty was not honoured")
names = zipfile.ZipFile(wheel_dir / want).namelist()
compiled = [n for n in names if n.endswith((".so", ".dylib", ".pyd", ".dll")) or n.endswith("/vllm-rs")]
if compiled:
    sys.exit(f"install_vllm_empty.sh: the `empty` wheel holds compiled files: {compiled[:5]}")
if "vllm/__init__.py" not in names:
    sys.exit("install_vllm_empty.sh: the `empty` wheel has no vllm/__init__.py")
EOF
  mkdir -p "$CACHE"
  mv "$work/wheel/$(basename "$WHEEL")" "$WHEEL.tmp.$$" && mv "$WHEEL.tmp.$$" "$WHEEL"
)

if [[ ! -f "$WHEEL" ]]; then
  echo "building vLLM $VERSION for VLLM_TARGET_DEVICE=empty (nothing compiles; kept in $CACHE)"
  build
fi

"$PY" -m pip install -q --no-deps "$WHEEL"
"$PY" -c "import importlib.metadata as m; print('vLLM', m.version('vllm'), '(VLLM_TARGET_DEVICE=empty: nothing compiled)')"
