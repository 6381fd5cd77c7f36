/* The BLAS shim's few-row kernels (x86-64: AVX2 + FMA, and an AVX-512 one-row
 * path): columns [n0, n1) of one row-major x[M,K] @ W[N,K]^T, with the next
 * W rows prefetched into L2. Included once, by blas_few_rows.c, whose pool
 * splits the columns over threads. */
#pragma once

#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "blas_few_rows.h"

typedef struct {
  i64 M, N, K, lda, ldb, ldc;
  float alpha, beta;
  const float* A;
  const float* B;
  float* C;
  /* Set: the pool runs fn(ctx, n0, n1) on each slice of columns instead of
   * the few-row kernel (pool_columns: blas_shim.c's large products). */
  columns_fn fn;
  const void* ctx;
} FewRowsJob;

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline void store_out(const FewRowsJob* j, i64 m, i64 n, float dot) {
  float* c = j->C + m * j->ldc + n;
  *c = j->beta == 0.0f ? j->alpha * dot : j->alpha * dot + j->beta * *c;
}

/* Software prefetch into L2 of the W rows a kernel reads next, spread over
 * the loop that reads the current ones (one slice per iteration). Decode's
 * weights are short rows (SmolLM2: 576 floats, 36 lines), so each row is a
 * stream too short for the hardware prefetchers to train on before it ends;
 * fetching the next block of rows while the current one computes kept
 * memory busy: SmolLM2's 120 batch-1 products 19 -> 15 ms, its 113 MB head
 * 4.6 -> 3.3 ms (docs/benchmarks.md#blas-shim). An L1 hint or a
 * non-temporal one measured slower, two or four blocks ahead no better. */
typedef struct {
  const char* p;
  i64 left, step;
} Prefetch;

static inline Prefetch prefetch_plan(const float* from, i64 bytes, i64 iters) {
  Prefetch f = {(const char*)from, bytes > 0 ? bytes : 0, 0};
  if (iters < 1) iters = 1;
  f.step = ((f.left + iters - 1) / iters + 63) & ~(i64)63;
  return f;
}

static inline void prefetch_next(Prefetch* f) {
  const i64 e = f->step < f->left ? f->step : f->left;
  for (i64 b = 0; b < e; b += 64) _mm_prefetch(f->p + b, _MM_HINT_T1);
  f->p += e;
  f->left -= e;
}

/* With 2 or more rows (measured at 2-8), the W pair this many pairs on is prefetched (1-8 swept: 1-2 best). */
enum { kPrefetchPairsAhead = 2 };

/* Columns [n0, n1) of C: W's rows two at a time against A's rows four at a
 * time (8 accumulators in registers), then single rows; K's tail (K % 8)
 * in scalars. */
#define DOT_TAIL(d, a, w) for (i64 k = K8; k < K; ++k) d += (a)[k] * (w)[k]

/* R W rows of one A row at a time (one_row_avx512 below). */
#define ONE_ROW_BLOCK(R)                                                                          \
  for (; n + (R) <= n1; n += (R)) {                                                               \
    const float* w = j->B + n * j->ldb;                                                           \
    const i64 ld = j->ldb;                                                                        \
    __m512 c[R];                                                                                  \
    for (int r = 0; r < (R); ++r) c[r] = _mm512_setzero_ps();                                     \
    Prefetch f = prefetch_plan(w + (R) * ld, n + 2 * (R) <= n1 ? (R) * ld * 4 : 0, K16 / 16);     \
    for (i64 k = 0; k < K16; k += 16) {                                                           \
      const __m512 v = _mm512_loadu_ps(a + k);                                                    \
      prefetch_next(&f);                                                                          \
      for (int r = 0; r < (R); ++r) c[r] = _mm512_fmadd_ps(v, _mm512_loadu_ps(w + r * ld + k), c[r]); \
    }                                                                                             \
    if (tail) {                                                                                   \
      const __m512 v = _mm512_maskz_loadu_ps(tail, a + K16);                                      \
      for (int r = 0; r < (R); ++r)                                                               \
        c[r] = _mm512_fmadd_ps(v, _mm512_maskz_loadu_ps(tail, w + r * ld + K16), c[r]);           \
    }                                                                                             \
    for (int r = 0; r < (R); ++r) store_out(j, 0, n + r, _mm512_reduce_add_ps(c[r]));            \
  }

/* One row of A (decode at batch 1) on AVX-512: sixteen (then eight, then
 * one) W rows at a time, each its own FMA chain of 16-lane partial sums (K's tail
 * through a masked load), so a column's sum is the same whichever block
 * computes it. Bound by reading W: the next block's rows are prefetched into
 * L2 meanwhile (Prefetch above). Sixteen rows keep more of W in flight than
 * eight: SmolLM2's 120 batch-1 products 19.2-20.1 -> 18.1-18.3 ms on two
 * threads, its batch-1 step 39.4 / 40.0 -> 38.0 / 39.2 ms (2026-11-27, Intel
 * host, interleaved; 24 rows measured no better than 16). */
__attribute__((target("avx512f,avx512vl,avx512dq,fma"))) static void one_row_avx512(const FewRowsJob* j, i64 n0,
                                                                                    i64 n1) {
  const i64 K = j->K, K16 = K & ~(i64)15;
  const __mmask16 tail = (__mmask16)((1u << (K - K16)) - 1u);
  const float* a = j->A;
  i64 n = n0;
  ONE_ROW_BLOCK(16)
  ONE_ROW_BLOCK(8)
  ONE_ROW_BLOCK(1)
}

/* Sixteen sums at once: lane i of the result is _mm512_reduce_add_ps(v[4 * (i % 4) + i / 4]),
 * bit for bit -- the same tree of additions (lanes l + l+8, then l + l+4, l + l+2, l + l+1),
 * done for sixteen vectors together in 15 shuffle pairs instead of sixteen times alone. */
__attribute__((target("avx512f,avx512vl,avx512dq,fma"))) static inline __m512 reduce16_avx512(const __m512* v) {
  __m512 u[8], w[4], z[2];
  for (int i = 0; i < 8; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    z[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
}

/* With 2 or more rows on AVX-512 (measured at 2-8), the W rows this far on are prefetched: the next block of
 * four (4, 8, 16 and 32 measured alike, 4 by a hair). */
enum { kRowsPrefetchAhead = 4 };

/* MB (1-4) rows of A from row m against W rows [n, n + 4): sixteen 16-lane FMA
 * chains (a column's chain exactly as one_row_avx512's), summed by reduce16_avx512,
 * so every output has the bits of the one-row kernel: a row's result does not
 * depend on how many rows the product has. One function per MB, so that the
 * accumulators stay in registers. */
#define ROW_FMAS(MB, r, v, w0, w1, w2, w3)                                                                            \
  if ((r) < (MB)) {                                                                                                   \
    c##r##0 = _mm512_fmadd_ps(v, w0, c##r##0);                                                                        \
    c##r##1 = _mm512_fmadd_ps(v, w1, c##r##1);                                                                        \
    c##r##2 = _mm512_fmadd_ps(v, w2, c##r##2);                                                                        \
    c##r##3 = _mm512_fmadd_ps(v, w3, c##r##3);                                                                        \
  }
#define ROWS_BLOCK_FN(MB)                                                                                             \
  __attribute__((target("avx512f,avx512vl,avx512dq,fma"))) static void rows_block_avx512_##MB(                        \
      const FewRowsJob* j, i64 m, i64 n, Prefetch* f) {                                                               \
    const i64 K = j->K, K16 = K & ~(i64)15, ld = j->ldb, lda = j->lda;                                                \
    const __mmask16 tail = (__mmask16)((1u << (K - K16)) - 1u);                                                       \
    const float* w = j->B + n * ld;                                                                                   \
    const float* a0 = j->A + m * lda;                                                                                 \
    const float *a1 = a0 + lda, *a2 = a1 + lda, *a3 = a2 + lda;                                                       \
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00,               \
           c13 = c00, c20 = c00, c21 = c00, c22 = c00, c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00;         \
    for (i64 k = 0; k < K16; k += 16) {                                                                               \
      if (f) prefetch_next(f);                                                                                        \
      const __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + ld + k);                                     \
      const __m512 w2 = _mm512_loadu_ps(w + 2 * ld + k), w3 = _mm512_loadu_ps(w + 3 * ld + k);                        \
      ROW_FMAS(MB, 0, _mm512_loadu_ps(a0 + k), w0, w1, w2, w3)                                                        \
      ROW_FMAS(MB, 1, _mm512_loadu_ps(a1 + k), w0, w1, w2, w3)                                                        \
      ROW_FMAS(MB, 2, _mm512_loadu_ps(a2 + k), w0, w1, w2, w3)                                                        \
      ROW_FMAS(MB, 3, _mm512_loadu_ps(a3 + k), w0, w1, w2, w3)                                                        \
    }                                                                                                                 \
    if (tail) {                                                                                                       \
      const __m512 w0 = _mm512_maskz_loadu_ps(tail, w + K16), w1 = _mm512_maskz_loadu_ps(tail, w + ld + K16);         \
      const __m512 w2 = _mm512_maskz_loadu_ps(tail, w + 2 * ld + K16);                                                \
      const __m512 w3 = _mm512_maskz_loadu_ps(tail, w + 3 * ld + K16);                                                \
      ROW_FMAS(MB, 0, _mm512_maskz_loadu_ps(tail, a0 + K16), w0, w1, w2, w3)                                          \
      ROW_FMAS(MB, 1, _mm512_maskz_loadu_ps(tail, a1 + K16), w0, w1, w2, w3)                                          \
      ROW_FMAS(MB, 2, _mm512_maskz_loadu_ps(tail, a2 + K16), w0, w1, w2, w3)                                          \
      ROW_FMAS(MB, 3, _mm512_maskz_loadu_ps(tail, a3 + K16), w0, w1, w2, w3)                                          \
    }                                                                                                                 \
    /* reduce16_avx512's order: v[4 * col + row] gives lane 4 * row + col. */                                         \
    const __m512 v[16] = {c00, c10, c20, c30, c01, c11, c21, c31, c02, c12, c22, c32, c03, c13, c23, c33};            \
    float out[16];                                                                                                    \
    _mm512_storeu_ps(out, reduce16_avx512(v));                                                                        \
    for (int r = 0; r < MB; ++r)                                                                                      \
      for (int col = 0; col < 4; ++col) store_out(j, m + r, n + col, out[4 * r + col]);                               \
  }
ROWS_BLOCK_FN(1)
ROWS_BLOCK_FN(2)
ROWS_BLOCK_FN(3)
ROWS_BLOCK_FN(4)
#undef ROWS_BLOCK_FN
#undef ROW_FMAS

/* Two to 32 rows of A (decode at batch 2-32) on AVX-512: W four rows at a
 * time, read from memory once for all of A's rows (in blocks of four; the
 * second block finds them in L1), the rows kRowsPrefetchAhead on prefetched
 * into L2 meanwhile. Columns past the last block of four: one chain each, as
 * in one_row_avx512. Does every column of [n0, n1). */
__attribute__((target("avx512f,avx512vl,avx512dq,fma"))) static void rows_avx512(const FewRowsJob* j, i64 n0, i64 n1) {
  const i64 K = j->K, K16 = K & ~(i64)15, M = j->M, ld = j->ldb;
  const __mmask16 tail = (__mmask16)((1u << (K - K16)) - 1u);
  i64 n = n0;
  for (; n + 4 <= n1; n += 4) {
    const i64 ahead = n + kRowsPrefetchAhead;
    Prefetch f = prefetch_plan(j->B + ahead * ld, ahead + 4 <= n1 ? 4 * ld * 4 : 0, K16 / 16);
    for (i64 m = 0; m < M; m += 4) {
      Prefetch* pf = m == 0 ? &f : NULL;
      switch (M - m >= 4 ? 4 : (int)(M - m)) {
        case 4: rows_block_avx512_4(j, m, n, pf); break;
        case 3: rows_block_avx512_3(j, m, n, pf); break;
        case 2: rows_block_avx512_2(j, m, n, pf); break;
        default: rows_block_avx512_1(j, m, n, pf); break;
      }
    }
  }
  for (; n < n1; ++n) {
    const float* w = j->B + n * ld;
    for (i64 m = 0; m < M; ++m) {
      const float* a = j->A + m * j->lda;
      __m512 c = _mm512_setzero_ps();
      for (i64 k = 0; k < K16; k += 16) c = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(w + k), c);
      if (tail) c = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, a + K16), _mm512_maskz_loadu_ps(tail, w + K16), c);
      store_out(j, m, n, _mm512_reduce_add_ps(c));
    }
  }
}

/* VLLM_METAL_CPU_ISA, the cap on every CPU kernel of vllm-metal
 * (csrc/cpu/isa.h): 0 "generic", 1 "avx2", 2 none. */
static int isa_cap_level(void) {
  const char* cap = getenv("VLLM_METAL_CPU_ISA");
  return !cap ? 2 : strcmp(cap, "generic") == 0 ? 0 : strcmp(cap, "avx2") == 0 ? 1 : 2;
}

static int avx512_allowed(void) {
  static int cached = -1;
  if (cached < 0) {
    __builtin_cpu_init();
    cached = isa_cap_level() == 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
  }
  return cached;
}

__attribute__((target("avx2,fma"))) static void few_rows_range(const FewRowsJob* j, i64 n0, i64 n1) {
  const i64 K = j->K, K8 = K & ~(i64)7, M4 = j->M & ~(i64)3;
  i64 n = n0;
  if (avx512_allowed()) {
    /* Every column, with the same bits for one row or eight. */
    if (j->M == 1) {
      one_row_avx512(j, n0, n1);
    } else {
      rows_avx512(j, n0, n1);
    }
    return;
  }
  if (j->M == 1) {
    /* One row (decode at batch 1): four W rows at a time, four independent
     * FMA chains; each output's sums are the same as below. */
    const float* a = j->A;
    for (; n + 4 <= n1; n += 4) {
      const float* w0 = j->B + n * j->ldb;
      const float* w1 = w0 + j->ldb;
      const float* w2 = w1 + j->ldb;
      const float* w3 = w2 + j->ldb;
      __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(), c2 = _mm256_setzero_ps(),
             c3 = _mm256_setzero_ps();
      Prefetch f = prefetch_plan(w0 + 4 * j->ldb, n + 8 <= n1 ? 4 * j->ldb * 4 : 0, K8 / 8);
      for (i64 k = 0; k < K8; k += 8) {
        const __m256 v = _mm256_loadu_ps(a + k);
        prefetch_next(&f);
        c0 = _mm256_fmadd_ps(v, _mm256_loadu_ps(w0 + k), c0);
        c1 = _mm256_fmadd_ps(v, _mm256_loadu_ps(w1 + k), c1);
        c2 = _mm256_fmadd_ps(v, _mm256_loadu_ps(w2 + k), c2);
        c3 = _mm256_fmadd_ps(v, _mm256_loadu_ps(w3 + k), c3);
      }
      float d0 = hsum8(c0), d1 = hsum8(c1), d2 = hsum8(c2), d3 = hsum8(c3);
      DOT_TAIL(d0, a, w0); DOT_TAIL(d1, a, w1); DOT_TAIL(d2, a, w2); DOT_TAIL(d3, a, w3);
      store_out(j, 0, n, d0); store_out(j, 0, n + 1, d1);
      store_out(j, 0, n + 2, d2); store_out(j, 0, n + 3, d3);
    }
  }
  for (; n + 2 <= n1; n += 2) {
    const float* w0 = j->B + n * j->ldb;
    const float* w1 = w0 + j->ldb;
    /* The pair kPrefetchPairsAhead pairs on, over the first k loop below. */
    Prefetch f = prefetch_plan(w0 + 2 * kPrefetchPairsAhead * j->ldb,
                               n + 2 * (kPrefetchPairsAhead + 1) <= n1 ? 2 * j->ldb * 4 : 0, K8 / 8);
    i64 m = 0;
    for (; m < M4; m += 4) {
      const float* a0 = j->A + m * j->lda;
      const float* a1 = a0 + j->lda;
      const float* a2 = a1 + j->lda;
      const float* a3 = a2 + j->lda;
      __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps(),
             c11 = _mm256_setzero_ps(), c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps(),
             c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
      for (i64 k = 0; k < K8; k += 8) {
        prefetch_next(&f);
        const __m256 x0 = _mm256_loadu_ps(w0 + k), x1 = _mm256_loadu_ps(w1 + k);
        __m256 v = _mm256_loadu_ps(a0 + k);
        c00 = _mm256_fmadd_ps(v, x0, c00);
        c01 = _mm256_fmadd_ps(v, x1, c01);
        v = _mm256_loadu_ps(a1 + k);
        c10 = _mm256_fmadd_ps(v, x0, c10);
        c11 = _mm256_fmadd_ps(v, x1, c11);
        v = _mm256_loadu_ps(a2 + k);
        c20 = _mm256_fmadd_ps(v, x0, c20);
        c21 = _mm256_fmadd_ps(v, x1, c21);
        v = _mm256_loadu_ps(a3 + k);
        c30 = _mm256_fmadd_ps(v, x0, c30);
        c31 = _mm256_fmadd_ps(v, x1, c31);
      }
      float d00 = hsum8(c00), d01 = hsum8(c01), d10 = hsum8(c10), d11 = hsum8(c11);
      float d20 = hsum8(c20), d21 = hsum8(c21), d30 = hsum8(c30), d31 = hsum8(c31);
      DOT_TAIL(d00, a0, w0); DOT_TAIL(d01, a0, w1); DOT_TAIL(d10, a1, w0); DOT_TAIL(d11, a1, w1);
      DOT_TAIL(d20, a2, w0); DOT_TAIL(d21, a2, w1); DOT_TAIL(d30, a3, w0); DOT_TAIL(d31, a3, w1);
      store_out(j, m, n, d00); store_out(j, m, n + 1, d01);
      store_out(j, m + 1, n, d10); store_out(j, m + 1, n + 1, d11);
      store_out(j, m + 2, n, d20); store_out(j, m + 2, n + 1, d21);
      store_out(j, m + 3, n, d30); store_out(j, m + 3, n + 1, d31);
    }
    for (; m < j->M; ++m) {
      const float* a0 = j->A + m * j->lda;
      __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
      for (i64 k = 0; k < K8; k += 8) {
        prefetch_next(&f);
        const __m256 v = _mm256_loadu_ps(a0 + k);
        c0 = _mm256_fmadd_ps(v, _mm256_loadu_ps(w0 + k), c0);
        c1 = _mm256_fmadd_ps(v, _mm256_loadu_ps(w1 + k), c1);
      }
      float d0 = hsum8(c0), d1 = hsum8(c1);
      DOT_TAIL(d0, a0, w0); DOT_TAIL(d1, a0, w1);
      store_out(j, m, n, d0); store_out(j, m, n + 1, d1);
    }
  }
  for (; n < n1; ++n) {
    const float* w = j->B + n * j->ldb;
    for (i64 m = 0; m < j->M; ++m) {
      const float* a = j->A + m * j->lda;
      __m256 acc = _mm256_setzero_ps();
      for (i64 k = 0; k < K8; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(w + k), acc);
      float d = hsum8(acc);
      DOT_TAIL(d, a, w);
      store_out(j, m, n, d);
    }
  }
}
#undef DOT_TAIL
#endif
