// SwiGLU::eval_cpu: the CPU backend of the SwiGLU primitive; runs the kernel
// variant for this CPU's instruction set.
#include "cpu/elementwise_op.h"
#include "cpu/kernel_dtype.h"
#include "cpu/swiglu_kernel.h"
#include "swiglu.h"

namespace vllm_metal {

void SwiGLU::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  static const auto kernel = VLLM_METAL_BEST_KERNEL(swiglu);
  auto& encoder = cpu::begin_elementwise(stream(), inputs, out);
  const auto dtype = cpu::kernel_dtype(out.dtype());
  encoder.dispatch([g = inputs[0], u = inputs[1], out, dtype]() mutable {
    kernel({dtype, g.data<void>(), u.data<void>(), out.data<void>(), static_cast<int64_t>(out.size())});
  });
}

} // namespace vllm_metal
