#!/usr/bin/env bash
# macOS compile check, runnable on Linux: syntax-checks the Metal-only C++
# (csrc/paged_attention_metal.cpp, csrc/gated_delta_metal.cpp and
# csrc/rope_write_kv_metal.cpp: eval_gpu and the Metal library loading)
# against the real MLX 0.32.4 macOS headers and metal-cpp, taken from PyPI's
# mlx-metal==0.32.4 macOS wheel, with stubs for the Apple system headers
# (tests/metal/apple_stubs). A misspelt or mistyped MLX/Metal API call fails it.
#
# It proves the code compiles against those headers; it cannot prove the code
# links or runs (no libmlx, no Metal): see docs/metal.md.
#
#   scripts/check_metal_compile.sh [source.cpp ...]
#
# Default sources: csrc/paged_attention_metal.cpp, csrc/gated_delta_metal.cpp,
# csrc/rope_write_kv_metal.cpp.
# Environment: PYTHON (with
# pip; default python3), CMAKE (default cmake), CXX (a clang++, needed for
# Objective-C block types in metal-cpp; default clang++-19 or clang++).
# Exit status: 0 compiles, 1 does not compile, 2 the wheel could not be
# downloaded (PyPI unreachable), 3 a tool is missing.
set -euo pipefail

MLX_VERSION=0.32.4
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
CMAKE=${CMAKE:-cmake}
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/vllm-metal/mlx-metal-${MLX_VERSION}-macos"
SOURCES=("$@")
if [ ${#SOURCES[@]} -eq 0 ]; then
  SOURCES=("$ROOT/csrc/paged_attention_metal.cpp" "$ROOT/csrc/gated_delta_metal.cpp"
           "$ROOT/csrc/rope_write_kv_metal.cpp")
fi

if [ -z "${CXX:-}" ]; then
  for c in clang++-19 clang++; do
    if command -v "$c" >/dev/null; then CXX=$c; break; fi
  done
fi
if [ -z "${CXX:-}" ] || ! command -v "$CXX" >/dev/null; then
  echo "check_metal_compile: needs clang++ (Debian: apt-get install clang-19)" >&2
  exit 3
fi
command -v "$CMAKE" >/dev/null || { echo "check_metal_compile: needs cmake" >&2; exit 3; }

# 1. The macOS headers, once: only mlx/include of the wheel is kept.
if [ ! -f "$CACHE/complete" ]; then
  download=$(mktemp -d)
  trap 'rm -rf "$download"' EXIT
  if ! "$PYTHON" -m pip download --quiet --no-deps --platform macosx_14_0_arm64 \
      --only-binary=:all: -d "$download" "mlx-metal==${MLX_VERSION}" >&2; then
    echo "check_metal_compile: cannot download mlx-metal==${MLX_VERSION} (PyPI unreachable?)" >&2
    exit 2
  fi
  rm -rf "$CACHE" && mkdir -p "$CACHE"
  "$PYTHON" - "$download" "$CACHE" <<'EOF'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("mlx_metal-*.whl"))
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith("mlx/include/"):
            z.extract(name, sys.argv[2])
EOF
  touch "$CACHE/complete"
fi
INCLUDE="$CACHE/mlx/include"

# 2. The embedded kernel source headers, exactly as the build generates them.
generated=$(mktemp -d)
trap 'rm -rf "$generated" "${download:-}"' EXIT
"$CMAKE" "-DINPUT=$ROOT/metal/paged_attention.metal" \
  "-DOUTPUT=$generated/paged_attention_metal_source.h" \
  -DVARIABLE=kPagedAttentionMetalSource -P "$ROOT/cmake/embed_metal_source.cmake"
"$CMAKE" "-DINPUT=$ROOT/metal/gated_delta.metal" \
  "-DOUTPUT=$generated/gated_delta_metal_source.h" \
  -DVARIABLE=kGatedDeltaMetalSource -P "$ROOT/cmake/embed_metal_source.cmake"
"$CMAKE" "-DINPUT=$ROOT/metal/write_kv.metal" \
  "-DOUTPUT=$generated/write_kv_metal_source.h" \
  -DVARIABLE=kWriteKVMetalSource -P "$ROOT/cmake/embed_metal_source.cmake"

# 3. Syntax-only, with the flags MLX's CMake package gives Metal builds. The MLX headers
# every Metal source includes are parsed once, into a precompiled header (3.5 -> 1 s a source);
# a source that lacks one of them gets it from there, so the list holds only what all include.
flags=(-std=c++20 -fblocks -D_METAL_ -DACCELERATE_NEW_LAPACK -isystem "$ROOT/tests/metal/apple_stubs"
       -I "$INCLUDE" -I "$INCLUDE/metal_cpp" -I "$ROOT/csrc" -I "$ROOT/metal" -I "$generated")
printf '#include <%s>\n' sstream stdexcept string mlx/allocator.h mlx/backend/metal/device.h \
  mlx/backend/metal/utils.h > "$generated/common.h"
"$CXX" "${flags[@]}" -x c++-header "$generated/common.h" -o "$generated/common.h.pch"
status=0
for src in "${SOURCES[@]}"; do
  if "$CXX" "${flags[@]}" -fsyntax-only -include-pch "$generated/common.h.pch" "$src"; then
    echo "check_metal_compile: OK   $src (MLX ${MLX_VERSION} macOS headers + metal-cpp)"
  else
    echo "check_metal_compile: FAIL $src" >&2
    status=1
  fi
done
exit $status
