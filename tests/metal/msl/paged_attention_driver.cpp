// The executor's stand-in for PagedAttention::eval_gpu: the same launch plan
// (metal/paged_attention_plan.h), buffer slots, single output allocation and
// dispatch order, with MLX's command encoder replaced by
// msl_rt::dispatch_threadgroups. Called from Python through ctypes.
//
// Inputs and the output allocation live in guarded buffers, so a kernel
// reading outside them faults, and the output allocation starts as NaN bytes,
// so an output element no kernel writes cannot go unnoticed.
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "msl_runtime.h"
#include "paged_attention_plan.h"

using namespace vllm_metal;

namespace {

enum Dim {
  kTokens, kHeads, kHeadDim, kBlocks, kBlockSize, kKvHeads, kSeqs, kMaxBlocks, kVHeadDim, kDims
};
enum Input { kQ, kK, kV, kBlockTables, kSeqLens, kCuSeqlensQ, kSinks, kInputs };

PlanOverrides plan_overrides(const int* overrides) {
  PlanOverrides o;
  o.partition_size = overrides[0];
  o.decode_heads = overrides[1];
  o.decode_simdgroups = overrides[2];
  o.decode_tokens = overrides[3];
  return o;
}

// info: {1 if the prefill kernel is dispatched (after decode), decode
// partitions, table row, head-dim class, query class, batch class, decode
// heads per threadgroup (the most), decode chunks per KV head, decode
// threads, decode grid x, y, z, decode tokens per threadgroup (the most)}.
constexpr int kPlanInfo = 13;

void plan_info(const PagedAttentionPlan& plan, int64_t* info, char* decode_name,
               uint64_t decode_name_bytes) {
  const int64_t values[kPlanInfo] = {
      plan.has_prefill ? 1 : 0,      plan.args.num_partitions,  plan.table_row,
      int64_t(plan.dims_class),      int64_t(plan.query_class), int64_t(plan.batch_class),
      plan.args.decode_heads,        plan.args.decode_chunks,   plan.decode.threads,
      plan.decode.grid[0],           plan.decode.grid[1],       plan.decode.grid[2],
      plan.args.decode_tokens};
  for (int i = 0; i < kPlanInfo; ++i) {
    info[i] = values[i];
  }
  std::snprintf(decode_name, decode_name_bytes, "%s", plan.decode.name.c_str());
}

} // namespace

// dims: see Dim. strides: q[3], k[4], v[4], block_tables[2], seq_lens,
// cu_seqlens_q, sinks (elements). Input i (see Input) is the view at element
// offsets[i] of the base buffer bases[i] (base_bytes[i] bytes); the sinks
// (float32) are read only when has_sinks, else q sits in their slot, as in
// eval_gpu. overrides: {partition size, decode heads per threadgroup, decode
// simdgroups, decode tokens per threadgroup}, 0 each for the plan's own
// choice (PlanOverrides). info
// receives kPlanInfo entries (see plan_info); decode_name the decode kernel's
// name. kernels: bit 0 runs decode (and reduce), bit 1 prefill; eval_gpu
// runs both (3), tests run one to see which rows each writes. Returns 0, or 1
// with a message.
extern "C" int vm_paged_attention(
    const char* dtype_name, int itemsize, const int64_t* dims, const int64_t* strides,
    void* const* bases, const uint64_t* base_bytes, const int64_t* offsets, float scale,
    int sliding_window, float softcap, int has_sinks, int causal, const int* overrides, int at_start,
    uint64_t seed, int workers, int kernels, void* out, int64_t* info, char* decode_name,
    uint64_t decode_name_bytes, char* error, uint64_t error_bytes) {
  try {
    PagedAttentionArgs args{};
    for (int i = 0; i < 3; ++i) args.q_strides[i] = strides[i];
    for (int i = 0; i < 4; ++i) args.k_strides[i] = strides[3 + i];
    for (int i = 0; i < 4; ++i) args.v_strides[i] = strides[7 + i];
    for (int i = 0; i < 2; ++i) args.block_table_strides[i] = strides[11 + i];
    args.seq_lens_stride = strides[13];
    args.cu_seqlens_q_stride = strides[14];
    args.sinks_stride = has_sinks ? strides[15] : 0;
    args.num_tokens = int(dims[kTokens]);
    args.num_heads = int(dims[kHeads]);
    args.head_dim = int(dims[kHeadDim]);
    args.v_head_dim = int(dims[kVHeadDim]);
    args.num_blocks = int(dims[kBlocks]);
    args.block_size = int(dims[kBlockSize]);
    args.num_kv_heads = int(dims[kKvHeads]);
    args.num_seqs = int(dims[kSeqs]);
    args.max_blocks_per_seq = int(dims[kMaxBlocks]);
    args.scale = scale;
    args.sliding_window = sliding_window;
    args.softcap = softcap;
    args.causal = causal != 0 ? 1 : 0;
    args.has_sinks = has_sinks != 0 ? 1 : 0;

    const size_t out_bytes = size_t(args.num_tokens) * args.num_heads * args.v_head_dim * itemsize;
    const PagedAttentionPlan plan =
        plan_paged_attention(args, dtype_name, out_bytes, plan_overrides(overrides));
    plan_info(plan, info, decode_name, decode_name_bytes);
    if (out_bytes == 0) {
      return 0;  // eval_gpu allocates and returns without a dispatch
    }

    std::vector<std::unique_ptr<msl_rt::GuardedBuffer>> inputs;
    void* buffers[10] = {};
    const int slots[kInputs] = {kQBuffer,       kKeyCacheBuffer,   kValueCacheBuffer,
                                kBlockTablesBuffer, kSeqLensBuffer, kCuSeqlensQBuffer,
                                kSinksBuffer};
    for (int i = 0; i < kInputs; ++i) {
      inputs.push_back(std::make_unique<msl_rt::GuardedBuffer>(base_bytes[i], at_start != 0));
      std::memcpy(inputs.back()->data(), bases[i], base_bytes[i]);
      // 8-bit float caches ("<dtype>_fp8e4m3" / "_fp8e5m2") hold one byte per element.
      const int cache_elem = std::strstr(dtype_name, "_fp8") != nullptr ? 1 : itemsize;
      const int elem = i == kQ ? itemsize : i <= kV ? cache_elem : int(sizeof(int32_t));  // (float32 sinks: 4)
      buffers[slots[i]] = inputs.back()->data() + offsets[i] * elem;
    }
    if (!has_sinks) {
      buffers[kSinksBuffer] = buffers[kQBuffer];
    }
    msl_rt::GuardedBuffer args_buffer(sizeof(PagedAttentionArgs), at_start != 0);
    std::memcpy(args_buffer.data(), &plan.args, sizeof(PagedAttentionArgs));
    buffers[kArgsBuffer] = args_buffer.data();

    msl_rt::GuardedBuffer allocation(plan.total_bytes, at_start != 0);
    std::memset(allocation.data(), 0xFF, plan.total_bytes);
    buffers[kOutBuffer] = allocation.data();
    buffers[kPartialsBuffer] =
        allocation.data() + (plan.has_reduce ? plan.partials_offset : 0);

    const msl_rt::LaunchOptions options{seed, workers};
    const auto launch = [&](const KernelLaunch& k) {
      msl_rt::dispatch_threadgroups(k.name, buffers, {k.grid[0], k.grid[1], k.grid[2]},
                                    {k.threads, 1, 1}, options);
    };
    if (kernels & 1) {
      launch(plan.decode);
      if (plan.has_reduce) {
        launch(plan.reduce);
      }
    }
    if ((kernels & 2) && plan.has_prefill) {
      launch(plan.prefill);
    }
    std::memcpy(out, allocation.data(), out_bytes);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(error, error_bytes, "%s", e.what());
    return 1;
  }
}

// The kernel name eval_gpu asks MLX for (kind: decode, prefill or reduce;
// decode_grouped: the grouped decode kernel of the tier).
extern "C" void vm_kernel_name(const char* kind, const char* dtype_name, int head_dim,
                               int v_head_dim, char* out, uint64_t out_bytes) {
  std::string k = kind;
  if (k == "decode_grouped") {
    k = decode_kind(
        decode_group_heads(head_dim_class(head_dim_tier(head_dim, v_head_dim))));
  }
  std::snprintf(out, out_bytes, "%s",
                kernel_name(k.c_str(), dtype_name, head_dim, v_head_dim).c_str());
}

// The plan of a call from its shapes alone (dims: see Dim; contiguous
// strides), without running anything: info and decode_name as in
// vm_paged_attention. Returns 0, or 1 with a message.
extern "C" int vm_paged_attention_plan(const char* dtype_name, int itemsize,
                                       const int64_t* dims, const int* overrides,
                                       int64_t* info, char* decode_name,
                                       uint64_t decode_name_bytes, char* error,
                                       uint64_t error_bytes) {
  try {
    PagedAttentionArgs args{};
    args.num_tokens = int(dims[kTokens]);
    args.num_heads = int(dims[kHeads]);
    args.head_dim = int(dims[kHeadDim]);
    args.v_head_dim = int(dims[kVHeadDim]);
    args.num_blocks = int(dims[kBlocks]);
    args.block_size = int(dims[kBlockSize]);
    args.num_kv_heads = int(dims[kKvHeads]);
    args.num_seqs = int(dims[kSeqs]);
    args.max_blocks_per_seq = int(dims[kMaxBlocks]);
    args.scale = 1.0f;
    const size_t out_bytes = size_t(args.num_tokens) * args.num_heads * args.v_head_dim * itemsize;
    const PagedAttentionPlan plan =
        plan_paged_attention(args, dtype_name, out_bytes, plan_overrides(overrides));
    plan_info(plan, info, decode_name, decode_name_bytes);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(error, error_bytes, "%s", e.what());
    return 1;
  }
}

// Row i of kDecodeShapeTable: {head-dim class, query class, batch class,
// decode heads, decode simdgroups, partition, decode tokens}. Returns the
// number of rows.
extern "C" int vm_decode_shape_table(int i, int64_t* row) {
  if (i >= 0 && i < kDecodeShapeTableRows) {
    const DecodeShapeConfig& r = kDecodeShapeTable[i];
    const int64_t values[7] = {int64_t(r.dims),     int64_t(r.queries),   int64_t(r.batch),
                               r.decode_heads,      r.decode_simdgroups, r.partition ? 1 : 0,
                               r.decode_tokens};
    for (int j = 0; j < 7; ++j) {
      row[j] = values[j];
    }
  }
  return kDecodeShapeTableRows;
}
