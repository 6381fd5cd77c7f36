"""The disk KV cache (vllm_metal.kv): prefix blocks survive an engine restart, bad files
are never served, a full disk does not stop serving, the directory stays under its bound,
and a block file is never seen half-written.

Engine tests compare against an engine without the connector (an independent run, not
the connector's own earlier output): greedy tokens and the logprobs of every sampled
token, which depend on every restored K/V row.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from engine_helpers import GOLDEN, engine, runner_of

from vllm_metal.native import ops
from vllm_metal.kv import block_file
from vllm_metal.kv.block_file import BlockFileError, BlockMeta
from vllm_metal.kv.connector_config import transfer_config_dict

LONG = GOLDEN[-1]["prompt_ids"]  # 571 tokens
# Six prompts with distinct first blocks (so distinct hash chains): 120 tokens,
# 7 full blocks of 16 that can be restored (the last token is always computed).
PROMPTS = [LONG[40 * k:40 * k + 120] for k in range(6)]
SHARED = [PROMPTS[0] + LONG[300 + 10 * k:310 + 10 * k] for k in range(3)]  # share PROMPTS[0]'s blocks
BLOCK = 16
RESTORABLE = (120 - 1) // BLOCK  # 7
ENGINE = dict(max_model_len=512, kv_cache_memory_bytes=64 << 20)
CHUNKED = dict(ENGINE, enable_chunked_prefill=True, max_num_batched_tokens=32)  # prompts in 4+ steps
MAX_TOKENS = 4
PREEMPT_TOKENS = 24
BYTES_PER_BLOCK = 30 * 2 * BLOCK * 3 * 64 * 4  # SmolLM2: 30 layers, K and V, 3 KV heads of 64, float32


def run(llm, prompts, prompt_logprobs=None, max_tokens=MAX_TOKENS):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3,
                            prompt_logprobs=prompt_logprobs)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [dict(tokens=list(o.outputs[0].token_ids),
                 logprobs=[{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs],
                 prompt_logprobs=o.prompt_logprobs, cached=o.num_cached_tokens) for o in outs]


def assert_same(got, want):
    assert got["tokens"] == want["tokens"]
    for g, w in zip(got["logprobs"], want["logprobs"]):
        assert g.keys() == w.keys()
        np.testing.assert_allclose([g[t] for t in w], [w[t] for t in w], rtol=0, atol=1e-4)


def files(directory) -> list[Path]:
    return sorted(Path(directory).glob(f"*{block_file.SUFFIX}"))


def file_of(directory, prompt, block: int) -> Path:
    """The file of `prompt`'s block `block`, found by vLLM's own block hash."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)  # vLLM's default: the same NONE_HASH in every process
    parent = kv_cache_utils.NONE_HASH
    for j in range(block + 1):
        parent = hash_block_tokens(hash_fn, parent, prompt[j * BLOCK:(j + 1) * BLOCK], None)
    matches = [p for p in files(directory) if p.name.endswith(f"-{parent.hex()}{block_file.SUFFIX}")]
    assert len(matches) == 1, f"block {block}: {len(matches)} files"
    return matches[0]


def header_meta(path) -> dict:
    raw = Path(path).read_bytes()
    meta_len = block_file.HEADER.unpack(raw[:block_file.HEADER.size])[2]
    return json.loads(raw[block_file.HEADER.size:block_file.HEADER.size + meta_len])


def payload_of(path) -> bytes:
    raw = Path(path).read_bytes()
    return raw[block_file.HEADER.size + block_file.HEADER.unpack(raw[:block_file.HEADER.size])[2]:]


@pytest.fixture(scope="module")
def reference(model_dir):
    with engine(model_dir, **ENGINE) as llm:
        return dict(prompts=run(llm, PROMPTS), shared=run(llm, SHARED),
                    prompt_logprobs=run(llm, [PROMPTS[0]], prompt_logprobs=2)[0],
                    long=run(llm, PROMPTS[2:6], max_tokens=PREEMPT_TOKENS))


@pytest.fixture(scope="module")
def saved(model_dir, reference, tmp_path_factory):
    """A directory filled by one engine: the six prompts at once, then three
    concurrent requests sharing PROMPTS[0]'s prefix."""
    directory = tmp_path_factory.mktemp("kv")
    with engine(model_dir, kv_transfer_config=transfer_config_dict(str(directory)), **ENGINE) as llm:
        kv = runner_of(llm).kv
        before = [ops._ext.buffer_address(a) for a in (kv.keys[0], kv.values[-1])]
        first = run(llm, PROMPTS)
        shared = run(llm, SHARED)
        after = [ops._ext.buffer_address(a) for a in (kv.keys[0], kv.values[-1])]
        stats = dict(runner_of(llm).kv_connector.stats)
    for got, want in zip(first + shared, reference["prompts"] + reference["shared"]):
        assert_same(got, want)
    assert stats["save_errors"] == 0 and stats["blocks_saved"] == len(files(directory))
    # The writer's views of the cache are released before the next step writes
    # it (the fence): every step still updated the cache in place, never a copy.
    assert after == before
    return directory


def test_restart_restores_prefix(model_dir, reference, saved, tmp_path):
    directory = tmp_path / "kv"
    directory.mkdir()
    for p in files(saved):
        (directory / p.name).write_bytes(p.read_bytes())
    # Every full block any request computed: 7 per prompt (+1 past the
    # prompt, computed while decoding) and the shared requests' own blocks.
    assert len(files(directory)) >= 6 * RESTORABLE
    # Restored prefix, then the suffix (and the prompt-logprobs request) in chunks.
    with engine(model_dir, kv_transfer_config=transfer_config_dict(str(directory)), **CHUNKED) as llm:
        # Three concurrent requests sharing PROMPTS[0]'s prefix: one loads it,
        # the others share the loaded blocks in the same step.
        shared = run(llm, SHARED)
        again = run(llm, PROMPTS[:2])
        with_prompt_logprobs = run(llm, [PROMPTS[0]], prompt_logprobs=2)[0]
        stats = runner_of(llm).kv_connector.stats
    for got, want in zip(shared + again, reference["shared"] + reference["prompts"][:2]):
        assert got["cached"] >= RESTORABLE * BLOCK, "the prefix should have come from disk"
        assert_same(got, want)
    # PROMPTS[0]'s blocks once (then from memory), PROMPTS[1]'s.
    assert stats["blocks_loaded"] >= 2 * RESTORABLE and stats["load_errors"] == 0
    # vLLM never reads any cache for a prompt-logprobs request (it needs every
    # prompt row's logits): they are computed, and equal the reference.
    ref = reference["prompt_logprobs"]["prompt_logprobs"]
    got = with_prompt_logprobs["prompt_logprobs"]
    assert len(got) == len(ref)
    for g, w in zip(got[1:], ref[1:]):
        assert g.keys() == w.keys()
        np.testing.assert_allclose([g[t].logprob for t in w], [w[t].logprob for t in w], atol=1e-4)


def test_served_usage_reports_restored_tokens_as_cached(model_dir, reference, saved, tmp_path):
    """`vllm serve` with only VLLM_METAL_KV_DISK set: a prompt whose blocks are on
    disk reports them in the OpenAI usage as cached prompt tokens
    (--enable-prompt-tokens-details) and answers as without the connector; a
    prompt that was never saved reports none."""
    import httpx
    from server_helpers import SERVED_NAME, vllm_server
    from transformers import AutoTokenizer

    directory = tmp_path / "kv"
    directory.mkdir()
    for p in files(saved):
        (directory / p.name).write_bytes(p.read_bytes())
    unsaved = LONG[450:570]
    with vllm_server(model_dir, "--enable-prompt-tokens-details", env={"VLLM_METAL_KV_DISK": str(directory)},
                     log_path=tmp_path / "serve.log") as (base, _):
        def complete(prompt):
            r = httpx.post(base + "/v1/completions", timeout=120, json=dict(
                model=SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
            r.raise_for_status()
            return r.json()

        restored, fresh = complete(PROMPTS[3]), complete(unsaved)
    assert restored["usage"]["prompt_tokens"] == len(PROMPTS[3])
    assert restored["usage"]["prompt_tokens_details"]["cached_tokens"] == RESTORABLE * BLOCK
    assert (fresh["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0) == 0
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert restored["choices"][0]["text"] == tokenizer.decode(reference["prompts"][3]["tokens"])


def test_corruption_catalogue(model_dir, reference, saved, tmp_path, caplog):
    directory = tmp_path / "kv"
    directory.mkdir()
    for p in files(saved):
        (directory / p.name).write_bytes(p.read_bytes())

    truncated = file_of(directory, PROMPTS[1], 3)
    truncated.write_bytes(truncated.read_bytes()[:-100])
    flipped = file_of(directory, PROMPTS[2], 2)  # header intact: caught by the load's checksum
    data = bytearray(flipped.read_bytes())
    data[-5000] ^= 0x01
    flipped.write_bytes(bytes(data))
    other_model = file_of(directory, PROMPTS[3], 0)
    good, payload = header_meta(other_model), np.frombuffer(payload_of(other_model), np.uint8)
    other_model.unlink()
    block_file.write_block_file(other_model, BlockMeta("0" * 64, good["block_hash"], good["num_tokens"],
                                                       good["payload_bytes"]), [payload], tmp_id=0)
    empty = file_of(directory, PROMPTS[4], 1)
    empty.write_bytes(b"")
    # A crash mid-write: block 4 of PROMPTS[5] exists only as a dead writer's temp file.
    crashed = file_of(directory, PROMPTS[5], 4)
    stale = crashed.with_name(crashed.name + ".tmp-999999999-7")
    crashed.rename(stale)

    with engine(model_dir, kv_transfer_config=transfer_config_dict(str(directory)), **ENGINE) as llm:
        got = run(llm, PROMPTS)
        stats = runner_of(llm).kv_connector.stats
    assert not stale.exists(), "stale temporary files are removed at start"
    for g, w in zip(got, reference["prompts"]):
        assert_same(g, w)
    cached = [g["cached"] for g in got]
    assert cached[0] >= RESTORABLE * BLOCK
    assert cached[1] == 3 * BLOCK  # blocks before the truncated one
    assert cached[3] == 0  # another model's file is never used
    assert cached[4] == 1 * BLOCK
    assert cached[5] == 4 * BLOCK
    assert stats["load_errors"] == 1  # the flipped byte, found by the checksum, recomputed
    # ... and saved again once recomputed: a good file, with the original's K/V.
    meta = BlockMeta(**{k: v for k, v in header_meta(flipped).items()})
    resaved = np.zeros(meta.payload_bytes // 4, np.float32)
    block_file.read_block_file(flipped, meta, [resaved])
    original = np.frombuffer(payload_of(saved / flipped.name), np.float32)
    np.testing.assert_allclose(resaved, original, rtol=0, atol=1e-4)
    warnings = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(warnings) == 4, warnings  # one per bad file (the missing one is just a miss)
    assert any("checksum" in w for w in warnings) and any("fingerprint" in w for w in warnings)


def test_disk_full_serving_goes_on(model_dir, reference, tmp_path, monkeypatch, caplog):
    real = block_file.write_block_file
    calls = []

    def full_after_two(path, meta, chunks, tmp_id):
        calls.append(path)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, meta, chunks, tmp_id)

    monkeypatch.setattr(block_file, "write_block_file", full_after_two)
    with engine(model_dir, kv_transfer_config=transfer_config_dict(str(tmp_path)), **ENGINE) as llm:
        got = run(llm, PROMPTS[:3])
        connector = runner_of(llm).kv_connector
        stats, enabled = dict(connector.stats), connector.saving_enabled
    for g, w in zip(got, reference["prompts"][:3]):
        assert_same(g, w)
    assert not enabled and stats["save_errors"] == 1 and stats["blocks_saved"] == 2
    assert len(calls) == 3, "saving stops after the first ENOSPC"
    assert len(files(tmp_path)) == 2 and not list(tmp_path.glob("*.tmp-*"))
    assert sum("saving stopped" in r.getMessage() for r in caplog.records) == 1


def test_preemption_with_saves_in_flight(model_dir, reference, tmp_path):
    # Four requests growing to 10 blocks each in a 34-block cache: some are
    # preempted (their blocks freed and reused while their saves may still be
    # in flight) and resumed, partly from their own saved blocks.
    tight = dict(ENGINE, kv_cache_memory_bytes=34 * BYTES_PER_BLOCK, max_num_seqs=4)
    with engine(model_dir, kv_transfer_config=transfer_config_dict(str(tmp_path)), **tight) as llm:
        got = run(llm, PROMPTS[2:6], max_tokens=PREEMPT_TOKENS)
        resumed = runner_of(llm).batch.num_resumed
        stats = runner_of(llm).kv_connector.stats
    assert resumed > 0, "the tiny cache should have forced preemptions"
    assert stats["blocks_saved"] > 0 and stats["save_errors"] == 0
    for g, w in zip(got, reference["long"]):
        assert_same(g, w)


def test_max_bytes_evicts_least_recently_used(model_dir, reference, saved, tmp_path):
    size = files(saved)[0].stat().st_size
    bound = 5 * size + size // 2
    config = transfer_config_dict(str(tmp_path), max_bytes=bound)
    with engine(model_dir, kv_transfer_config=config, **CHUNKED) as llm:  # blocks saved chunk by chunk
        got = run(llm, PROMPTS[:1]) + run(llm, PROMPTS[1:2])  # one after the other
        stats = runner_of(llm).kv_connector.stats
    for g, w in zip(got, reference["prompts"][:2]):
        assert_same(g, w)
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= bound
    assert len(files(tmp_path)) == 5 and stats["evicted"] == stats["blocks_saved"] - 5
    # The least recently saved go first: what is left is PROMPTS[1]'s last blocks.
    assert {p.name for p in files(tmp_path)} == {file_of(tmp_path, PROMPTS[1], j).name
                                                 for j in range(RESTORABLE - 5, RESTORABLE)}


# ---- the file format, without an engine ------------------------------------------------


def meta_for(payload: int, fingerprint="ab" * 32, block_hash="cd" * 32) -> BlockMeta:
    return BlockMeta(fingerprint, block_hash, 16, payload)


def blocks(rng):
    return [rng.standard_normal((16, 3, 64)).astype(np.float32) for _ in range(4)]


def test_round_trip_and_checksum(tmp_path, rng):
    arrays = blocks(rng)
    meta = meta_for(sum(a.nbytes for a in arrays))
    path = tmp_path / "b.kvblock"
    size = block_file.write_block_file(path, meta, arrays, tmp_id=1)
    assert path.stat().st_size == size and not list(tmp_path.glob("*.tmp-*"))
    raw = path.read_bytes()
    header = block_file.HEADER.unpack(raw[:block_file.HEADER.size])
    assert header[0] == block_file.MAGIC and header[1] == block_file.FORMAT_VERSION
    assert header[4] == zlib.crc32(b"".join(a.tobytes() for a in arrays))  # independent crc
    out = [np.zeros_like(a) for a in arrays]
    block_file.read_block_file(path, meta, out)
    assert all(np.array_equal(o, a) for o, a in zip(out, arrays))

    data = bytearray(raw)
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    block_file.check_header(path, meta)  # the header alone cannot see it
    with pytest.raises(BlockFileError, match="checksum"):
        block_file.read_block_file(path, meta, [np.zeros_like(a) for a in arrays])


@pytest.mark.parametrize("damage,match", [
    (lambda raw: raw[:-1], "file is .* bytes"),
    (lambda raw: raw[:10], "shorter than the header"),
    (lambda raw: b"", "shorter than the header"),
    (lambda raw: b"X" + raw[1:], "bad magic"),
    (lambda raw: raw[:40] + bytes([raw[40] ^ 1]) + raw[41:], "metadata is truncated or corrupt"),
])
def test_damaged_headers_are_refused(tmp_path, rng, damage, match):
    arrays = blocks(rng)
    meta = meta_for(sum(a.nbytes for a in arrays))
    path = tmp_path / "b.kvblock"
    block_file.write_block_file(path, meta, arrays, tmp_id=1)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(BlockFileError, match=match):
        block_file.check_header(path, meta)


@pytest.mark.parametrize("field", ["fingerprint", "block_hash", "num_tokens", "payload_bytes"])
def test_mismatched_meta_is_refused(tmp_path, rng, field):
    arrays = blocks(rng)
    meta = meta_for(sum(a.nbytes for a in arrays))
    path = tmp_path / "b.kvblock"
    block_file.write_block_file(path, meta, arrays, tmp_id=1)
    other = dict(fingerprint="00" * 32, block_hash="11" * 32, num_tokens=32, payload_bytes=1)[field]
    with pytest.raises(BlockFileError, match=field):
        block_file.check_header(path, BlockMeta(**{**meta.__dict__, field: other}))


def test_short_vectored_writes_are_resumed(tmp_path, rng, monkeypatch):
    arrays = blocks(rng)
    meta = meta_for(sum(a.nbytes for a in arrays))
    real = os.writev

    def at_most_1000_bytes(fd, buffers):  # a write may take any prefix of the buffers
        data = b"".join(bytes(b) for b in buffers)[:1000]
        return real(fd, [data])

    monkeypatch.setattr(os, "writev", at_most_1000_bytes)
    path = tmp_path / "b.kvblock"
    block_file.write_block_file(path, meta, arrays, tmp_id=1)
    monkeypatch.setattr(os, "writev", real)
    out = [np.zeros_like(a) for a in arrays]
    block_file.read_block_file(path, meta, out)
    assert all(np.array_equal(o, a) for o, a in zip(out, arrays))


def test_failed_write_leaves_nothing(tmp_path, rng):
    arrays = blocks(rng)
    meta = meta_for(sum(a.nbytes for a in arrays))

    def dies_midway():
        yield arrays[0]
        yield arrays[1]
        raise OSError(errno.EIO, "injected")

    path = tmp_path / "b.kvblock"
    with pytest.raises(OSError, match="injected"):
        block_file.write_block_file(path, meta, dies_midway(), tmp_id=1)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(BlockFileError, match="expected"):  # short payload: byte count checked
        block_file.write_block_file(path, meta, arrays[:3], tmp_id=2)
    assert list(tmp_path.iterdir()) == []


KILLED_WRITER = """
import os, signal, sys
import numpy as np
from vllm_metal.native import ops
from vllm_metal.kv import block_file
arrays = [np.full((16, 3, 64), i, np.float32) for i in range(4)]
def chunks():
    yield arrays[0]
    yield arrays[1]
    os.kill(os.getpid(), signal.SIGKILL)  # the process dies mid-file
    yield arrays[2]
block_file.write_block_file(sys.argv[1], block_file.BlockMeta("ab" * 32, "cd" * 32, 16, 4 * arrays[0].nbytes),
                            chunks(), tmp_id=1)
"""


def test_killed_writer_never_leaves_a_final_file(tmp_path):
    path = tmp_path / "b.kvblock"
    out = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(path)], capture_output=True, timeout=120,
                         env=dict(os.environ, VLLM_METAL_BLAS="reference"))
    assert out.returncode == -9, out.stderr
    assert not path.exists(), "the final name must never hold a partial file"
    leftovers = list(tmp_path.glob("b.kvblock.tmp-*"))
    assert len(leftovers) == 1 and leftovers[0].stat().st_size > 0
    assert block_file.remove_stale_tmp(tmp_path) == [leftovers[0].name]
    assert list(tmp_path.iterdir()) == []


def test_live_writers_temp_files_are_kept(tmp_path):
    mine = tmp_path / f"a.kvblock.tmp-{os.getppid()}-1"  # a live process (the parent)
    mine.write_bytes(b"x")
    assert block_file.remove_stale_tmp(tmp_path) == [] and mine.exists()


def test_fingerprint_names_model_dtype_block_size_and_layout(model_dir):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec

    from vllm_metal.kv.layout import cache_layout

    def layout(block_size=16, dtype=torch.float32, heads=3, spec=FullAttentionSpec, model=model_dir, window=None):
        extra = dict(sliding_window=window) if window else {}
        group = KVCacheGroupSpec([f"model.layers.{i}.self_attn" for i in range(2)],
                                 spec(block_size=block_size, num_kv_heads=heads, head_size=64, dtype=dtype,
                                      **extra))
        vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=model, revision=None, dtype=dtype))
        return cache_layout(vllm_config, SimpleNamespace(kv_cache_groups=[group]))

    base = layout()
    assert base.payload_bytes == 2 * 2 * 16 * 3 * 64 * 4
    assert layout(spec=MLAAttentionSpec).payload_bytes == 2 * 1 * 16 * 3 * 64 * 4  # one latent cache
    others = [layout(block_size=32), layout(dtype=torch.float16), layout(heads=4), layout(spec=MLAAttentionSpec),
              layout(model="/somewhere/else")]
    assert len({base.fingerprint} | {o.fingerprint for o in others}) == 1 + len(others)
    assert layout().fingerprint == base.fingerprint
    with pytest.raises(ValueError, match="sliding-window"):
        layout(window=128)


def test_gate_accepts_only_the_disk_connector(model_dir, tmp_path, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(Exception, match="asks for KV connectors"):
        EngineArgs(model=model_dir, max_model_len=512, kv_transfer_config={
            "kv_connector": "ExampleConnector", "kv_role": "kv_both"}).create_engine_config()
    config = EngineArgs(model=model_dir, max_model_len=512, kv_transfer_config={
        "kv_connector": "MetalDiskConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"path": str(tmp_path)}}).create_engine_config()
    kt = config.kv_transfer_config
    assert kt.kv_connector_module_path == "vllm_metal.kv.disk_connector"
    assert kt.kv_load_failure_policy == "recompute"
    # A step waits for its evaluation to report saves and failed loads: no async scheduling.
    assert config.scheduler_config.async_scheduling is False
    assert EngineArgs(model=model_dir, max_model_len=512).create_engine_config().scheduler_config.async_scheduling
    monkeypatch.setenv("VLLM_METAL_KV_DISK", str(tmp_path / "env"))
    monkeypatch.setenv("VLLM_METAL_KV_DISK_MAX_BYTES", "12345")
    kt = EngineArgs(model=model_dir, max_model_len=512).create_engine_config().kv_transfer_config
    assert kt.kv_connector == "MetalDiskConnector" and kt.kv_role == "kv_both"
    assert kt.kv_connector_extra_config == {"path": str(tmp_path / "env"), "max_bytes": 12345}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_byte_views_are_the_cache_memory(dtype):
    """Loads write and saves read the MLX cache through these views: they must
    be the array's own memory (no copy), for every cache dtype (numpy has no bfloat16)."""
    import mlx.core as mx

    from vllm_metal.kv.layout import byte_view

    cache = mx.zeros((4, 16, 3, 8), dtype=getattr(mx, dtype))
    mx.eval(cache)
    view = byte_view(cache)
    assert view.shape == (4, 16 * 3 * 8 * cache.itemsize) and view.flags.writeable
    one = np.asarray(mx.ones((16, 3, 8), dtype=getattr(mx, dtype)).view(mx.uint8))  # raw bytes of ones
    view[2] = one.reshape(-1)  # what a load does: bytes into block 2
    del view
    expected = np.zeros((4, 16, 3, 8), np.float32)
    expected[2] = 1
    assert np.array_equal(np.array(cache.astype(mx.float32)), expected)
