// Which of the instruction sets the CPU kernels are compiled for (CMakeLists
// add_cpu_kernel_variant) this CPU runs, detected once, and the pick of a
// kernel's build from it (x86-64 only: elsewhere every primitive's eval_cpu
// uses its generic build).
#pragma once

#include <cstdlib>
#include <cstring>

namespace vllm_metal::cpu {

enum class Isa { generic, avx2, avx512 };  // avx2: + FMA + F16C; avx512: F/VL/BW/DQ + avx2

// The best of them the CPU runs (detected once).
inline Isa host_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  static const Isa isa = [] {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
    return avx512 ? Isa::avx512 : avx2 ? Isa::avx2 : Isa::generic;
  }();
  return isa;
#else
  return Isa::generic;
#endif
}

// What the kernels run: host_isa() capped by VLLM_METAL_CPU_ISA ("generic",
// "avx2" or "avx512"; read once): an AVX-512 host then profiles the AVX2
// builds an AVX2-only host runs. A cap above what the CPU has changes nothing.
inline Isa best_isa() {
  static const Isa isa = [] {
    Isa best = host_isa();
    if (const char* cap = std::getenv("VLLM_METAL_CPU_ISA")) {
      if (std::strcmp(cap, "generic") == 0) {
        best = Isa::generic;
      } else if (std::strcmp(cap, "avx2") == 0 && best == Isa::avx512) {
        best = Isa::avx2;
      }
    }
    return best;
  }();
  return isa;
}

// The build of a kernel for this CPU, among its generic, AVX2 and AVX-512
// builds (pass the AVX2 build twice for a kernel without an AVX-512 one).
template <typename F>
F pick_variant(F generic, F avx2, F avx512) {
  switch (best_isa()) {
    case Isa::avx512:
      return avx512;
    case Isa::avx2:
      return avx2;
    default:
      return generic;
  }
}

inline const char* isa_name(Isa isa) {
  return isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "generic";
}

} // namespace vllm_metal::cpu
