// RopeWriteKV::eval_gpu for MLX builds with Metal: the write-only form (a
// table of no pairs, as vllm_metal.native.kv_writes.write_kv(...,
// in_place=True) builds it) encodes the KV-cache write kernel of
// metal/write_kv.metal into MLX's command stream; RoPE with a table still
// refuses (on the GPU the model's RoPE is MLX's fused mx.fast.rope).
//
// - The caches: each output takes the input cache's buffer
//   (copy_shared_buffer) when it is row-contiguous and in_place is set or
//   MLX lets the primitive donate it; otherwise the output starts as a copy
//   of the input (copy_gpu, encoded before the kernel), as MLX's scatter
//   would. The kernel then writes only the step's slots' rows.
// - The rotated-q output (nothing rotated) shares q's buffer and layout.
// - Ordering. MLX's Metal encoder inserts a memory barrier before a dispatch
//   that binds, as an input, a buffer an earlier dispatch of the command
//   buffer wrote (set_input_array; set_output_array does the same check and
//   then records the buffer as written). So the caches are bound with both:
//   the write waits for the copy and for any earlier writer of the cache
//   buffers, and a later reader (paged attention) waits for this write.
//   An alias write (in_place) also overwrites a buffer that an earlier
//   layer's attention read (a layer of another vLLM cache group sharing the
//   KV tensor, models/kv_store.py); MLX does not track that write-after-read
//   hazard, and needs not: this write's k and v depend, through the
//   residual stream, on that layer's attention output, so a chain of
//   barriers (each ordering every earlier dispatch before every later one)
//   has finished that attention before this kernel starts.
// - Nothing is an encoder temporary.
#include <sstream>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/gpu/copy.h"
#include "mlx/backend/metal/device.h"
#include "mlx/backend/metal/utils.h"

#include "op_util.h"
#include "rope_write_kv.h"
#include "write_kv_metal_source.h"  // generated: kWriteKVMetalSource
#include "write_kv_plan.h"

namespace vllm_metal {

namespace {

// MLX caches compiled libraries by name for the life of the process.
constexpr const char* kLibraryName = "vllm_metal_write_kv";

MTL::ComputePipelineState* get_pipeline(mx::metal::Device& device, const std::string& name) {
  MTL::Library* library = device.get_library(kLibraryName, [] { return std::string(kWriteKVMetalSource); });
  return device.get_kernel(name, library);
}

} // namespace

void RopeWriteKV::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& table = inputs[kTable];
  if (table.shape(1) != 0) {
    throw std::runtime_error(
        "[rope_write_kv] on the GPU the RopeWriteKV primitive only writes the caches (a table of no "
        "pairs); for RoPE call the model's RoPE module (MLX's fused mx.fast.rope) and "
        "vllm_metal.native.ops.write_kv");
  }
  const mx::Stream& s = stream();
  release_sibling_inputs(inputs, outputs);
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  const auto& slots = inputs[kSlots];
  // Nothing rotated: the first output is q itself.
  outputs[0].copy_shared_buffer(q);
  for (int i = 0; i < 2; ++i) {
    const auto& in = inputs[kKeyCache + i];
    auto& out = outputs[1 + i];
    if (in.flags().row_contiguous && (in_place_ || in.is_donatable())) {
      out.copy_shared_buffer(in);
    } else {
      mx::copy_gpu(in, out, in.flags().row_contiguous ? mx::CopyType::Vector : mx::CopyType::General, s);
    }
  }
  auto& key_cache = outputs[1];
  auto& value_cache = outputs[2];

  WriteKVArgs args{};
  for (int i = 0; i < 3; ++i) {
    args.k_strides[i] = k.strides()[i];
    args.v_strides[i] = v.strides()[i];
  }
  args.num_slots = static_cast<int64_t>(key_cache.shape(0)) * key_cache.shape(1);
  args.tokens = k.shape(0);
  args.heads = k.shape(1);
  args.head_dim = k.shape(2);
  const WriteKVPlan plan = plan_write_kv(args, kernel_dtype_name(key_cache.dtype(), "rope_write_kv"));
  if (plan.grid[0] == 0 || plan.grid[1] == 0 || key_cache.size() == 0) {
    return;  // no token or an empty cache: nothing to write
  }

  auto& device = mx::metal::device(s.device);
  auto& encoder = mx::metal::get_command_encoder(s);
  MTL::ComputePipelineState* pipeline = get_pipeline(device, plan.name);
  encoder.set_compute_pipeline_state(pipeline);
  encoder.set_bytes(plan.args, kWkvArgsBuffer);
  encoder.set_input_array(k, kWkvKBuffer);
  encoder.set_input_array(v, kWkvVBuffer);
  encoder.set_input_array(slots, kWkvSlotsBuffer);
  // The caches as inputs (the hazard check against earlier writers of these
  // buffers, the copy above included) and as outputs (recorded as written,
  // so later readers wait for this kernel). See the ordering note above.
  encoder.set_input_array(inputs[kKeyCache], kWkvKeyCacheBuffer);
  encoder.set_input_array(inputs[kValueCache], kWkvValueCacheBuffer);
  encoder.set_output_array(key_cache, kWkvKeyCacheBuffer);
  encoder.set_output_array(value_cache, kWkvValueCacheBuffer);

  const MTL::Size group(plan.threads, 1, 1);
  mx::check_kernel_threadgroup_size(pipeline, group, plan.name);
  encoder.dispatch_threadgroups(MTL::Size(plan.grid[0], plan.grid[1], plan.grid[2]), group);
}

} // namespace vllm_metal
