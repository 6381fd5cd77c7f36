// GatedDelta::eval_cpu: the CPU backend of the gated-delta primitive. Takes
// over the input state's buffer for the final state when MLX allows it (the
// gathered states of a step are a temporary nobody else holds), so the
// recurrence runs in place, and runs the kernel variant for this CPU.
#include <cstring>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "cpu/gated_delta_kernel.h"
#include "cpu/isa.h"
#include "cpu/kernel_dtype.h"
#include "gated_delta.h"
#include "op_util.h"

namespace vllm_metal {

namespace {

void (*select_gated_delta_kernel())(const cpu::GatedDeltaKernelArgs&) {
#if defined(__x86_64__) || defined(_M_X64)
  // No AVX-512 build: its AVX2 build serves AVX-512 CPUs too.
  return cpu::pick_variant(&cpu::gated_delta_generic, &cpu::gated_delta_avx2, &cpu::gated_delta_avx2);
#else
  return cpu::gated_delta_generic;
#endif
}

} // namespace

void GatedDelta::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& y = outputs[0];
  auto& state_out = outputs[1];
  allocate_outputs(inputs, outputs);
  if (y.size() == 0 && state_out.size() == 0) {
    return;
  }
  static const auto kernel = select_gated_delta_kernel();
  const auto& q = inputs[0];
  const auto& v = inputs[2];
  cpu::GatedDeltaKernelArgs args{};
  args.dtype = cpu::kernel_dtype(y.dtype());
  args.batch = q.shape(0);
  args.steps = q.shape(1);
  args.k_heads = q.shape(2);
  args.key_dim = q.shape(3);
  args.v_heads = v.shape(2);
  args.value_dim = v.shape(3);

  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(y);
  encoder.set_output_array(state_out);
  encoder.dispatch([inputs, y, state_out, args]() mutable {
    args.q = inputs[0].data<void>();
    args.k = inputs[1].data<void>();
    args.v = inputs[2].data<void>();
    args.g = inputs[3].data<float>();
    args.beta = inputs[4].data<float>();
    // The recurrence runs on state_out: the donated input itself, or a copy
    // of the input state (any layout) made here.
    const auto& in = inputs[kStateInput];
    float* state = state_out.data<float>();
    if (in.data<float>() != state) {
      copy_4d_any_layout(in, state);
    }
    args.state_in = state;
    args.mask = has_mask(inputs) ? inputs[kMaskInput].data<bool>() : nullptr;
    args.y = y.data<void>();
    args.state_out = state_out.data<float>();
    kernel(args);
  });
}

} // namespace vllm_metal
