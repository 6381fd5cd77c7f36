"""LoRA adapters: served per request, many per batch, inside the step's one graph.

adapter_files.py reads an adapter directory (PEFT's `adapter_model.safetensors`
or mlx-lm's `adapters.safetensors`) into low-rank pairs per module, refusing
what cannot be served with the reason. lora_sites.py finds the projections of
a loaded model an adapter can target (after fusion: q/k/v and gate/up share
one matmul) and puts a LoRA-aware wrapper on each. pool.py holds the loaded
adapters (vLLM's `--max-cpu-loras`), packs the ones a step uses and gives each
wrapper its delta: every token's own adapter, base rows untouched.
"""
