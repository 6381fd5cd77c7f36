// PagedAttention::eval_gpu for MLX builds with Metal: encodes the kernels of
// metal/ into MLX's command stream for the primitive's stream, so attention
// runs lazily inside the same command buffers as the rest of the graph.
//
// - The kernel source is embedded at build time (cmake/metal_kernels.cmake)
//   and compiled by Metal at first use, once per process, through MLX's
//   library cache; installing needs no Metal toolchain.
// - Which kernels run on what grid comes from paged_attention_plan.h, shared
//   with the executor tests that run these kernels on Linux: decode (plus a
//   reduce for long contexts) and prefill, each writing its own rows, decided
//   per row on the GPU.
// - Inputs are bound as they are (any strides: the kernels take them); the
//   output, and the partition scratch of long-context decode behind it, are
//   one allocation from MLX's allocator owned by the output array. Nothing is
//   an encoder temporary (see the invariant in paged_attention.h).
// - Bad block ids or lengths cannot raise here (the metadata is not on the
//   host when encoding); the kernels write NaN rows instead, without reading
//   out of bounds. The CPU backend raises for the same input.
#include <sstream>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/metal/device.h"
#include "mlx/backend/metal/utils.h"

#include "op_util.h"

#include "paged_attention.h"
#include "paged_attention_metal_source.h"  // generated: kPagedAttentionMetalSource
#include "paged_attention_plan.h"

namespace vllm_metal {

namespace {

// MLX caches compiled libraries by name for the life of the process.
constexpr const char* kLibraryName = "vllm_metal_paged_attention";

PagedAttentionArgs make_args(const std::vector<mx::array>& inputs,
                             const PagedAttentionParams& params) {
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  const auto& block_tables = inputs[3];
  PagedAttentionArgs args{};
  for (int i = 0; i < 3; ++i) args.q_strides[i] = q.strides(i);
  for (int i = 0; i < 4; ++i) args.k_strides[i] = k.strides(i);
  for (int i = 0; i < 4; ++i) args.v_strides[i] = v.strides(i);
  for (int i = 0; i < 2; ++i) args.block_table_strides[i] = block_tables.strides(i);
  args.seq_lens_stride = inputs[4].strides(0);
  args.cu_seqlens_q_stride = inputs[5].strides(0);
  args.num_tokens = q.shape(0);
  args.num_heads = q.shape(1);
  args.head_dim = q.shape(2);
  args.v_head_dim = params.v_head_dim;
  args.num_blocks = k.shape(0);
  args.block_size = k.shape(1);
  args.num_kv_heads = k.shape(2);
  args.num_seqs = inputs[4].shape(0);
  args.max_blocks_per_seq = block_tables.shape(1);
  args.scale = params.scale;
  args.sliding_window = params.sliding_window;
  args.softcap = params.softcap;
  args.causal = params.causal;
  args.has_sinks = PagedAttention::has_sinks(inputs) ? 1 : 0;
  args.sinks_stride = args.has_sinks ? inputs[PagedAttention::kSinksInput].strides(0) : 0;
  return args;
}

MTL::ComputePipelineState* get_pipeline(mx::metal::Device& device, const std::string& name) {
  MTL::Library* library = device.get_library(
      kLibraryName, [] { return std::string(kPagedAttentionMetalSource); });
  MTL::ComputePipelineState* pipeline = device.get_kernel(name, library);
  // The kernels split head dims and keys over 32-lane simdgroups.
  if (pipeline->threadExecutionWidth() != kSimdWidth) {
    std::ostringstream msg;
    msg << "[paged_attention] " << name << " needs a SIMD width of " << int(kSimdWidth)
        << ", this GPU has " << pipeline->threadExecutionWidth();
    throw std::runtime_error(msg.str());
  }
  return pipeline;
}

} // namespace

void PagedAttention::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const mx::Stream& s = stream();
  auto& device = mx::metal::device(s.device);
  const PagedAttentionPlan plan =
      plan_paged_attention(make_args(inputs, params_),
                           kernel_dtype(kernel_dtype_name(out.dtype(), "paged_attention"), params_.cache_format),
                           out.nbytes());

  // The output's buffer also holds the partition scratch (if any) after
  // plan.partials_offset: scratch that lives and dies with the output.
  out.set_data(mx::allocator::malloc(plan.total_bytes));
  if (out.size() == 0) {
    return;
  }

  auto& encoder = mx::metal::get_command_encoder(s);
  // Binds every slot a kernel may declare; bindings are redone per dispatch
  // so the encoder tracks each dispatch's reads and writes (it puts a memory
  // barrier before a dispatch that reads what an earlier one wrote, e.g. the
  // reduce reading the partials the decode kernel wrote into `out`).
  const auto encode = [&](const KernelLaunch& launch, bool reads_partials) {
    MTL::ComputePipelineState* pipeline = get_pipeline(device, launch.name);
    encoder.set_compute_pipeline_state(pipeline);
    encoder.set_bytes(plan.args, kArgsBuffer);
    const int slots[] = {kQBuffer, kKeyCacheBuffer, kValueCacheBuffer,
                         kBlockTablesBuffer, kSeqLensBuffer, kCuSeqlensQBuffer};
    for (int i = 0; i < 6; ++i) {
      // An empty input (no sequences, no blocks) is never read; some buffer
      // must still sit in the slot.
      encoder.set_input_array(inputs[i].size() > 0 ? inputs[i] : out, slots[i]);
    }
    // Without sinks the kernels never read the slot; q (not empty when out
    // is not) sits there.
    encoder.set_input_array(has_sinks(inputs) ? inputs[kSinksInput] : inputs[0], kSinksBuffer);
    const int64_t partials = plan.has_reduce ? int64_t(plan.partials_offset) : 0;
    if (reads_partials) {
      encoder.set_input_array(out, kPartialsBuffer, partials);
    }
    encoder.set_output_array(out, kOutBuffer);
    if (!reads_partials) {
      encoder.set_output_array(out, kPartialsBuffer, partials);
    }
    const MTL::Size group(launch.threads, 1, 1);
    mx::check_kernel_threadgroup_size(pipeline, group, launch.name);
    encoder.dispatch_threadgroups(
        MTL::Size(launch.grid[0], launch.grid[1], launch.grid[2]), group);
  };
  encode(plan.decode, false);
  if (plan.has_reduce) {
    encode(plan.reduce, true);
  }
  if (plan.has_prefill) {
    encode(plan.prefill, false);
  }
}

} // namespace vllm_metal
