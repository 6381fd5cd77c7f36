// Small helpers shared by the ops and their backends: how an error message
// spells a shape, and the name a kernel library uses for a dtype.
#pragma once

#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
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

// dst (row-contiguous) = the 4-D array `src` in any layout, element by
// element (a whole memcpy when src is row-contiguous): a primitive's output
// that could not take its input's buffer starts as a copy of it.
inline void copy_4d_any_layout(const mx::array& src, void* dst) {
  const char* p = src.data<char>();
  char* out = static_cast<char*>(dst);
  const auto size = src.itemsize();
  if (src.flags().row_contiguous) {
    std::memcpy(out, p, src.nbytes());
    return;
  }
  const auto& st = src.strides();
  int64_t i = 0;
  for (int a = 0; a < src.shape(0); ++a)
    for (int b = 0; b < src.shape(1); ++b)
      for (int c = 0; c < src.shape(2); ++c)
        for (int d = 0; d < src.shape(3); ++d)
          std::memcpy(out + size * i++, p + size * (a * st[0] + b * st[1] + c * st[2] + d * st[3]), size);
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

// outputs[1] and outputs[2] (a primitive's updated key and value caches)
// take the buffers of inputs[first] and inputs[first + 1] where MLX lets
// them be donated (row-contiguous, nothing else holds them: written in
// place), else get fresh ones; copy[i] then says the task must first copy
// the input there (copy_4d_any_layout). `in_place` (an alias write): a
// row-contiguous input cache's buffer is taken even while something else
// holds it -- the caller's promise that every reader of the old contents
// precedes this write in stream order (layers sharing one vLLM KV-cache
// tensor: the earlier layer's attention feeds this layer's input).
inline void take_cache_buffers(const std::vector<mx::array>& inputs, int first, std::vector<mx::array>& outputs,
                               bool (&copy)[2], bool in_place = false) {
  for (int i = 0; i < 2; ++i) {
    const auto& in = inputs[first + i];
    copy[i] = !(in.flags().row_contiguous && (in_place || in.is_donatable()));
    if (copy[i]) {
      outputs[1 + i].set_data(mx::allocator::malloc(outputs[1 + i].nbytes()));
    } else {
      outputs[1 + i].copy_shared_buffer(in);
    }
  }
}

} // namespace vllm_metal
