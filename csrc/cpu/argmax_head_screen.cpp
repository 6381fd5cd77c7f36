// The screened greedy head's bfloat16 weight and per-token bound factors
// (argmax_head_screen.h), built once per head; whether this CPU runs the
// screened kernel, and which build; its counters. Host code, compiled once.
#include "cpu/argmax_head_screen.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <sstream>

#include "cpu/isa.h"

namespace vllm_metal::cpu {

std::string build_argmax_screen(const float* weight, int64_t vocab, int64_t dim, uint16_t* wb, float* table) {
  if (dim < 1 || dim > kScreenMaxDim) {
    std::ostringstream os;
    os << "hidden size " << dim << " is outside 1-" << kScreenMaxDim;
    return os.str();
  }
  const int64_t pairs = screen_pairs(dim);
  std::fill(wb, wb + screen_weight_values(vocab, dim), uint16_t{0});
  std::fill(table, table + screen_table_floats(vocab), 0.0f);
  // e_t (argmax_head_screen.h): 2^-8 for the two bfloat16 roundings, (K + 8)
  // 2^-22 for the screen's and the kernel's float32 sums (each <= 1.01 K
  // 2^-24) with room to spare, (1 + 2^-10) for rounding |w|_2 and E.
  const double factor =
      (std::ldexp(1.0, -8) + static_cast<double>(dim + 8) * std::ldexp(1.0, -22)) * (1.0 + std::ldexp(1.0, -10));
  for (int64_t t = 0; t < vocab; ++t) {
    const float* row = weight + t * dim;
    double maxabs = 0.0, sq = 0.0;
    for (int64_t k = 0; k < dim; ++k) {
      const double v = row[k];
      if (!std::isfinite(v)) {
        std::ostringstream os;
        os << "vocabulary row " << t << " has a non-finite value";
        return os.str();
      }
      maxabs = std::max(maxabs, std::fabs(v));
      sq += v * v;
    }
    if (maxabs == 0.0) {
      continue;  // bfloat16 zeros, e_t = 0: its logit is exactly 0
    }
    if (maxabs < std::ldexp(1.0, -40) || maxabs > std::ldexp(1.0, 40)) {
      std::ostringstream os;
      os << "vocabulary row " << t << " has max |w| = " << maxabs << ", outside [2^-40, 2^40]";
      return os.str();
    }
    const int64_t tile = t / kScreenTile, lane = t % kScreenTile;
    uint16_t* dst = wb + tile * pairs * kScreenTile * kScreenPair + lane * kScreenPair;
    for (int64_t k = 0; k < dim; ++k) {
      dst[(k / kScreenPair) * kScreenTile * kScreenPair + k % kScreenPair] = to_bf16(row[k]);
    }
    table[t] = float_at_least(std::sqrt(sq) * (1.0 + std::ldexp(1.0, -30)) * factor);
  }
  return {};
}

namespace {

bool bf16_build() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool ok = [] {
    __builtin_cpu_init();
    return best_isa() == Isa::avx512 && __builtin_cpu_supports("avx512bf16");
  }();
  return ok;
#else
  return false;
#endif
}

std::atomic<int64_t> g_calls{0}, g_rows{0}, g_exact{0}, g_declined{0};

} // namespace

bool argmax_screen_available() {
  return bf16_build() || best_isa() == Isa::avx2;
}

const char* argmax_screen_build() {
  return bf16_build() ? "avx512bf16" : best_isa() == Isa::avx2 ? "avx2" : "";
}

bool argmax_head_screened(const ArgmaxScreenArgs& args) {
#if defined(__x86_64__) || defined(_M_X64)
  return bf16_build() ? argmax_head_screened_avx512bf16(args) : argmax_head_screened_avx2(args);
#else
  return false;  // never called: argmax_screen_available() is false off x86-64
#endif
}

ScreenCounters argmax_screen_counters() {
  return {g_calls.load(), g_rows.load(), g_exact.load(), g_declined.load()};
}

void count_screen_work(const ScreenCounters& add) {
  g_calls.fetch_add(add.calls, std::memory_order_relaxed);
  g_rows.fetch_add(add.rows, std::memory_order_relaxed);
  g_exact.fetch_add(add.exact, std::memory_order_relaxed);
  g_declined.fetch_add(add.declined, std::memory_order_relaxed);
}

} // namespace vllm_metal::cpu
