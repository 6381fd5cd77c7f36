"""vLLM's side of a GGUF checkpoint: its Hugging Face config (a config
parser registered with vLLM's public `register_config_parser`, format
"gguf") and its tokenizer (transformers' GGUF tokenizer conversion, saved
once as a tokenizer directory vLLM loads like any other).

vLLM 0.33 no longer detects a GGUF file itself: engine/upstream_patches.py
(`patch_gguf_model_args`) points a `--model x.gguf` at this parser and, where
no `--tokenizer` is given, at the converted tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from vllm_metal import envs
from vllm_metal.formats import gguf_checkpoint

CONFIG_FORMAT = "gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def hf_config(model: str | Path):
    """(config dict, transformers PretrainedConfig) of a GGUF checkpoint."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    gguf = gguf_checkpoint.find_gguf(model)
    if gguf is None:
        raise gguf_checkpoint.GGUFError(f"{model} is not a GGUF file or a directory holding one")
    config = gguf_checkpoint.config_from_metadata(gguf)
    arch_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config["model_type"])
    if arch_name:  # else vLLM would name the bare model class (an embedding model to it)
        config["architectures"] = [arch_name]
    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf = AutoConfig.for_model(config["model_type"], **fields)
    return hf.to_dict(), hf


def register_config_parser() -> None:
    from vllm.transformers_utils.config import _CONFIG_FORMAT_TO_CONFIG_PARSER
    from vllm.transformers_utils.config import register_config_parser as register
    from vllm.transformers_utils.config_parser_base import ConfigParserBase

    if CONFIG_FORMAT in _CONFIG_FORMAT_TO_CONFIG_PARSER:
        return

    class GGUFConfigParser(ConfigParserBase):
        def parse(self, model, trust_remote_code, revision=None, code_revision=None, **kwargs):
            return hf_config(model)

    register(CONFIG_FORMAT)(GGUFConfigParser)


def has_tokenizer(directory: Path) -> bool:
    return any((directory / name).exists() for name in TOKENIZER_FILES)


def _cache_root() -> Path:
    return envs.get_path("VLLM_METAL_CACHE_DIR")


def tokenizer_dir(gguf: Path) -> str:
    """A tokenizer directory converted from the GGUF's own vocabulary
    (transformers' GGUF tokenizer conversion), built once per file."""
    from transformers import AutoTokenizer

    gguf = gguf.resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = _cache_root() / "gguf-tokenizers" / f"{gguf.stem}-{key}"
    stamp = target / "vllm_metal_gguf.json"
    if stamp.exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except Exception as e:
            raise gguf_checkpoint.GGUFError(
                f"cannot build a tokenizer from {gguf}'s metadata ({type(e).__name__}: {e}); pass --tokenizer "
                "DIR with the model's tokenizer files") from e
        tokenizer.save_pretrained(str(tmp))
        (tmp / stamp.name).write_text(json.dumps({"gguf": str(gguf), "size": stat.st_size}) + "\n")
        try:
            os.replace(tmp, target)
        except OSError:  # built concurrently by another process
            if not stamp.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
