"""Where a model's checkpoint lives: a local directory or a Hugging Face hub
id, and the model type its config.json names."""

from __future__ import annotations

from pathlib import Path


def resolve_model_dir(model: str) -> Path:
    """A local model directory, or a Hugging Face hub id downloaded (or found
    in the local hub cache) where the network allows."""
    path = Path(model).expanduser()
    if (path / "config.json").exists():
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"{model} is not a model directory (no config.json); give a local "
                                "mlx-lm / Hugging Face model directory or a hub id")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.py",
                                                             "tokenizer.model", "*.tiktoken", "*.txt"]))
    except Exception as e:  # offline, unknown repo, no access: say which
        raise FileNotFoundError(f"cannot get model {model!r} from the Hugging Face hub ({type(e).__name__}: "
                                f"{e}); download it where the network allows and pass its directory") from e


def _model_type(path: Path) -> str | None:
    import json

    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
