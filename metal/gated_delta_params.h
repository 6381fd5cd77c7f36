// The arguments of the gated-delta Metal kernels: one struct shared by the
// host (eval_gpu fills it and passes it with set_bytes) and the kernels.
// Compiled both as host C++ and as MSL, so it uses only what both accept.
// Every array is row-contiguous (the op makes it so): shapes suffice.
#pragma once

namespace vllm_metal {

// Buffer slots (the kernels spell them as literals in [[buffer(n)]]).
enum GatedDeltaBuffer : int {
  kGdArgsBuffer = 0,
  kGdQBuffer = 1,      // [B, T, Hk, Dk] T_in
  kGdKBuffer = 2,      // [B, T, Hk, Dk] T_in
  kGdVBuffer = 3,      // [B, T, Hv, Dv] T_in
  kGdGBuffer = 4,      // [B, T, Hv] float
  kGdBetaBuffer = 5,   // [B, T, Hv] float
  kGdStateBuffer = 6,  // [B, Hv, Dv, Dk] float (may be the same memory as kGdStateOutBuffer)
  kGdMaskBuffer = 7,   // [B, T] bool; q sits in the slot when has_mask == 0
  kGdYBuffer = 8,      // [B, T, Hv, Dv] T_in
  kGdStateOutBuffer = 9,
};

struct GatedDeltaArgs {
  int batch;     // B
  int steps;     // T
  int k_heads;   // Hk
  int v_heads;   // Hv
  int key_dim;   // Dk
  int value_dim; // Dv
  int has_mask;
  int pad_;
};

static_assert(sizeof(GatedDeltaArgs) == 8 * 4, "GatedDeltaArgs must have no padding");

} // namespace vllm_metal
