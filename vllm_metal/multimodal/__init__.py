"""Images in, text out: vision-language checkpoints (multimodal/registry.py
lists the families), their vision towers in MLX, and the runner's multimodal
side of a step (multimodal/step.py: the encoder cache, image embeddings
scattered into the text model's input, M-RoPE positions, image tokens
attended both ways). vLLM keeps its multimodal processors, encoder-cache
budget and image-aware prefix caching (multimodal/serving.py)."""
