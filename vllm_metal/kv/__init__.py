"""KV-cache persistence: prefix blocks kept on disk across restarts (docs/kv_disk.md).

`block_file` is the on-disk format (pure numpy, no MLX, no vLLM);
`disk_connector` is vLLM's KV-connector API over it (its writer thread: `disk_writer`).
"""
