"""The disk KV connector's names and its --kv-transfer-config, without importing vLLM
(the CUDA-path gate and the platform read them)."""

from __future__ import annotations

CONNECTOR_NAME = "MetalDiskConnector"
MODULE_PATH = "vllm_metal.kv.disk_connector"


def transfer_config_dict(path: str, max_bytes: int | None = None) -> dict:
    """The kv_transfer_config that turns the disk cache on (what VLLM_METAL_KV_DISK fills in)."""
    extra: dict = {"path": str(path)}
    if max_bytes is not None:
        extra["max_bytes"] = int(max_bytes)
    return dict(kv_connector=CONNECTOR_NAME, kv_connector_module_path=MODULE_PATH, kv_role="kv_both",
                kv_connector_extra_config=extra, kv_load_failure_policy="recompute")


def is_ours(kv_transfer_config) -> bool:
    """True for the disk connector (named with our module path, or with none)."""
    return (kv_transfer_config is not None
            and getattr(kv_transfer_config, "kv_connector", None) == CONNECTOR_NAME
            and getattr(kv_transfer_config, "kv_connector_module_path", None) in (None, MODULE_PATH))
