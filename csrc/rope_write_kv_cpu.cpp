// RopeWriteKV::eval_cpu: the CPU backend of RoPE + KV write. Takes over each
// input cache's buffer when MLX allows it (nothing else holds it), so the
// step's rows are written in place, and runs the kernel variant for this
// CPU's instruction set.
#include "cpu/elementwise_op.h"
#include "cpu/kernel_dtype.h"
#include "cpu/rope_write_kv_kernel.h"
#include "op_util.h"
#include "rope_write_kv.h"

namespace vllm_metal {

namespace {

void set_strides(const mx::array& a, int64_t (&st)[3]) {
  for (int i = 0; i < 3; ++i) {
    st[i] = a.strides()[i];
  }
}

} // namespace

void RopeWriteKV::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  static const auto kernel = VLLM_METAL_BEST_KERNEL(rope_write_kv);
  release_sibling_inputs(inputs, outputs);
  auto& q_out = outputs[0];
  q_out.set_data(mx::allocator::malloc(q_out.nbytes()));
  bool copy[2] = {false, false};
  take_cache_buffers(inputs, kKeyCache, outputs, copy, in_place_);
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& kc = inputs[kKeyCache];
  cpu::RopeWriteKvArgs args{};
  args.dtype = cpu::kernel_dtype(q_out.dtype());
  set_strides(q, args.q_st);
  set_strides(k, args.k_st);
  set_strides(inputs[2], args.v_st);
  args.tokens = q.shape(0);
  args.num_slots = static_cast<int64_t>(kc.shape(0)) * kc.shape(1);
  args.heads = static_cast<int>(q.shape(1));
  args.kv_heads = static_cast<int>(k.shape(1));
  args.dim = static_cast<int>(q.shape(2));
  args.rotated = static_cast<int>(2 * inputs[kTable].shape(1));
  args.traditional = traditional_;

  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  for (auto& o : outputs) {
    encoder.set_output_array(o);
  }
  encoder.dispatch([inputs, outputs, args, copy0 = copy[0], copy1 = copy[1]]() mutable {
    if (copy0) copy_4d_any_layout(inputs[kKeyCache], outputs[1].data<void>());
    if (copy1) copy_4d_any_layout(inputs[kValueCache], outputs[2].data<void>());
    args.q = inputs[0].data<void>();
    args.k = inputs[1].data<void>();
    args.v = inputs[2].data<void>();
    args.table = inputs[kTable].data<float>();
    args.slots = inputs[kSlots].data<int32_t>();
    args.q_out = outputs[0].data<void>();
    args.key_cache = outputs[1].data<void>();
    args.value_cache = outputs[2].data<void>();
    if (args.tokens > 0) {
      kernel(args);
    }
  });
}

} // namespace vllm_metal
