# Metal part of the build (included where MLX has Metal): embeds the kernel
# source into a generated header, so the extension carries its kernels and MLX
# compiles them at run time; regenerated whenever a file in metal/ changes.
#
# Sets VLLM_METAL_SOURCES (to add to the extension's sources) and
# VLLM_METAL_INCLUDE_DIRS (for the extension's include path).
set(_vllm_metal_dir "${CMAKE_CURRENT_SOURCE_DIR}/metal")
set(_vllm_metal_generated "${CMAKE_CURRENT_BINARY_DIR}/generated")
set(_vllm_metal_header "${_vllm_metal_generated}/paged_attention_metal_source.h")
file(GLOB _vllm_metal_inputs CONFIGURE_DEPENDS "${_vllm_metal_dir}/*.h" "${_vllm_metal_dir}/*.metal")

add_custom_command(
  OUTPUT "${_vllm_metal_header}"
  COMMAND "${CMAKE_COMMAND}" -E make_directory "${_vllm_metal_generated}"
  COMMAND "${CMAKE_COMMAND}"
          "-DINPUT=${_vllm_metal_dir}/paged_attention.metal"
          "-DOUTPUT=${_vllm_metal_header}"
          -DVARIABLE=kPagedAttentionMetalSource
          -P "${CMAKE_CURRENT_LIST_DIR}/embed_metal_source.cmake"
  DEPENDS ${_vllm_metal_inputs} "${CMAKE_CURRENT_LIST_DIR}/embed_metal_source.cmake"
  COMMENT "Embedding the Metal kernels (metal/paged_attention.metal)"
  VERBATIM)

set(VLLM_METAL_SOURCES "${_vllm_metal_header}" csrc/paged_attention_metal.cpp)
set(VLLM_METAL_INCLUDE_DIRS "${_vllm_metal_generated}" "${_vllm_metal_dir}")
