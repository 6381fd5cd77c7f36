"""How tests/metal treats a missing tool (clang, cmake): a skip with the reason
on a developer's machine, a failure in CI (CI set), where setup installs it;
and a small CMake project around the build's own cmake/metal_kernels.cmake."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def tool_missing(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so this is a setup error, not a skip)")
    pytest.skip(reason)


REPO = Path(__file__).resolve().parents[2]

EMBED_PROJECT = """
cmake_minimum_required(VERSION 3.24)
project(embed_check LANGUAGES CXX)
include(cmake/metal_kernels.cmake)
list(GET VLLM_METAL_SOURCES {index} header)
add_executable(print_source print_source.cpp "${{header}}")
target_include_directories(print_source PRIVATE ${{VLLM_METAL_INCLUDE_DIRS}})
set_target_properties(print_source PROPERTIES CXX_STANDARD 17)
"""
EMBED_PRINTER = """
#include <cstdio>
#include "{header}"
int main() {{ std::fputs(vllm_metal::{variable}, stdout); }}
"""


def embedding_project(tmp_path: Path, index: int, header: str, variable: str):
    """A project (copies of metal/ and cmake/ under tmp_path/project) that
    prints the string cmake/metal_kernels.cmake embeds as `variable` (its
    generated `header`, VLLM_METAL_SOURCES[index]). Returns (project dir,
    build_and_print: configures, builds, runs, returns what it printed)."""
    import msl_build

    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        tool_missing("no C++ compiler")
    project = tmp_path / "project"
    shutil.copytree(REPO / "metal", project / "metal")
    shutil.copytree(REPO / "cmake", project / "cmake")
    (project / "CMakeLists.txt").write_text(EMBED_PROJECT.format(index=index))
    (project / "print_source.cpp").write_text(EMBED_PRINTER.format(header=header, variable=variable))
    cmake = msl_build.find_cmake()
    build = tmp_path / "build"

    def build_and_print() -> str:
        for cmd in ([cmake, "-S", str(project), "-B", str(build), f"-DCMAKE_CXX_COMPILER={cxx}"],
                    [cmake, "--build", str(build)]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            assert done.returncode == 0, done.stdout + done.stderr
        return subprocess.run([str(build / "print_source")], capture_output=True, text=True, check=True).stdout

    return project, build_and_print
