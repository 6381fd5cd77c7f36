"""Checkpoint formats: where a model directory comes from (local or the Hugging Face hub) and the
default model's conversion from GGUF to an MLX directory."""
