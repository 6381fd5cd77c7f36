"""mlx-lm models served through the paged-attention primitives."""
