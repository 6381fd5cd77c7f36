"""Pooling models (`--runner pooling`): embeddings, classification, scoring, reranking.

heads.py builds vLLM's own pooler for a checkpoint (DispatchPooler with its
poolers, heads and activations, torch on the CPU) from the head weights
the checkpoint holds; step.py runs one step's final hidden states (MLX)
through it with vLLM's pooling metadata; serving_config.py says what
`--runner pooling` may be combined with and sizes a pooling model's KV
cache. The models themselves live in models/ (decoder families without
their LM head; encoders in models/encoders.py); engine/pooling_runner.py
drives a step.
"""
