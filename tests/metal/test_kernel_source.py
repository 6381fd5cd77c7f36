"""The kernel source as the extension carries it: embedded by CMake with its
includes inlined, ASCII (MLX hands it to Metal as an ASCII string), rebuilt
when a file in metal/ changes, and instantiating every kernel name the host
can ask for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import msl_build
from metal_tools import embedding_project, tool_missing

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory) -> str:
    try:
        return msl_build.embedded_metal_source(tmp_path_factory.mktemp("embed"))
    except msl_build.ExecutorUnavailable as e:
        tool_missing(str(e))


def test_embedded_source_is_self_contained_ascii(embedded):
    embedded.encode("ascii")  # raises on anything else
    assert '#include "' not in embedded, "quoted includes must be inlined"
    assert "#pragma once" not in embedded
    for header in sorted((REPO / "metal").glob("paged_attention_*.h")):
        # (gated_delta_*.h: another library, test_gated_delta_executor.py)
        if header.name == "paged_attention_plan.h":  # host-only
            assert f'#line 1 "{header.name}"' not in embedded
            continue
        # Each kernel-side header once, with a #line for Metal's diagnostics.
        assert embedded.count(f'#line 1 "{header.name}"') == 1, header.name
    for kernel in ("paged_attention_decode", "paged_attention_prefill", "paged_attention_reduce"):
        assert re.search(rf"\[\[kernel\]\] void {kernel}\(", embedded), kernel
    # Host-only parts of the shared headers stay out of what Metal compiles.
    assert "kDecodeShapeTable" in embedded  # (present, but behind the guard:)
    guarded = embedded[embedded.index("#ifndef __METAL_VERSION__\n// ---- Host only"):]
    assert guarded.index("kDecodeShapeTable") < guarded.index("#endif  // __METAL_VERSION__")


def test_every_kernel_the_host_asks_for_is_instantiated(executor):
    """Every key head dim the op accepts (1..576), each with value head dims
    at and around the tiers' edges (1..512); decode per head and grouped
    (the tier's width, which the shape-class table may name)."""
    names = executor.kernel_names()
    for dtype in ("float32", "float16", "bfloat16"):
        for head_dim in range(1, 577):
            v_dims = {head_dim, 1, 32, 33, 256, 257, 512} - set(range(513, 577))
            for v_head_dim in v_dims:
                for kind in ("decode", "decode_grouped", "prefill", "reduce"):
                    name = executor.host_kernel_name(kind, dtype, head_dim, v_head_dim)
                    assert name in names, (
                        f"eval_gpu would ask for {name}, which is not instantiated")


def test_cmake_embeds_and_regenerates_on_change(tmp_path, embedded):
    """The build's own CMake code (cmake/metal_kernels.cmake) in a small
    project: the compiled-in string is the embedded source, and editing a
    file in metal/ regenerates it."""
    project, build_and_print = embedding_project(tmp_path, 0, "paged_attention_metal_source.h",
                                                 "kPagedAttentionMetalSource")
    assert build_and_print() == embedded
    tuning = project / "metal" / "paged_attention_tuning.h"
    tuning.write_text(tuning.read_text() + "// edited\n")
    assert "// edited" in build_and_print()


def test_write_kv_library_is_self_contained_ascii(tmp_path):
    """The KV-cache write's library (metal/write_kv.metal): ASCII, its params
    header inlined once, the host-only plan left out, one kernel per dtype."""
    try:
        text = msl_build.embedded_metal_source(tmp_path, "write_kv")
    except msl_build.ExecutorUnavailable as e:
        tool_missing(str(e))
    text.encode("ascii")
    assert '#include "' not in text and "#pragma once" not in text
    assert text.count('#line 1 "write_kv_params.h"') == 1
    assert "write_kv_plan.h" not in text.replace("in write_kv_plan.h", "")
    for dtype in ("float32", "float16", "bfloat16"):
        assert f'"write_kv_{dtype}"' in text
