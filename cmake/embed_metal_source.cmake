# Embeds a Metal source into a C++ header, so the extension carries its kernels
# and MLX compiles them at run time (installing needs no Metal toolchain).
#
#   cmake -DINPUT=metal/paged_attention.metal -DOUTPUT=<header> \
#         -DVARIABLE=kPagedAttentionMetalSource -P cmake/embed_metal_source.cmake
#
# The text of INPUT is written as one raw string literal, with its quoted
# includes inlined the way the preprocessor would (each file once; #pragma once
# dropped) because MLX compiles the source without include paths. #line
# directives keep Metal's error messages pointing at the original files.
# Angle includes (<metal_stdlib>) are left to the Metal compiler.
cmake_minimum_required(VERSION 3.24)

foreach(arg INPUT OUTPUT VARIABLE)
  if(NOT DEFINED ${arg})
    message(FATAL_ERROR "embed_metal_source.cmake: -D${arg}=... is required")
  endif()
endforeach()

set_property(GLOBAL PROPERTY EMBED_METAL_SEEN "")

# Sets out_var to the text of `path` with its quoted includes inlined.
function(embed_metal_inline path out_var)
  get_filename_component(dir "${path}" DIRECTORY)
  get_filename_component(file_name "${path}" NAME)
  file(READ "${path}" text)
  # Dropped, not deleted: the line stays so #line numbers remain right.
  string(REPLACE "#pragma once" "" text "${text}")
  set(result "")
  set(line 1)
  while(TRUE)
    string(REGEX MATCH "#include \"([^\"]+)\"[^\n]*\n?" directive "${text}")
    if(directive STREQUAL "")
      string(APPEND result "${text}")
      break()
    endif()
    set(name "${CMAKE_MATCH_1}")
    string(FIND "${text}" "${directive}" at)
    string(SUBSTRING "${text}" 0 ${at} before)
    string(LENGTH "${directive}" directive_length)
    math(EXPR rest_at "${at} + ${directive_length}")
    string(SUBSTRING "${text}" ${rest_at} -1 text)
    string(REGEX MATCHALL "\n" newlines "${before}")
    list(LENGTH newlines newline_count)
    math(EXPR line "${line} + ${newline_count} + 1")  # line after the directive
    string(APPEND result "${before}")

    get_filename_component(included "${dir}/${name}" ABSOLUTE)
    if(NOT EXISTS "${included}")
      message(FATAL_ERROR "${path}: included file ${name} not found next to it")
    endif()
    get_property(seen GLOBAL PROPERTY EMBED_METAL_SEEN)
    if(included IN_LIST seen)
      string(APPEND result "\n")
    else()
      set_property(GLOBAL APPEND PROPERTY EMBED_METAL_SEEN "${included}")
      embed_metal_inline("${included}" body)
      string(APPEND result "#line 1 \"${name}\"\n${body}\n#line ${line} \"${file_name}\"\n")
    endif()
  endwhile()
  set(${out_var} "${result}" PARENT_SCOPE)
endfunction()

get_filename_component(input "${INPUT}" ABSOLUTE)
set_property(GLOBAL APPEND PROPERTY EMBED_METAL_SEEN "${input}")
embed_metal_inline("${input}" source)

# MLX passes the source to Metal as an ASCII string.
string(REGEX MATCH "[^\t\n\r -~]" non_ascii "${source}")
if(NOT non_ascii STREQUAL "")
  message(FATAL_ERROR "${INPUT} (or a file it includes) has a non-ASCII or control character")
endif()
set(delimiter "vllm_msl")
string(FIND "${source}" ")${delimiter}\"" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${INPUT} contains the raw-string delimiter )${delimiter}\"")
endif()

get_filename_component(input_name "${INPUT}" NAME)
file(WRITE "${OUTPUT}.tmp"
"// Generated from ${input_name} by cmake/embed_metal_source.cmake; do not edit.
#pragma once

namespace vllm_metal {

inline constexpr const char* ${VARIABLE} = R\"${delimiter}(${source})${delimiter}\";

} // namespace vllm_metal
")
file(COPY_FILE "${OUTPUT}.tmp" "${OUTPUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUTPUT}.tmp")
