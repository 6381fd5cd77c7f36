// Small helpers shared by the ops and their backends: how an error message
// spells a shape, and the name a kernel library uses for a dtype.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/array.h"

namespace vllm_metal {

namespace mx = mlx::core;

// "(2, 3)", "(4,)", "()"
inline std::string shape_str(const mx::array& a) {
  std::ostringstream os;
  os << "(";
  for (int i = 0; i < a.ndim(); ++i) {
    os << (i ? ", " : "") << a.shape(i);
  }
  os << (a.ndim() == 1 ? ",)" : ")");
  return os.str();
}

// The dtype part of a Metal kernel's name; `op` prefixes the error.
inline const char* kernel_dtype_name(mx::Dtype dtype, const char* op) {
  switch (dtype) {
    case mx::float32:
      return "float32";
    case mx::float16:
      return "float16";
    case mx::bfloat16:
      return "bfloat16";
    default:
      throw std::invalid_argument(std::string("[") + op + "] unsupported dtype for Metal");
  }
}

// MLX gives each output of a multi-output primitive its own copy of the
// inputs, so every input is referenced once per output and none could ever
// be donated. A backend that donates first calls this: the outputs whose
// copy is not `inputs` drop it now, as MLX would when it detaches the
// outputs after the eval (these primitives have no transforms that would
// read them later).
inline void release_sibling_inputs(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (auto& o : outputs) {
    if (&o.inputs() != &inputs) {
      o.inputs().clear();
    }
  }
}

} // namespace vllm_metal
