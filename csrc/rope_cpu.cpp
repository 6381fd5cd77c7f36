// RoPE::eval_cpu: the CPU backend of the RoPE primitive; runs the kernel
// variant for this CPU's instruction set.
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "cpu/isa.h"
#include "cpu/rope_kernel.h"
#include "rope.h"

namespace vllm_metal {

namespace {

void (*select_rope_kernel())(const cpu::RopeArgs&) {
#if defined(__x86_64__) || defined(_M_X64)
  return cpu::pick_variant(&cpu::rope_generic, &cpu::rope_avx2, &cpu::rope_avx512);
#else
  return cpu::rope_generic;
#endif
}

} // namespace

void RoPE::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  static const auto kernel = select_rope_kernel();
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_input_array(inputs[1]);
  encoder.set_output_array(out);
  const auto dtype = out.dtype() == mx::float32 ? cpu::KernelDtype::float32
      : out.dtype() == mx::float16             ? cpu::KernelDtype::float16
                                               : cpu::KernelDtype::bfloat16;
  cpu::RopeArgs args{dtype, nullptr, nullptr, nullptr, out.shape(0), static_cast<int>(out.shape(1)),
                     static_cast<int>(out.shape(2)), static_cast<int>(2 * inputs[1].shape(1)), traditional_};
  encoder.dispatch([x = inputs[0], table = inputs[1], out, args]() mutable {
    args.x = x.data<void>();
    args.table = table.data<float>();
    args.out = out.data<void>();
    args.tokens = out.shape(0);
    if (args.tokens > 0) {
      kernel(args);
    }
  });
}

} // namespace vllm_metal
