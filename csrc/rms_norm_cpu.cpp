// RMSNorm::eval_cpu: the CPU backend of the RMSNorm primitive; runs the
// kernel variant for this CPU's instruction set.
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "cpu/isa.h"
#include "cpu/rms_norm_kernel.h"
#include "rms_norm.h"

namespace vllm_metal {

namespace {

void (*select_rms_norm_kernel())(const cpu::RmsNormArgs&) {
#if defined(__x86_64__) || defined(_M_X64)
  return cpu::pick_variant(&cpu::rms_norm_generic, &cpu::rms_norm_avx2, &cpu::rms_norm_avx512);
#else
  return cpu::rms_norm_generic;
#endif
}

} // namespace

void RMSNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  static const auto kernel = select_rms_norm_kernel();
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_input_array(inputs[1]);
  encoder.set_output_array(out);
  const auto dtype = out.dtype() == mx::float32 ? cpu::KernelDtype::float32
      : out.dtype() == mx::float16             ? cpu::KernelDtype::float16
                                               : cpu::KernelDtype::bfloat16;
  const int dim = static_cast<int>(out.shape(-1));
  const int64_t rows = dim > 0 ? static_cast<int64_t>(out.size()) / dim : 0;
  encoder.dispatch([x = inputs[0], w = inputs[1], out, dtype, dim, rows, eps = eps_]() mutable {
    kernel({dtype, x.data<void>(), w.data<void>(), out.data<void>(), rows, dim, eps});
  });
}

} // namespace vllm_metal
