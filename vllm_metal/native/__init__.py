"""The native layer: the compiled MLX extension (loaded only against the MLX it was built for), the
lazy operations over it (`ops`), the fast BLAS for MLX's CPU matmuls, and the device's memory facts."""
