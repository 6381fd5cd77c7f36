// GELU::eval_cpu: the CPU backend of the GELU primitive; runs the kernel
// variant for this CPU's instruction set.
#include "cpu/elementwise_op.h"
#include "cpu/gelu_kernel.h"
#include "cpu/kernel_dtype.h"
#include "gelu.h"

namespace vllm_metal {

void GELU::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  static const auto kernel = VLLM_METAL_BEST_KERNEL(gelu);
  auto& encoder = cpu::begin_elementwise(stream(), inputs, out);
  const auto dtype = cpu::kernel_dtype(out.dtype());
  encoder.dispatch([x = inputs[0], out, dtype, approximate = approximate_]() mutable {
    kernel({dtype, x.data<void>(), out.data<void>(), static_cast<int64_t>(out.size()), approximate});
  });
}

} // namespace vllm_metal
