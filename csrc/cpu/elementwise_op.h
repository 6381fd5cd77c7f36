// The eval_cpu side shared by the element-wise primitives (SwiGLU, RMSNorm,
// RoPE): the kernel build for this CPU, and one output allocated and every
// input registered with the stream's CPU encoder. Host code, compiled once.
#pragma once

#include <vector>

#include "cpu/isa.h"
#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

// The build of kernel `name` (name_generic, name_avx2, name_avx512 in
// vllm_metal::cpu) this CPU runs.
#if defined(__x86_64__) || defined(_M_X64)
#define VLLM_METAL_BEST_KERNEL(name) \
  ::vllm_metal::cpu::pick_variant(   \
      &::vllm_metal::cpu::name##_generic, &::vllm_metal::cpu::name##_avx2, &::vllm_metal::cpu::name##_avx512)
#else
#define VLLM_METAL_BEST_KERNEL(name) (&::vllm_metal::cpu::name##_generic)
#endif

namespace vllm_metal::cpu {

// Allocates `out` and registers `inputs` and `out` with `stream`'s CPU
// encoder, which the caller then gives its kernel call (dispatch).
inline mlx::core::cpu::CommandEncoder& begin_elementwise(
    mlx::core::Stream stream, const std::vector<mlx::core::array>& inputs, mlx::core::array& out) {
  out.set_data(mlx::core::allocator::malloc(out.nbytes()));
  auto& encoder = mlx::core::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  return encoder;
}

} // namespace vllm_metal::cpu
