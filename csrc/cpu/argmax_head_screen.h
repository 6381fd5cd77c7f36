// The screened greedy head: the same argmax as the ArgmaxHead kernel (every
// bit: the tokens it would pick), found by screening the vocabulary with a
// bfloat16 copy of the head first and computing exact float32 logits only for
// the few tokens the screen cannot rule out.
//
// The screen: the head and each call's hidden rows rounded to bfloat16 (to
// nearest, relative error <= 2^-9 each), their products summed in float32 by
// VDPBF16PS (AVX-512 BF16: two products a lane, sixteen tokens a vector: twice
// the float32 FMA's work a vector, half the bytes streamed). With real
// arithmetic |h.w - h'.w'| <= 2^-8 (1 + 2^-9) sum_k |h_k w_k| <= 2^-8 (1 + 2^-9)
// |h|_2 |w|_2 (Cauchy-Schwarz); the screen's own float32 sums and the
// ArgmaxHead kernel's float32 logit (K FMAs in k order) are each within
// K 2^-24 (1.01) sum_k |h_k w_k| of their real values. So every token's screen
// value x is within E = |h_r|_2 e_t + 2^-50 of its float32 logit, with
// e_t = (2^-8 + (K + 8) 2^-22) (1 + 2^-10) |w_t|_2 (built once; the 2^-50
// covers the bfloat16 product's flush of values below 2^-126, the slack the
// float rounding of E itself). A token t is a candidate for row r when x + E
// reaches the largest x - E over the vocabulary: the token with the largest
// float32 logit always is one. The candidates' float32 logits are then
// computed exactly as the ArgmaxHead kernel computes them (fma in k order
// from 0), in vocabulary order with strictly-greater replacing, so ties keep
// the first index. (An 8-bit screen was tried first: its worst-case bound
// grows with max|h| |w|_1, and a trained model's hidden rows have outlier
// channels 8-20x their RMS; on SmolLM2's head every token stayed a
// candidate. The bfloat16 bound is relative: ~2 candidates a row there.)
//
// Two builds of one kernel: AVX-512 BF16 (where the host has it and the
// kernels run their AVX-512 build) and AVX2 (where the kernels run their
// AVX2 build: an AVX2-only host, or VLLM_METAL_CPU_ISA=avx2); rows outside the screen's range (a non-finite value, or
// max|h| outside [2^-40, 2^40]) send the call to the exact kernel.
#pragma once

#include <cstdint>
#include <string>

namespace vllm_metal::cpu {

constexpr int64_t kScreenTile = 16;  // vocabulary rows per tile: one vector of float32 lanes
constexpr int64_t kScreenPair = 2;  // k values a lane sums per VDPBF16PS
constexpr int64_t kScreenMaxDim = 1 << 20;  // keeps (K + 8) 2^-22 of the bound small

inline int64_t screen_tiles(int64_t vocab) {
  return (vocab + kScreenTile - 1) / kScreenTile;
}
inline int64_t screen_pairs(int64_t dim) {
  return (dim + kScreenPair - 1) / kScreenPair;
}
// bfloat16 values of the screen's weight: [tiles][pairs][16 tokens][2 k], k
// past dim and tokens past vocab holding 0.
inline int64_t screen_weight_values(int64_t vocab, int64_t dim) {
  return screen_tiles(vocab) * screen_pairs(dim) * kScreenTile * kScreenPair;
}
// Floats of the per-token bound factors e_t: [tiles * 16] (0 past vocab).
inline int64_t screen_table_floats(int64_t vocab) {
  return screen_tiles(vocab) * kScreenTile;
}

// Builds the screen of weight [vocab, dim] (float32, row-contiguous) into wb
// (screen_weight_values bfloat16 bit patterns) and table
// (screen_table_floats). Returns an empty string, or why this weight cannot
// be screened (a non-finite value, a row with max|w| outside [2^-40, 2^40]
// other than all zeros, dim over kScreenMaxDim); then nothing is to be used.
std::string build_argmax_screen(const float* weight, int64_t vocab, int64_t dim, uint16_t* wb, float* table);

// The smallest float >= x (x >= 0, finite): the bound's factors and norms
// are rounded up, never down.
inline float float_at_least(double x) {
  float f = static_cast<float>(x);
  return static_cast<double>(f) < x ? __builtin_nextafterf(f, __builtin_inff()) : f;
}

// x rounded to bfloat16, to nearest even (x finite).
inline uint16_t to_bf16(float x) {
  uint32_t b;
  __builtin_memcpy(&b, &x, sizeof b);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// Whether this CPU runs the screened kernel: x86-64 whose kernels run their
// AVX-512 build with AVX-512 BF16, or their AVX2 build (an AVX-512 host
// without BF16 keeps the exact kernel: its AVX-512 FMAs against the AVX2
// screen's, not measured).
bool argmax_screen_available();
const char* argmax_screen_build();  // "avx512bf16", "avx2" or "" (unavailable)

struct ArgmaxScreenArgs {
  const float* hidden;  // [rows, dim]
  const float* weight;  // [vocab, dim]: the exact logits of the candidates
  const uint16_t* wb;  // build_argmax_screen's
  const float* table;  // build_argmax_screen's
  int32_t* out;  // [rows]
  int64_t rows;
  int64_t vocab;
  int64_t dim;
};

// The tokens into out; false (out untouched) when a hidden row is outside
// the screen's range: the caller runs the exact kernel. Only where
// argmax_screen_available(): the build for this CPU.
bool argmax_head_screened(const ArgmaxScreenArgs& args);
#if defined(__x86_64__) || defined(_M_X64)
bool argmax_head_screened_avx512bf16(const ArgmaxScreenArgs& args);
bool argmax_head_screened_avx2(const ArgmaxScreenArgs& args);
#endif

// Process-wide counts of the screened kernel's work: calls, rows screened,
// exact logits computed for them (the candidates), and calls declined
// (a row outside the range: the exact kernel ran).
struct ScreenCounters {
  int64_t calls, rows, exact, declined;
};
ScreenCounters argmax_screen_counters();
void count_screen_work(const ScreenCounters& add);  // the kernels' share

} // namespace vllm_metal::cpu
