// The executor's stand-in for GatedDelta::eval_gpu: the same launch plan
// (metal/gated_delta_plan.h), buffer slots, output allocations (the state
// output in the state input's memory when donated) and early return for
// empty outputs, with MLX's command encoder replaced by
// msl_rt::dispatch_threadgroups. Called from Python through ctypes.
//
// Inputs and outputs live in guarded buffers, so a kernel reading or writing
// outside them faults, and the outputs start as NaN bytes, so an output
// element the kernel does not write cannot go unnoticed.
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include "gated_delta_plan.h"
#include "msl_runtime.h"

using namespace vllm_metal;

namespace {

enum Dim { kBatch, kSteps, kKHeads, kVHeads, kKeyDim, kValueDim, kDims };
enum Input { kQ, kK, kV, kG, kBeta, kState, kMask, kInputs };

} // namespace

// dims: see Dim. inputs: q, k, v (row-contiguous, `itemsize` bytes each),
// g, beta, state (float32), mask (bool bytes, or null: no mask, q then sits
// in its slot as in eval_gpu). in_place: the state output is written into
// the state input's buffer (eval_gpu with a donated state). Writes y (T_in
// bytes) and the final state (float32) to y_out / state_out. info receives
// {grid x, y, z, threads per threadgroup, 1 if dispatched}. Returns 0, or 1
// with a message.
extern "C" int vm_gated_delta(
    const char* dtype_name, int itemsize, const int64_t* dims, const void* const* host_inputs,
    int in_place, int at_start, uint64_t seed, int workers, void* y_out, void* state_out,
    int64_t* info, char* error, uint64_t error_bytes) {
  try {
    GatedDeltaArgs args{};
    args.batch = int(dims[kBatch]);
    args.steps = int(dims[kSteps]);
    args.k_heads = int(dims[kKHeads]);
    args.v_heads = int(dims[kVHeads]);
    args.key_dim = int(dims[kKeyDim]);
    args.value_dim = int(dims[kValueDim]);
    args.has_mask = host_inputs[kMask] != nullptr ? 1 : 0;
    const GatedDeltaPlan plan = plan_gated_delta(args, dtype_name);
    info[0] = plan.grid[0];
    info[1] = plan.grid[1];
    info[2] = plan.grid[2];
    info[3] = plan.threads;
    info[4] = 0;

    const size_t B = args.batch, T = args.steps, Hk = args.k_heads, Hv = args.v_heads;
    const size_t Dk = args.key_dim, Dv = args.value_dim;
    const size_t bytes[kInputs] = {
        B * T * Hk * Dk * itemsize, B * T * Hk * Dk * itemsize, B * T * Hv * Dv * itemsize,
        B * T * Hv * 4,             B * T * Hv * 4,             B * Hv * Dv * Dk * 4,
        B * T};
    const size_t y_bytes = B * T * Hv * Dv * itemsize;
    const size_t state_bytes = bytes[kState];
    if (state_bytes == 0) {
      return 0;  // eval_gpu allocates and returns without a dispatch
    }

    std::vector<std::unique_ptr<msl_rt::GuardedBuffer>> guarded;
    void* buffers[10] = {};
    const int slots[kInputs] = {kGdQBuffer,    kGdKBuffer,     kGdVBuffer,   kGdGBuffer,
                                kGdBetaBuffer, kGdStateBuffer, kGdMaskBuffer};
    for (int i = 0; i < kInputs; ++i) {
      if (i == kMask && !args.has_mask) {
        continue;
      }
      guarded.push_back(std::make_unique<msl_rt::GuardedBuffer>(bytes[i], at_start != 0));
      std::memcpy(guarded.back()->data(), host_inputs[i], bytes[i]);
      buffers[slots[i]] = guarded.back()->data();
    }
    // As eval_gpu binds them: q in the mask slot without a mask; the state
    // input in the slot of an empty input (T == 0); the state output in y's
    // slot when y is empty.
    if (!args.has_mask) {
      buffers[kGdMaskBuffer] = buffers[kGdQBuffer];
    }
    for (int i = 0; i < kInputs; ++i) {
      if (bytes[i] == 0) {
        buffers[slots[i]] = buffers[kGdStateBuffer];
      }
    }
    msl_rt::GuardedBuffer args_buffer(sizeof(GatedDeltaArgs), at_start != 0);
    std::memcpy(args_buffer.data(), &plan.args, sizeof(GatedDeltaArgs));
    buffers[kGdArgsBuffer] = args_buffer.data();

    msl_rt::GuardedBuffer y(y_bytes, at_start != 0);
    std::memset(y.data(), 0xFF, y_bytes);
    std::unique_ptr<msl_rt::GuardedBuffer> own_state;
    if (in_place) {
      buffers[kGdStateOutBuffer] = buffers[kGdStateBuffer];
    } else {
      own_state = std::make_unique<msl_rt::GuardedBuffer>(state_bytes, at_start != 0);
      std::memset(own_state->data(), 0xFF, state_bytes);
      buffers[kGdStateOutBuffer] = own_state->data();
    }
    buffers[kGdYBuffer] = y_bytes > 0 ? y.data() : buffers[kGdStateOutBuffer];

    const msl_rt::LaunchOptions options{seed, workers};
    msl_rt::dispatch_threadgroups(plan.name, buffers, {plan.grid[0], plan.grid[1], plan.grid[2]},
                                  {plan.threads, 1, 1}, options);
    info[4] = 1;
    std::memcpy(y_out, y.data(), y_bytes);
    std::memcpy(state_out, buffers[kGdStateOutBuffer], state_bytes);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(error, error_bytes, "%s", e.what());
    return 1;
  }
}

// The kernel name eval_gpu asks MLX for.
extern "C" void vm_gated_delta_kernel_name(const char* dtype_name, int key_dim, char* out,
                                           uint64_t out_bytes) {
  std::snprintf(out, out_bytes, "%s", gated_delta_kernel_name(dtype_name, key_dim).c_str());
}
