"""mlx-lm models served through the paged-attention primitives: loading, the per-family attention
adapters, and the loaded model the runner steps."""
