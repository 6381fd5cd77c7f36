// RoPE::eval_cpu: the CPU backend of the RoPE primitive; runs the kernel
// variant for this CPU's instruction set.
#include "cpu/elementwise_op.h"
#include "cpu/kernel_dtype.h"
#include "cpu/rope_kernel.h"
#include "rope.h"

namespace vllm_metal {

void RoPE::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  static const auto kernel = VLLM_METAL_BEST_KERNEL(rope);
  auto& encoder = cpu::begin_elementwise(stream(), inputs, out);
  cpu::RopeArgs args{cpu::kernel_dtype(out.dtype()), nullptr, nullptr, nullptr, out.shape(0),
                     static_cast<int>(out.shape(1)), static_cast<int>(out.shape(2)),
                     static_cast<int>(2 * inputs[1].shape(1)), traditional_};
  encoder.dispatch([x = inputs[0], table = inputs[1], out, args]() mutable {
    args.x = x.data<void>();
    args.table = table.data<float>();
    args.out = out.data<void>();
    if (args.tokens > 0) {
      kernel(args);
    }
  });
}

} // namespace vllm_metal
