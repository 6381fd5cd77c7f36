"""vLLM's contracts implemented on MLX: the platform, the worker, the model runner and what a step
needs (persistent batch, block tables, step inputs, sampling, prompt logprobs)."""
