// GatedDelta::eval_gpu for MLX builds with Metal: encodes the gated-delta
// kernel of metal/ into MLX's command stream for the primitive's stream, so
// the recurrence runs lazily inside the same command buffers as the rest of
// the graph.
//
// - The kernel source is embedded at build time (cmake/metal_kernels.cmake)
//   and compiled by Metal at first use, once per process, through MLX's
//   library cache (its own library, apart from paged attention's).
// - Which kernel runs on what grid comes from gated_delta_plan.h, shared with
//   the executor tests that run the kernel on Linux.
// - Inputs arrive row-contiguous with g, beta and the state float32 (the op
//   makes them so). y gets its own allocation; the final state takes over the
//   input state's buffer when MLX lets the primitive donate it (the kernel
//   reads each state row before writing it), else its own allocation.
//   Nothing is an encoder temporary (see the invariant in gated_delta.h).
#include <sstream>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/metal/device.h"
#include "mlx/backend/metal/utils.h"

#include "op_util.h"

#include "gated_delta.h"
#include "gated_delta_metal_source.h"  // generated: kGatedDeltaMetalSource
#include "gated_delta_plan.h"

namespace vllm_metal {

namespace {

// MLX caches compiled libraries by name for the life of the process.
constexpr const char* kLibraryName = "vllm_metal_gated_delta";

MTL::ComputePipelineState* get_pipeline(mx::metal::Device& device, const std::string& name) {
  MTL::Library* library = device.get_library(
      kLibraryName, [] { return std::string(kGatedDeltaMetalSource); });
  MTL::ComputePipelineState* pipeline = device.get_kernel(name, library);
  // One 32-lane simdgroup per state row, Dk / 32 key dims per lane.
  if (pipeline->threadExecutionWidth() != kGatedDeltaSimdWidth) {
    std::ostringstream msg;
    msg << "[gated_delta] " << name << " needs a SIMD width of " << kGatedDeltaSimdWidth
        << ", this GPU has " << pipeline->threadExecutionWidth();
    throw std::runtime_error(msg.str());
  }
  return pipeline;
}

} // namespace

void GatedDelta::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& y = outputs[0];
  auto& state_out = outputs[1];
  allocate_outputs(inputs, outputs);
  const auto& state_in = inputs[kStateInput];
  // An empty state means B * Hv * Dv == 0: y is empty too. With T == 0 (y
  // empty, state not) the kernel still runs, to copy the state.
  if (state_out.size() == 0) {
    return;
  }
  for (const auto& a : inputs) {
    if (!a.flags().row_contiguous) {
      throw std::logic_error("[gated_delta] eval_gpu expects row-contiguous inputs (the op's job)");
    }
  }

  const auto& q = inputs[0];
  const auto& v = inputs[2];
  GatedDeltaArgs args{};
  args.batch = q.shape(0);
  args.steps = q.shape(1);
  args.k_heads = q.shape(2);
  args.key_dim = q.shape(3);
  args.v_heads = v.shape(2);
  args.value_dim = v.shape(3);
  args.has_mask = has_mask(inputs) ? 1 : 0;
  const GatedDeltaPlan plan = plan_gated_delta(args, kernel_dtype_name(y.dtype(), "gated_delta"));

  const mx::Stream& s = stream();
  auto& device = mx::metal::device(s.device);
  auto& encoder = mx::metal::get_command_encoder(s);
  MTL::ComputePipelineState* pipeline = get_pipeline(device, plan.name);
  encoder.set_compute_pipeline_state(pipeline);
  encoder.set_bytes(plan.args, kGdArgsBuffer);
  // An empty input (T == 0) is never read; some buffer must still sit in the
  // slot: the state input (not empty here).
  const auto bound = [&](const mx::array& a) -> const mx::array& {
    return a.size() > 0 ? a : state_in;
  };
  const int slots[] = {kGdQBuffer, kGdKBuffer, kGdVBuffer,
                       kGdGBuffer, kGdBetaBuffer, kGdStateBuffer};
  for (int i = 0; i < 6; ++i) {
    encoder.set_input_array(bound(inputs[i]), slots[i]);
  }
  // Without a mask the kernel never reads the slot; q sits there.
  encoder.set_input_array(bound(has_mask(inputs) ? inputs[kMaskInput] : inputs[0]),
                          kGdMaskBuffer);
  // With T == 0, y is empty and never written; the state output fills the slot.
  encoder.set_output_array(y.size() > 0 ? y : state_out, kGdYBuffer);
  encoder.set_output_array(state_out, kGdStateOutBuffer);

  const MTL::Size group(plan.threads, 1, 1);
  mx::check_kernel_threadgroup_size(pipeline, group, plan.name);
  encoder.dispatch_threadgroups(MTL::Size(plan.grid[0], plan.grid[1], plan.grid[2]), group);
}

} // namespace vllm_metal
