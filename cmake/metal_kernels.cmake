# Metal part of the build (included where MLX has Metal): embeds each kernel
# library's source into a generated header, so the extension carries its
# kernels and MLX compiles them at run time; regenerated whenever a file in
# metal/ changes.
#
#   metal/paged_attention.metal -> paged_attention_metal_source.h (kPagedAttentionMetalSource)
#   metal/gated_delta.metal     -> gated_delta_metal_source.h     (kGatedDeltaMetalSource)
#   metal/write_kv.metal        -> write_kv_metal_source.h        (kWriteKVMetalSource)
#
# Sets VLLM_METAL_SOURCES (to add to the extension's sources; the paged-
# attention header first) and VLLM_METAL_INCLUDE_DIRS (for the extension's
# include path).
set(_vllm_metal_dir "${CMAKE_CURRENT_SOURCE_DIR}/metal")
set(_vllm_metal_generated "${CMAKE_CURRENT_BINARY_DIR}/generated")
file(GLOB _vllm_metal_inputs CONFIGURE_DEPENDS "${_vllm_metal_dir}/*.h" "${_vllm_metal_dir}/*.metal")

# Adds a command generating `header` (in the generated dir) from
# metal/<source> as the raw string `variable`.
function(vllm_embed_metal_source source header variable)
  add_custom_command(
    OUTPUT "${_vllm_metal_generated}/${header}"
    COMMAND "${CMAKE_COMMAND}" -E make_directory "${_vllm_metal_generated}"
    COMMAND "${CMAKE_COMMAND}"
            "-DINPUT=${_vllm_metal_dir}/${source}"
            "-DOUTPUT=${_vllm_metal_generated}/${header}"
            "-DVARIABLE=${variable}"
            -P "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/embed_metal_source.cmake"
    DEPENDS ${_vllm_metal_inputs} "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/embed_metal_source.cmake"
    COMMENT "Embedding the Metal kernels (metal/${source})"
    VERBATIM)
endfunction()

vllm_embed_metal_source(paged_attention.metal paged_attention_metal_source.h
                        kPagedAttentionMetalSource)
vllm_embed_metal_source(gated_delta.metal gated_delta_metal_source.h kGatedDeltaMetalSource)
vllm_embed_metal_source(write_kv.metal write_kv_metal_source.h kWriteKVMetalSource)

set(VLLM_METAL_SOURCES
    "${_vllm_metal_generated}/paged_attention_metal_source.h"
    "${_vllm_metal_generated}/gated_delta_metal_source.h"
    "${_vllm_metal_generated}/write_kv_metal_source.h"
    csrc/paged_attention_metal.cpp
    csrc/gated_delta_metal.cpp
    csrc/rope_write_kv_metal.cpp)
set(VLLM_METAL_INCLUDE_DIRS "${_vllm_metal_generated}" "${_vllm_metal_dir}")
