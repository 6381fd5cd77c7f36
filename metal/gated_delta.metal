// The Metal library of the gated-delta primitive: its one kernel,
// instantiated for every dtype and key-dim tier, in this one list.
//
// The build embeds this file, with its quoted includes inlined, into the
// extension (cmake/embed_metal_source.cmake) as kGatedDeltaMetalSource; MLX
// compiles it once per process at first use. The executor tests compile the
// very same embedded text. Keep it ASCII: MLX hands the source to Metal as an
// ASCII string.
#include "gated_delta_kernel.h"

#define instantiate_kernel(name, func, ...) \
  template [[host_name(name)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;

// Names: gated_delta_<dtype>_dk<Dk>, built the same way by
// vllm_metal::gated_delta_kernel_name in gated_delta_plan.h. Dk / 32 key dims
// per lane; any Dv (1..256) runs on every tier.
#define instantiate_tier(tname, type, dk) \
  instantiate_kernel("gated_delta_" #tname "_dk" #dk, gated_delta, type, (dk) / 32)

#define instantiate_dtype(tname, type) \
  instantiate_tier(tname, type, 32)    \
  instantiate_tier(tname, type, 64)    \
  instantiate_tier(tname, type, 128)   \
  instantiate_tier(tname, type, 256)

instantiate_dtype(float32, float)
instantiate_dtype(float16, half)
instantiate_dtype(bfloat16, bfloat)
