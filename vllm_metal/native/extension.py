"""Loads the native extension after checking it matches the installed MLX.

The extension is ABI-bound to the exact MLX release it was compiled against;
loading it into another release fails in obscure ways (missing symbols, or
worse, silent memory corruption), so the versions are compared first, using
package metadata only.
"""

from __future__ import annotations

import importlib.metadata


def built_against_mlx() -> str | None:
    """The MLX version the extension was built against, or None if unbuilt."""
    try:
        from vllm_metal import _build_info
    except ImportError:
        return None
    return _build_info.MLX_VERSION


def installed_mlx() -> str | None:
    try:
        return importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError:
        return None


def mlx_mismatch_reason(built: str | None, runtime: str | None) -> str | None:
    """Why the extension cannot load with this MLX, or None if it can."""
    if runtime is None:
        return "MLX is not installed (pip install mlx==<version>; on Linux also mlx-cpu)"
    if built is None:
        return (
            "the vllm_metal native extension is not built; reinstall with "
            "`pip install -e .` (or `pip install .`)"
        )
    if built != runtime:
        return (
            f"vllm_metal's native extension was built against MLX {built} but MLX "
            f"{runtime} is installed; install mlx=={built} (and mlx-cpu=={built} on "
            f"Linux) or rebuild vllm-metal against MLX {runtime}"
        )
    return None


def load_extension():
    """Import and return vllm_metal._ext, or raise ImportError saying why not."""
    reason = mlx_mismatch_reason(built_against_mlx(), installed_mlx())
    if reason is not None:
        raise ImportError(reason)
    import mlx.core  # noqa: F401  (registers mx.array's nanobind type first)

    from vllm_metal import _ext

    return _ext
