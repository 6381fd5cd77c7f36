// How the CPU paged-attention kernel (paged_attention_kernel.cpp) reads the
// cache: a softmax step's keys, loaded once and transposed (head dim x keys,
// keys across the SIMD lanes) for up to `slots_` KV heads, block by block and
// each block's heads one after another (the rows in address order), their
// value rows as segments (read in place where the cache holds float32
// vectors, else converted into scratch), and the L2 prefetches that keep the
// stream ahead of the scoring. The step's geometry (chunk_, kp_, dvp_,
// slots_) is decided here too; CpuPagedAttention plans units and scores,
// reduces and writes their rows.
//
// Internal linkage (an unnamed namespace), like simd.h: the kernel is compiled
// once per instruction set into one library.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu/convert.h"
#include "cpu/paged_attention_blocks.h"
#include "cpu/paged_attention_kernel.h"
#include "cpu/paged_attention_scratch.h"
#include "cpu/simd.h"

namespace vllm_metal::cpu {
namespace {

inline int round_up(int n, int m) { return (n + m - 1) / m * m; }

// The transposed keys of the heads loaded together stay within this (L2).
constexpr int kSlotBytes = 128 << 10;

// C: what the caches hold (float32, half types or an 8-bit float).
template <typename C>
class StepLoader {
 protected:
  explicit StepLoader(const KernelArgs& a)
      : k_(static_cast<const C*>(a.key_cache)),
        v_(static_cast<const C*>(a.value_cache)),
        g_(a.geometry),
        dvp_(round_up(g_.v_head_dim, kLanes)),
        chunk_(g_.block_size % kLanes == 0 && g_.block_size < kChunkKeys && kChunkKeys % g_.block_size == 0
                   ? kChunkKeys
                   : g_.block_size),
        kp_(round_up(chunk_, kLanes) + kLanes),
        slots_(std::clamp(kSlotBytes / (g_.head_dim * kp_ * static_cast<int>(sizeof(float))), 1, kMaxSlots)) {}

  // L2 prefetch of `rows` cache rows of `width` elements, `stride` apart:
  // decode reads each block's rows of a head once, in pieces too short for
  // the hardware prefetchers. With the value rows of the step being scored
  // and the next block's key rows: decode over 30 layers' caches, batch 1
  // 5.0-6.0 -> 4.8-5.3 ms, batch 8 31-37 -> 27 ms (docs/benchmarks.md,
  // "Where the gap is"); an L1 hint measured no better.
  static void prefetch_rows(const C* first, int64_t stride, int rows, int width) {
    const int64_t bytes = width * static_cast<int64_t>(sizeof(C));
    for (int i = 0; i < rows; ++i) {
      const char* r = reinterpret_cast<const char*>(first + i * stride);
      for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(r + b, 0, 2);
      }
    }
  }

  // Loads keys [p0, p1) of one cache block transposed into sc.kt's lanes
  // from `col` (head_dim rows of kp_; the lanes up to the next multiple of 16
  // past them zero) and appends their value segment: the cache's own rows
  // where they are float32 vectors, else rows of dvp_ in sc.v from row `col`
  // (converted, zero past v_head_dim).
  void load_block(int block_id, int b0, int p0, int p1, int kv_head, int col, int slot, Scratch& sc) {
    const int D = g_.head_dim, Dv = g_.v_head_dim;
    const int n = p1 - p0;
    const float* rows[kLanes];
    for (int g0 = 0; g0 < n; g0 += kLanes) {
      for (int i = 0; i < kLanes; ++i) {
        const int p = p0 + g0 + i;
        if (g0 + i >= n) {
          rows[i] = sc.zeros.data();
          continue;
        }
        const int64_t k_off = block_id * g_.k_st[0] + (p - b0) * g_.k_st[1] + kv_head * g_.k_st[2];
        if constexpr (std::is_same_v<C, float>) {
          if (g_.k_st[3] == 1) {
            rows[i] = k_ + k_off;
            continue;
          }
        }
        float* staged = &sc.krows[static_cast<int64_t>(i) * D];
        load_row(k_ + k_off, g_.k_st[3], D, staged);
        rows[i] = staged;
      }
      transpose_keys(rows, D, kt_of(sc, slot) + col + g0, kp_);
    }
    const int64_t v_row0 = block_id * g_.v_st[0] + (p0 - b0) * g_.v_st[1] + kv_head * g_.v_st[2];
    // This head's value rows of these keys, into L2 while the step's keys
    // are transposed and scored: the accumulation reads them from memory
    // otherwise (perf put the step's stall on those loads).
    prefetch_rows(v_ + v_row0, g_.v_st[1], n, Dv);
    if constexpr (std::is_same_v<C, float>) {
      // Float32 rows of whole vectors are read in place: no copy.
      if (g_.v_st[3] == 1 && dvp_ == Dv) {
        sc.seg[slot][sc.nseg[slot]++] = {v_ + v_row0, g_.v_st[1], col, n};
        return;
      }
    }
    float* dst = &sc.v[(static_cast<int64_t>(slot) * (chunk_ + kLanes) + col) * dvp_];
    sc.seg[slot][sc.nseg[slot]++] = {dst, dvp_, col, n};
    for (int i = 0; i < n; ++i) {
      const int64_t v_off = v_row0 + i * g_.v_st[1];
      float* vr = dst + static_cast<int64_t>(i) * dvp_;
      load_row(v_ + v_off, g_.v_st[3], Dv, vr);
      std::fill(vr + Dv, vr + dvp_, 0.0f);
    }
  }

  float* kt_of(Scratch& sc, int slot) const { return sc.kt.data() + static_cast<int64_t>(slot) * g_.head_dim * kp_; }

  // Loads a step's keys [p0, p1) of KV heads kv_head .. kv_head + nh - 1
  // (transposed) and their value segments into slots 0 .. nh - 1, block by
  // block, each block's heads one after another.
  void load_step(int kv_head, int nh, int c0, int p0, int p1, const int32_t* table, Scratch& sc) {
    const int D = g_.head_dim, bs = g_.block_size;
    for (int s = 0; s < nh; ++s) sc.nseg[s] = 0;
    for (int b = p0 / bs; b * bs < p1; ++b) {
      const int q0 = std::max(p0, b * bs), q1 = std::min(p1, (b + 1) * bs);
      for (int s = 0; s < nh; ++s) {
        if ((b + 1) * bs < p1) {  // the step's next block's key rows of this head, into L2
          prefetch_rows(k_ + table[(b + 1) * g_.bt_st[1]] * g_.k_st[0] + (kv_head + s) * g_.k_st[2], g_.k_st[1], bs, D);
        }
        load_block(table[b * g_.bt_st[1]], b * bs, q0, q1, kv_head + s, q0 - c0, s, sc);
      }
    }
  }

  const C* k_;
  const C* v_;
  Geometry g_;
  const int dvp_;    // v_head_dim padded to whole vectors
  const int chunk_;  // keys per softmax step (absolute, aligned ranges): kChunkKeys or a block
  const int kp_;     // a step's keys padded to whole vectors, plus one (row stride of kt, scores)
  const int slots_;  // KV heads whose step is loaded before any is scored (kt within kSlotBytes)
};

} // namespace
} // namespace vllm_metal::cpu
