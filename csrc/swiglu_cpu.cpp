// SwiGLU::eval_cpu: the CPU backend of the SwiGLU primitive; runs the kernel
// variant for this CPU's instruction set.
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "cpu/isa.h"
#include "cpu/swiglu_kernel.h"
#include "swiglu.h"

namespace vllm_metal {

namespace {

void (*select_swiglu_kernel())(const cpu::SwigluArgs&) {
#if defined(__x86_64__) || defined(_M_X64)
  return cpu::pick_variant(&cpu::swiglu_generic, &cpu::swiglu_avx2, &cpu::swiglu_avx512);
#else
  return cpu::swiglu_generic;
#endif
}

} // namespace

void SwiGLU::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  static const auto kernel = select_swiglu_kernel();
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_input_array(inputs[1]);
  encoder.set_output_array(out);
  const auto dtype = out.dtype() == mx::float32 ? cpu::KernelDtype::float32
      : out.dtype() == mx::float16             ? cpu::KernelDtype::float16
                                               : cpu::KernelDtype::bfloat16;
  encoder.dispatch([g = inputs[0], u = inputs[1], out, dtype]() mutable {
    kernel({dtype, g.data<void>(), u.data<void>(), out.data<void>(), static_cast<int64_t>(out.size())});
  });
}

} // namespace vllm_metal
