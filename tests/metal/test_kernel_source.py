"""The kernel source as the extension carries it: embedded by CMake with its
includes inlined, ASCII (MLX hands it to Metal as an ASCII string), rebuilt
when a file in metal/ changes, and instantiating every kernel name the host
can ask for."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import msl_build
from metal_tools import tool_missing

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


def test_every_kernel_the_host_asks_for_is_instantiated(executor):
    """Every key head dim the op accepts (1..576), each with value head dims
    at and around the tiers' edges (1..512)."""
    names = executor.kernel_names()
    for dtype in ("float32", "float16", "bfloat16"):
        for head_dim in range(1, 577):
            v_dims = {head_dim, 1, 32, 33, 256, 257, 512} - set(range(513, 577))
            for v_head_dim in v_dims:
                for kind in ("decode", "prefill", "reduce"):
                    name = executor.host_kernel_name(kind, dtype, head_dim, v_head_dim)
                    assert name in names, (
                        f"eval_gpu would ask for {name}, which is not instantiated")


CMAKE_PROJECT = """
cmake_minimum_required(VERSION 3.24)
project(embed_check LANGUAGES CXX)
include(cmake/metal_kernels.cmake)
list(GET VLLM_METAL_SOURCES 0 header)
add_executable(print_source print_source.cpp "${header}")
target_include_directories(print_source PRIVATE ${VLLM_METAL_INCLUDE_DIRS})
set_target_properties(print_source PROPERTIES CXX_STANDARD 17)
"""
PRINTER = """
#include <cstdio>
#include "paged_attention_metal_source.h"
int main() { std::fputs(vllm_metal::kPagedAttentionMetalSource, stdout); }
"""


def test_cmake_embeds_and_regenerates_on_change(tmp_path, embedded):
    """The build's own CMake code (cmake/metal_kernels.cmake) in a small
    project: the compiled-in string is the embedded source, and editing a
    file in metal/ regenerates it."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        tool_missing("no C++ compiler")
    project = tmp_path / "project"
    shutil.copytree(REPO / "metal", project / "metal")
    shutil.copytree(REPO / "cmake", project / "cmake")
    (project / "CMakeLists.txt").write_text(CMAKE_PROJECT)
    (project / "print_source.cpp").write_text(PRINTER)
    cmake = msl_build.find_cmake()
    build = tmp_path / "build"

    def build_and_print() -> str:
        for cmd in ([cmake, "-S", str(project), "-B", str(build), f"-DCMAKE_CXX_COMPILER={cxx}"],
                    [cmake, "--build", str(build)]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            assert done.returncode == 0, done.stdout + done.stderr
        return subprocess.run([str(build / "print_source")], capture_output=True,
                              text=True, check=True).stdout

    assert build_and_print() == embedded
    tuning = project / "metal" / "paged_attention_tuning.h"
    tuning.write_text(tuning.read_text() + "// edited\n")
    assert "// edited" in build_and_print()
