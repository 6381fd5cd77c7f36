"""Diagnostics: what this host and build can serve (`vllm-metal doctor`), and the gate that refuses
CUDA-only features with a message instead of a crash."""
