"""Checkpoint formats: what a checkpoint is (checkpoint.py), GGUF files
(gguf_*.py), AWQ / GPTQ directories (awq_gptq.py), the embedded default
model's GGUF (default_model.py)."""
