// ArgmaxHead::eval_cpu: the CPU backend of the ArgmaxHead primitive; runs the
// kernel variant for this CPU's instruction set.
#include "argmax_head.h"
#include "cpu/argmax_head_kernel.h"
#include "cpu/elementwise_op.h"

namespace vllm_metal {

void ArgmaxHead::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  static const auto kernel = VLLM_METAL_BEST_KERNEL(argmax_head);
  auto& encoder = cpu::begin_elementwise(stream(), inputs, out);
  encoder.dispatch([h = inputs[0], w = inputs[1], out]() mutable {
    kernel({h.data<float>(), w.data<float>(), out.data<int32_t>(), static_cast<int64_t>(h.shape(0)),
            static_cast<int64_t>(w.shape(0)), static_cast<int64_t>(h.shape(1))});
  });
}

} // namespace vllm_metal
