// ArgmaxHead::eval_cpu: the CPU backend of the ArgmaxHead primitive; runs the
// kernel variant for this CPU's instruction set, through the weight's screen
// where it came with one and the CPU runs the screened kernel.
#include "argmax_head.h"
#include "cpu/argmax_head_kernel.h"
#include "cpu/argmax_head_screen.h"
#include "cpu/elementwise_op.h"

namespace vllm_metal {

void ArgmaxHead::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  static const auto kernel = VLLM_METAL_BEST_KERNEL(argmax_head);
  auto& encoder = cpu::begin_elementwise(stream(), inputs, out);
  const bool screened = inputs.size() == 4 && cpu::argmax_screen_available();
  encoder.dispatch([inputs, out, screened]() mutable {
    const auto& h = inputs[0];
    const auto& w = inputs[1];
    const int64_t rows = h.shape(0), vocab = w.shape(0), dim = h.shape(1);
    if (screened && cpu::argmax_head_screened({h.data<float>(), w.data<float>(), inputs[2].data<uint16_t>(),
                                               inputs[3].data<float>(), out.data<int32_t>(), rows, vocab, dim})) {
      return;
    }
    kernel({h.data<float>(), w.data<float>(), out.data<int32_t>(), rows, vocab, dim});
  });
}

} // namespace vllm_metal
