// The executor's stand-in for RopeWriteKV::eval_gpu's write-only form (a
// table of no pairs): the same launch plan (metal/write_kv_plan.h), buffer
// slots and cache outputs, with MLX's command encoder replaced by
// msl_rt::dispatch_threadgroups. Called from Python through ctypes.
//
// k and v are base buffers read through element strides (MLX's views); the
// caches sit in guarded buffers. in_place: the kernel writes into the input
// caches' own buffers (eval_gpu with in_place or a donated cache); else the
// outputs are fresh buffers that start as a copy of the inputs (eval_gpu's
// copy_gpu of a cache it may not take).
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "msl_runtime.h"
#include "write_kv_plan.h"

using namespace vllm_metal;

namespace {

enum Dim { kTokens, kHeads, kHeadDim, kNumBlocks, kBlockSize, kDims };

} // namespace

// dims: see Dim. k / v: base buffers of k_elems / v_elems elements
// (`itemsize` bytes each), read at the element strides k_strides / v_strides
// ([3] each). slots: int32 [tokens]. key_cache / value_cache: the caches
// (row-contiguous), updated with the result. info receives {grid x, y, z,
// threads per threadgroup, 1 if dispatched, 1 if the outputs were the
// inputs' buffers}. Returns 0, or 1 with a message.
extern "C" int vm_write_kv(
    const char* dtype_name, int itemsize, const int64_t* dims, const void* k, int64_t k_elems,
    const int64_t* k_strides, const void* v, int64_t v_elems, const int64_t* v_strides,
    const int32_t* slots, void* key_cache, void* value_cache, int in_place, int at_start,
    uint64_t seed, int workers, int64_t* info, char* error, uint64_t error_bytes) {
  try {
    WriteKVArgs args{};
    args.tokens = int(dims[kTokens]);
    args.heads = int(dims[kHeads]);
    args.head_dim = int(dims[kHeadDim]);
    args.num_slots = dims[kNumBlocks] * dims[kBlockSize];
    for (int i = 0; i < 3; ++i) {
      args.k_strides[i] = k_strides[i];
      args.v_strides[i] = v_strides[i];
    }
    const WriteKVPlan plan = plan_write_kv(args, dtype_name);
    info[0] = plan.grid[0];
    info[1] = plan.grid[1];
    info[2] = plan.grid[2];
    info[3] = plan.threads;
    info[4] = 0;
    info[5] = in_place ? 1 : 0;
    const size_t cache_bytes = size_t(args.num_slots) * size_t(plan.args.row) * itemsize;
    if (plan.grid[0] == 0 || plan.grid[1] == 0 || cache_bytes == 0) {
      return 0;  // eval_gpu takes or copies the caches and dispatches nothing
    }
    const bool start = at_start != 0;
    msl_rt::GuardedBuffer kb(size_t(k_elems) * itemsize, start), vb(size_t(v_elems) * itemsize, start);
    std::memcpy(kb.data(), k, size_t(k_elems) * itemsize);
    std::memcpy(vb.data(), v, size_t(v_elems) * itemsize);
    msl_rt::GuardedBuffer sb(size_t(args.tokens) * 4, start);
    std::memcpy(sb.data(), slots, size_t(args.tokens) * 4);
    // The input caches; with in_place they are also the outputs. Otherwise
    // the outputs are other buffers holding a copy (copy_gpu), and the input
    // caches must come out untouched.
    msl_rt::GuardedBuffer kc_in(cache_bytes, start), vc_in(cache_bytes, start);
    std::memcpy(kc_in.data(), key_cache, cache_bytes);
    std::memcpy(vc_in.data(), value_cache, cache_bytes);
    std::unique_ptr<msl_rt::GuardedBuffer> kc_out, vc_out;
    void* kc = kc_in.data();
    void* vc = vc_in.data();
    if (!in_place) {
      kc_out = std::make_unique<msl_rt::GuardedBuffer>(cache_bytes, start);
      vc_out = std::make_unique<msl_rt::GuardedBuffer>(cache_bytes, start);
      std::memcpy(kc_out->data(), kc_in.data(), cache_bytes);
      std::memcpy(vc_out->data(), vc_in.data(), cache_bytes);
      kc = kc_out->data();
      vc = vc_out->data();
    }
    msl_rt::GuardedBuffer args_buffer(sizeof(WriteKVArgs), start);
    std::memcpy(args_buffer.data(), &plan.args, sizeof(WriteKVArgs));
    void* buffers[6] = {};
    buffers[kWkvArgsBuffer] = args_buffer.data();
    buffers[kWkvKBuffer] = kb.data();
    buffers[kWkvVBuffer] = vb.data();
    buffers[kWkvSlotsBuffer] = sb.data();
    buffers[kWkvKeyCacheBuffer] = kc;
    buffers[kWkvValueCacheBuffer] = vc;
    const msl_rt::LaunchOptions options{seed, workers};
    msl_rt::dispatch_threadgroups(plan.name, buffers, {plan.grid[0], plan.grid[1], plan.grid[2]},
                                  {plan.threads, 1, 1}, options);
    info[4] = 1;
    if (!in_place && (std::memcmp(kc_in.data(), key_cache, cache_bytes) != 0 ||
                      std::memcmp(vc_in.data(), value_cache, cache_bytes) != 0)) {
      throw std::runtime_error("the kernel wrote into the input caches of a copying write");
    }
    std::memcpy(key_cache, kc, cache_bytes);
    std::memcpy(value_cache, vc, cache_bytes);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(error, error_bytes, "%s", e.what());
    return 1;
  }
}
