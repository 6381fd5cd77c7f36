/* What float32 GEMM speed one core of this CPU allows (benchmarks/gemm_ceiling.py
 * compiles and runs this; docs/benchmarks.md#the-prefill-products-ceiling).
 *
 *   fma_peak        24 independent register-only FMA chains: the FMA units' peak
 *   micro MRxNR     a register-blocked micro-kernel (MR rows of A broadcast, NR
 *                   columns of packed B as NR/16 vectors, MR x NR/16
 *                   accumulators), its operands in L1: the ceiling of any GEMM
 *                   built on broadcasts (OpenBLAS's, oneDNN's, BLIS's)
 *   blis MxNxK      a whole single-threaded GEMM C = A B^T (BLIS's layering:
 *                   B packed in blocks of 1024 columns x K, A in 12-row
 *                   micro-panels, the best micro-kernel above), checked against
 *                   a double-precision sum
 *
 * Usage: gemm_ceiling SCALE (iterations scale: 1 for the measurement, 0.01 to smoke-test).
 * Prints one JSON object per line. */
#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define AVX512 __attribute__((target("avx512f,avx512vl,fma"), noinline))

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

AVX512 static float fma_chains(long iters) {
  __m512 a[24];
  for (int i = 0; i < 24; i++) a[i] = _mm512_set1_ps(i * 1e-3f);
  const __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1e-4f);
  for (long it = 0; it < iters; it++) {
    _Pragma("GCC unroll 24") for (int i = 0; i < 24; i++) a[i] = _mm512_fmadd_ps(a[i], b, c);
  }
  float s = 0;
  _Pragma("GCC unroll 24") for (int i = 0; i < 24; i++) s += _mm512_reduce_add_ps(a[i]);
  return s;
}

#define MICRO(MR, NV)                                                                          \
  AVX512 static void micro_##MR##_##NV(const float* ap, const float* bp, long kc, float* c) {  \
    __m512 acc[MR][NV];                                                                        \
    for (int r = 0; r < MR; ++r)                                                               \
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_loadu_ps(c + (r * NV + v) * 16);         \
    for (long k = 0; k < kc; ++k) {                                                            \
      __m512 b[NV];                                                                            \
      for (int v = 0; v < NV; ++v) b[v] = _mm512_load_ps(bp + (k * NV + v) * 16);              \
      _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {                                  \
        const __m512 a = _mm512_set1_ps(ap[MR * k + r]);                                       \
        _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(a, b[v], acc[r][v]); \
      }                                                                                        \
    }                                                                                          \
    for (int r = 0; r < MR; ++r)                                                               \
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + (r * NV + v) * 16, acc[r][v]);         \
  }
MICRO(16, 1)
MICRO(12, 2)
MICRO(14, 2)
MICRO(8, 3)
MICRO(6, 4)
MICRO(4, 6)

typedef void (*micro_fn)(const float*, const float*, long, float*);

/* The whole GEMM: C[M,N] = A[M,K] B[N,K]^T, single-threaded. */
enum { MR = 12, NR = 32, NC = 1024 };

static void pack_b(const float* B, long K, long n0, long n1, float* bp) {
  for (long p0 = n0; p0 < n1; p0 += NR)
    for (long c = 0; c < NR; ++c)
      for (long k = 0; k < K; ++k)
        bp[(p0 - n0) / NR * K * NR + k * NR + c] = p0 + c < n1 ? B[(p0 + c) * K + k] : 0.0f;
}

static void pack_a(const float* A, long M, long K, long m0, float* ap) {
  for (long k = 0; k < K; ++k)
    for (long r = 0; r < MR; ++r) ap[k * MR + r] = m0 + r < M ? A[(m0 + r) * K + k] : 0.0f;
}

static void gemm(const float* A, const float* B, float* C, long M, long N, long K, float* bp, float* ap) {
  float tile[MR * NR] __attribute__((aligned(64)));
  for (long nb = 0; nb < N; nb += NC) {
    const long ne = N - nb < NC ? N : nb + NC;
    pack_b(B, K, nb, ne, bp);
    for (long m0 = 0; m0 < M; m0 += MR) {
      pack_a(A, M, K, m0, ap);
      for (long p0 = nb; p0 < ne; p0 += NR) {
        memset(tile, 0, sizeof tile);
        micro_12_2(ap, bp + (p0 - nb) / NR * K * NR, K, tile);
        for (long r = 0; r < MR && m0 + r < M; ++r)
          for (long c = 0; c < NR && p0 + c < ne; ++c) C[(m0 + r) * N + p0 + c] = tile[r * NR + c];
      }
    }
  }
}

int main(int argc, char** argv) {
  const double scale = argc > 1 ? atof(argv[1]) : 1.0;
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("fma")) {
    printf("{\"skipped\": \"no AVX-512 on this CPU\"}\n");
    return 0;
  }
  double best = 1e9;
  const long iters = (long)(2e7 * scale) + 1;
  volatile float sink = 0;
  for (int rep = 0; rep < 3; rep++) {
    double t = now();
    sink += fma_chains(iters);
    t = now() - t;
    if (t < best) best = t;
  }
  printf("{\"case\": \"fma_peak\", \"gflops\": %.1f}\n", 24.0 * 32 * iters / best / 1e9);

  float* ap = aligned_alloc(64, 16 * 256 * sizeof(float));
  float* bp = aligned_alloc(64, 96 * 256 * sizeof(float));
  float* c = aligned_alloc(64, 16 * 96 * sizeof(float));
  for (int i = 0; i < 16 * 256; i++) ap[i] = 1e-3f;
  for (int i = 0; i < 96 * 256; i++) bp[i] = 1e-3f;
  const struct { int mr, nv; micro_fn fn; } micros[] = {
      {16, 1, micro_16_1}, {12, 2, micro_12_2}, {14, 2, micro_14_2}, {8, 3, micro_8_3}, {6, 4, micro_6_4}, {4, 6, micro_4_6}};
  const long calls = (long)(1e5 * scale) + 1;
  for (size_t v = 0; v < sizeof micros / sizeof micros[0]; ++v) {
    memset(c, 0, 16 * 96 * sizeof(float));
    best = 1e9;
    for (int rep = 0; rep < 3; rep++) {
      double t = now();
      for (long i = 0; i < calls; i++) micros[v].fn(ap, bp, 128, c);
      t = now() - t;
      if (t < best) best = t;
    }
    printf("{\"case\": \"micro\", \"mr\": %d, \"nr\": %d, \"gflops\": %.1f}\n", micros[v].mr, 16 * micros[v].nv,
           2.0 * micros[v].mr * 16 * micros[v].nv * 128 * calls / best / 1e9);
  }

  const long shapes[][3] = {{2048, 960, 576}, {2048, 576, 576}, {2048, 3072, 576}, {2048, 576, 1536}};
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; ++s) {
    const long M = scale < 0.1 ? 40 : shapes[s][0], N = shapes[s][1], K = shapes[s][2];
    float* A = malloc(M * K * sizeof(float));
    float* B = malloc(N * K * sizeof(float));
    float* C = malloc(M * N * sizeof(float));
    float* packed_b = aligned_alloc(64, (NC * K + 16) * sizeof(float));
    float* packed_a = aligned_alloc(64, (MR * K + 16) * sizeof(float));
    srand(1);
    for (long i = 0; i < M * K; i++) A[i] = rand() / (float)RAND_MAX - 0.5f;
    for (long i = 0; i < N * K; i++) B[i] = rand() / (float)RAND_MAX - 0.5f;
    best = 1e9;
    for (int rep = 0; rep < 3; rep++) {
      double t = now();
      gemm(A, B, C, M, N, K, packed_b, packed_a);
      t = now() - t;
      if (t < best) best = t;
    }
    double err = 0;
    for (long i = 0; i < M; i += M / 7 + 1)
      for (long j = 0; j < N; j += N / 11 + 1) {
        double ref = 0;
        for (long k = 0; k < K; ++k) ref += (double)A[i * K + k] * B[j * K + k];
        err = fmax(err, fabs(ref - C[i * N + j]));
      }
    printf("{\"case\": \"blis\", \"m\": %ld, \"n\": %ld, \"k\": %ld, \"gflops\": %.1f, \"max_abs_err\": %.3g}\n", M, N, K,
           2.0 * M * N * K / best / 1e9, err);
    free(A), free(B), free(C), free(packed_b), free(packed_a);
  }
  return sink == 12345.0f;
}
