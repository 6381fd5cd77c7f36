// RMSNorm::eval_cpu: the CPU backend of the RMSNorm primitive; runs the
// kernel variant for this CPU's instruction set.
#include "cpu/elementwise_op.h"
#include "cpu/kernel_dtype.h"
#include "cpu/rms_norm_kernel.h"
#include "rms_norm.h"

namespace vllm_metal {

void RMSNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  static const auto kernel = VLLM_METAL_BEST_KERNEL(rms_norm);
  auto& encoder = cpu::begin_elementwise(stream(), inputs, out);
  const auto dtype = cpu::kernel_dtype(out.dtype());
  const int dim = static_cast<int>(out.shape(-1));
  const int64_t rows = dim > 0 ? static_cast<int64_t>(out.size()) / dim : 0;
  const bool has_bias = inputs.size() > 2;
  encoder.dispatch([x = inputs[0], w = inputs[1], b = has_bias ? inputs[2] : inputs[1], has_bias, out,
                    dtype, dim, rows, eps = eps_, layer = layer_]() mutable {
    kernel({dtype, x.data<void>(), w.data<void>(), out.data<void>(), rows, dim, eps, layer,
            has_bias ? b.data<void>() : nullptr});
  });
}

} // namespace vllm_metal
