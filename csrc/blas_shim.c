/* Forwarding shim: the LP64 CBLAS entry points MLX's CPU backend imports
 * (cblas_sgemm, cblas_dgemm, cblas_cgemm; `nm -D --undefined-only libmlx.so`)
 * forwarded to an ILP64 OpenBLAS whose symbols are renamed, such as the one
 * numpy bundles (numpy.libs/libscipy_openblas64_-*.so: scipy_cblas_sgemm64_,
 * 64-bit integers). Linux only; loaded by vllm_metal/native/fast_blas.py.
 *
 * Life cycle: fast_blas.py loads this library RTLD_LOCAL, calls
 * vllm_metal_blas_shim_init() with the target library's path, and only when
 * that succeeds re-opens it RTLD_GLOBAL (RTLD_NOLOAD), before mlx.core is
 * imported, so that the dynamic linker binds libmlx's cblas_* imports here.
 * The LAPACK routines MLX also imports are not provided: the system OpenBLAS,
 * loaded after this library, or MLX's bundled LAPACK supplies them.
 *
 * Few-row products: MLX sends every matmul through cblas_sgemm, and a decode
 * product x[M,K] @ W^T with M = 1 is a matrix-vector product. OpenBLAS's sgemm
 * packs W first and streams it at a fraction of memory bandwidth; its sgemv
 * does not. An sgemm with M <= gemv_max_rows (2 by default; 0 turns this off)
 * is forwarded as M sgemv calls, and one with N == 1 as one sgemv. Measured
 * on SmolLM2-135M's layers (docs/benchmarks.md): faster at M = 1 and 2, not
 * at 4 or 8, where reading W M times costs more than sgemm's packing.
 *
 * Few-row products, 3 to transpose_max_rows (32) rows and at least 64
 * columns (a batch of decode rows times a weight): OpenBLAS's sgemm is 2-3x
 * slower with the output's few rows as its row-major M than with them as N
 * (measured: 8 x 1024 @ 1024 x 2816, 1.47 ms against 0.62 ms). Such a call is
 * computed as its transpose, D[N,M] = op(B)^T op(A)^T, into a scratch buffer,
 * then D^T written to C. The same products, in another order of OpenBLAS's
 * kernels: results agree with the direct call to rounding.
 *
 * Few-row products with a row-major weight, few_rows_min (1) to few_rows_max
 * rows (by default 64 on the kernel's AVX-512 path, 33-64 only for weights of
 * up to 16 MB, and 16 on its AVX2 path: few_rows_auto_max) (checked before the
 * sgemv path above, so the 1-2-row products of
 * that layout run here; other layouts never do):
 * C[M,N] = A[M,K] W[N,K]^T, which is how MLX calls x @ w.T (A not
 * transposed, B transposed with its rows contiguous). Both orders of
 * OpenBLAS's sgemm pack W before multiplying and stream it at 3-15 GB/s, a
 * fraction of memory bandwidth, though every weight is used only M times.
 * Where the CPU has AVX2 and FMA, such a call runs the kernel of
 * blas_few_rows.c instead: W is read once (AVX2: two rows at a time;
 * AVX-512: sixteen rows at a time for one row of A, four for more), each
 * against all M rows of A (which stay in cache), the columns split over a
 * small pool of threads (one per core, the caller included; set_threads).
 * Each output is one dot product of 8-lane (AVX2) or 16-lane (AVX-512)
 * partial sums in a fixed order, so it does not depend on the threads or on
 * the other rows of the call. One or two rows use both threads from 256 KiB of W:
 * with W streamed from memory, as in a model's decode step, that beats
 * OpenBLAS's sgemv (a 30-layer chain of batch-1 products: 22-23 against
 * 24-26 ms), and it never collapses when another process wants a core, as
 * OpenBLAS's spinning threads do (10x slower decode steps; both measured in
 * docs/benchmarks.md#blas-shim). few_rows_min 3 sends them back to sgemv.
 */
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blas_few_rows.h"

/* CBLAS enum values (identical in every CBLAS). */
enum { ROW_MAJOR = 101, COL_MAJOR = 102 };
enum { NO_TRANS = 111, TRANS = 112, CONJ_TRANS = 113 };

typedef void (*sgemm64_fn)(int, int, int, i64, i64, i64, float, const float*, i64,
                           const float*, i64, float, float*, i64);
typedef void (*dgemm64_fn)(int, int, int, i64, i64, i64, double, const double*, i64,
                           const double*, i64, double, double*, i64);
typedef void (*cgemm64_fn)(int, int, int, i64, i64, i64, const void*, const void*, i64,
                           const void*, i64, const void*, void*, i64);
typedef void (*sgemv64_fn)(int, int, i64, i64, float, const float*, i64, const float*, i64,
                           float, float*, i64);

static sgemm64_fn p_sgemm;
static dgemm64_fn p_dgemm;
static cgemm64_fn p_cgemm;
static sgemv64_fn p_sgemv;
static char target_name[64];
static atomic_int gemv_max_rows = 2;
static atomic_int few_rows_min = 1;
static atomic_int transpose_max_rows = 32;
enum { TRANSPOSE_MIN_COLS = 64 };
static atomic_int few_rows_max = -1; /* -1: few_rows_auto_max() */
static atomic_llong n_sgemm, n_sgemv, n_dgemm, n_cgemm, n_transposed, n_few_rows, n_large;

/* Large products (prefill: M >= large_min_rows rows) may go to a second
 * library's LP64 cblas_sgemm, run single-threaded on each slice of the
 * columns over the few-row kernel's pool: Intel MKL's runtime library
 * (libmkl_rt, its sequential layer), where vllm_metal/native/mkl_gemm.py
 * finds and chooses it. Measured on SmolLM2's four prefill shapes (1024
 * rows, two cores of an Intel Xeon with AVX-512): 364-386 GFLOP/s against
 * 336-349 for numpy's OpenBLAS on its own threads (docs/benchmarks.md#blas-shim). */
typedef void (*sgemm32_fn)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                           float, float*, int);
static sgemm32_fn p_large;
static char large_name[256];
static atomic_int large_min_rows = 33;

/* Symbol spellings of ILP64 OpenBLAS builds: numpy >= 2 (scipy-openblas64),
 * then older numpy wheels (openblas64_). */
static const char* const PATTERNS[][2] = {{"scipy_", "64_"}, {"", "64_"}};

static void* lookup(void* lib, const char* prefix, const char* name, const char* suffix) {
  char sym[128];
  snprintf(sym, sizeof sym, "%s%s%s", prefix, name, suffix);
  return dlsym(lib, sym);
}

/* Opens `path` and resolves its gemm/gemv entry points. Returns 0 on success;
 * otherwise writes why into err. Not thread-safe; call once, before MLX runs. */
EXPORT int vllm_metal_blas_shim_init(const char* path, char* err, size_t err_len) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(err, err_len, "dlopen: %s", dlerror());
    return 1;
  }
  for (size_t i = 0; i < sizeof PATTERNS / sizeof PATTERNS[0]; ++i) {
    const char* pre = PATTERNS[i][0];
    const char* suf = PATTERNS[i][1];
    void* s = lookup(lib, pre, "cblas_sgemm", suf);
    void* d = lookup(lib, pre, "cblas_dgemm", suf);
    void* c = lookup(lib, pre, "cblas_cgemm", suf);
    void* v = lookup(lib, pre, "cblas_sgemv", suf);
    if (s && d && c && v) {
      p_sgemm = (sgemm64_fn)s;
      p_dgemm = (dgemm64_fn)d;
      p_cgemm = (cgemm64_fn)c;
      p_sgemv = (sgemv64_fn)v;
      snprintf(target_name, sizeof target_name, "%scblas_sgemm%s", pre, suf);
      return 0;  /* the handle stays open for the life of the process */
    }
  }
  snprintf(err, err_len, "%s exports no ILP64 cblas_sgemm/dgemm/cgemm/sgemv (tried scipy_*64_, *64_)",
           path);
  dlclose(lib);
  return 2;
}

/* Opens `path`, Intel MKL's runtime library (libmkl_rt), sets its threading
 * layer to sequential (before any other MKL call: the shim's pool runs the
 * threads) and takes its LP64 cblas_sgemm for the large products. Returns 0
 * on success; otherwise writes why into err. Call once, after
 * vllm_metal_blas_shim_init and before MLX runs. */
EXPORT int vllm_metal_blas_shim_init_large(const char* path, char* err, size_t err_len) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(err, err_len, "dlopen: %s", dlerror());
    return 1;
  }
  int (*set_layer)(int) = (int (*)(int))dlsym(lib, "MKL_Set_Threading_Layer");
  void (*version)(char*, int) = (void (*)(char*, int))dlsym(lib, "MKL_Get_Version_String");
  void* sgemm = dlsym(lib, "cblas_sgemm");
  if (!set_layer || !version || !sgemm) {
    snprintf(err, err_len, "%s is not MKL's runtime library (no MKL_Set_Threading_Layer, "
             "MKL_Get_Version_String or cblas_sgemm)", path);
    dlclose(lib);
    return 2;
  }
  if (set_layer(1 /* MKL_THREADING_SEQUENTIAL */) != 1) {
    snprintf(err, err_len, "%s: its threading layer could not be set to sequential", path);
    return 3;  /* MKL is loaded now: the handle stays open, unused */
  }
  version(large_name, (int)sizeof large_name);
  p_large = (sgemm32_fn)sgemm;
  return 0;
}

/* The large products' library ("" when none), e.g. "Intel(R) oneAPI Math Kernel Library Version 2026.2...". */
EXPORT const char* vllm_metal_blas_shim_large_target(void) { return p_large ? large_name : ""; }

/* Row-major sgemm with at least `rows` rows goes to the large-product library
 * when one is set (33 by default; 0: never). Returns the previous value. */
EXPORT int vllm_metal_blas_shim_set_large_min_rows(int rows) {
  return atomic_exchange(&large_min_rows, rows < 0 ? 0 : rows);
}

/* The symbol sgemm is forwarded to ("" before init). */
EXPORT const char* vllm_metal_blas_shim_target(void) { return target_name; }

/* An sgemm with at most this many rows (2 by default) goes to one sgemv per
 * row, and a one-column sgemm to one sgemv; 0: never. Returns the previous value. */
EXPORT int vllm_metal_blas_shim_set_gemv_max_rows(int rows) {
  return atomic_exchange(&gemv_max_rows, rows < 0 ? 0 : rows);
}

/* A row-major sgemm with 3..rows rows (32 by default) and at least 64
 * columns is computed as its transpose; 0: never. Returns the previous value. */
EXPORT int vllm_metal_blas_shim_set_transpose_max_rows(int rows) {
  return atomic_exchange(&transpose_max_rows, rows < 0 ? 0 : rows);
}

/* A row-major x[M,K] @ W[N,K]^T with `rows`..few_rows_max rows runs the
 * few-row kernel where the CPU has AVX2 and FMA (1 by default). Returns the
 * previous value. */
EXPORT int vllm_metal_blas_shim_set_few_rows_min(int rows) {
  return atomic_exchange(&few_rows_min, rows < 1 ? 1 : rows);
}

/* The most rows of such a product the kernel runs; 0: never; -1 (the
 * default): few_rows_auto_max(). Returns the previous value. */
EXPORT int vllm_metal_blas_shim_set_few_rows_max(int rows) {
  return atomic_exchange(&few_rows_max, rows < 0 ? -1 : rows);
}

/* The bound in force: few_rows_max, or few_rows_auto_max() when it is -1. */
static int few_rows_bound(void) {
  const int rows = atomic_load_explicit(&few_rows_max, memory_order_relaxed);
  return rows < 0 ? few_rows_auto_max() : rows;
}

EXPORT int vllm_metal_blas_shim_few_rows_max(void) { return few_rows_bound(); }

/* Calls seen so far: 0 sgemm forwarded as sgemm, 1 sgemm forwarded as sgemv,
 * 2 dgemm, 3 cgemm, 4 sgemm computed as its transpose, 5 sgemm run by the
 * few-row kernel, 6 slices of those the caller took over from a late worker,
 * 7 sgemm run by the large-product library. */
EXPORT long long vllm_metal_blas_shim_calls(int which) {
  switch (which) {
    case 0: return atomic_load(&n_sgemm);
    case 1: return atomic_load(&n_sgemv);
    case 2: return atomic_load(&n_dgemm);
    case 3: return atomic_load(&n_cgemm);
    case 4: return atomic_load(&n_transposed);
    case 5: return atomic_load(&n_few_rows);
    case 6: return atomic_load(&few_rows_taken_over);
    case 7: return atomic_load(&n_large);
    default: return -1;
  }
}

static void not_initialized(const char* name) {
  fprintf(stderr, "vllm_metal blas shim: %s called before vllm_metal_blas_shim_init\n", name);
  abort();
}

/* y[0], y[inc], ... = 0: with beta == 0, BLAS must not read C (it may hold NaN). */
static void zero_strided(float* y, i64 n, i64 inc) {
  if (inc == 1) {
    memset(y, 0, (size_t)n * sizeof(float));
  } else {
    for (i64 i = 0; i < n; ++i) y[i * inc] = 0.0f;
  }
}

/* Row-major C[M,N] = alpha op(A)[M,K] op(B)[K,N] + beta C as sgemv calls, one
 * per row of C, when M <= gemv_max_rows, or as one sgemv when N == 1.
 * Returns 0 when it does not apply. */
static int sgemm_as_gemv(int ta, int tb, i64 M, i64 N, i64 K, float alpha, const float* A,
                         i64 lda, const float* B, i64 ldb, float beta, float* C, i64 ldc) {
  int max_rows = atomic_load_explicit(&gemv_max_rows, memory_order_relaxed);
  if (max_rows < 1 || K < 1 || M < 1 || N < 1) return 0;
  if (N > 1 && M <= max_rows) {
    /* Row i: x = op(A)'s row i; y = C's row i; y = op(B)^T x. */
    i64 incx = ta == NO_TRANS ? 1 : lda;
    for (i64 i = 0; i < M; ++i) {
      const float* x = ta == NO_TRANS ? A + i * lda : A + i;
      float* y = C + i * ldc;
      if (beta == 0.0f) zero_strided(y, N, 1);
      if (tb == NO_TRANS) /* B is [K,N] */
        p_sgemv(ROW_MAJOR, TRANS, K, N, alpha, B, ldb, x, incx, beta, y, 1);
      else /* B is stored [N,K] */
        p_sgemv(ROW_MAJOR, NO_TRANS, N, K, alpha, B, ldb, x, incx, beta, y, 1);
    }
    return 1;
  }
  if (N == 1 && M > 1) {
    /* b = op(B)'s one column; y = C's one column (stride ldc); y = op(A) b. */
    i64 incb = tb == NO_TRANS ? ldb : 1;
    if (beta == 0.0f) zero_strided(C, M, ldc);
    if (ta == NO_TRANS) /* A is [M,K] */
      p_sgemv(ROW_MAJOR, NO_TRANS, M, K, alpha, A, lda, B, incb, beta, C, ldc);
    else /* A is stored [K,M] */
      p_sgemv(ROW_MAJOR, TRANS, K, M, alpha, A, lda, B, incb, beta, C, ldc);
    return 1;
  }
  return 0;
}

/* Row-major C[M,N] = alpha op(A) op(B) + beta C, for few rows M (see the
 * top of this file), as D[N,M] = alpha op(B)^T op(A)^T, then C = D^T + beta C.
 * Returns 0 when it does not apply (or the scratch buffer cannot be had). */
static int sgemm_transposed(int ta, int tb, i64 M, i64 N, i64 K, float alpha, const float* A,
                            i64 lda, const float* B, i64 ldb, float beta, float* C, i64 ldc) {
  int max_rows = atomic_load_explicit(&transpose_max_rows, memory_order_relaxed);
  if (M < 3 || M > max_rows || N < TRANSPOSE_MIN_COLS || K < 1) return 0;
  float* D = malloc((size_t)N * (size_t)M * sizeof(float));
  if (!D) return 0;
  int flip_a = ta == NO_TRANS ? TRANS : NO_TRANS;
  int flip_b = tb == NO_TRANS ? TRANS : NO_TRANS;
  p_sgemm(ROW_MAJOR, flip_b, flip_a, N, M, K, alpha, B, ldb, A, lda, 0.0f, D, M);
  for (i64 i = 0; i < M; ++i) {
    float* c = C + i * ldc;
    const float* d = D + i;
    if (beta == 0.0f) {
      for (i64 j = 0; j < N; ++j) c[j] = d[j * M];
    } else {
      for (i64 j = 0; j < N; ++j) c[j] = d[j * M] + beta * c[j];
    }
  }
  free(D);
  return 1;
}

/* Row-major C[M,N] = alpha A[M,K] B[N,K]^T + beta C with A's and B's rows
 * contiguous: the few-row kernel (blas_few_rows.c). Returns 0 when it does
 * not apply. */
static int sgemm_few_rows(int ta, int tb, i64 M, i64 N, i64 K, float alpha, const float* A,
                          i64 lda, const float* B, i64 ldb, float beta, float* C, i64 ldc) {
  int max_rows = few_rows_bound();
  int min_rows = atomic_load_explicit(&few_rows_min, memory_order_relaxed);
  if (ta != NO_TRANS || tb != TRANS || M < min_rows || M > max_rows || N < 2 || K < 8) return 0;
  if (!few_rows_cpu_supported()) return 0;
  /* The automatic bound's 33-64 rows: layer-sized weights only (an output head of
   * 49k rows at 64 rows is compute-bound, where OpenBLAS's packed sgemm is faster). */
  if (M > FEW_ROWS_ALL_WEIGHTS && atomic_load_explicit(&few_rows_max, memory_order_relaxed) < 0 &&
      N * K > FEW_ROWS_WIDE_MAX_WEIGHTS)
    return 0;
  few_rows_sgemm(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  return 1;
}

typedef struct {
  int ta, tb, M, K, lda, ldb, ldc;
  float alpha, beta;
  const float* A;
  const float* B;
  float* C;
} LargeJob;

static void large_columns(const void* ctx, i64 n0, i64 n1) {
  const LargeJob* j = (const LargeJob*)ctx;
  const float* b = j->tb == NO_TRANS ? j->B + n0 : j->B + n0 * j->ldb; /* [K,N] or [N,K] */
  p_large(ROW_MAJOR, j->ta, j->tb, j->M, (int)(n1 - n0), j->K, j->alpha, j->A, j->lda, b, j->ldb,
          j->beta, j->C + n0, j->ldc);
}

/* Row-major C[M,N] = alpha op(A) op(B) + beta C with M >= large_min_rows on
 * the large-product library, C's columns split over the pool (each slice a
 * single-threaded sgemm of the same rows). Returns 0 when it does not apply. */
static int sgemm_large(int ta, int tb, i64 M, i64 N, i64 K, float alpha, const float* A, i64 lda,
                       const float* B, i64 ldb, float beta, float* C, i64 ldc) {
  int min_rows = atomic_load_explicit(&large_min_rows, memory_order_relaxed);
  if (!p_large || min_rows < 1 || M < min_rows || N < 1 || K < 1) return 0;
  LargeJob job = {ta, tb, (int)M, (int)K, (int)lda, (int)ldb, (int)ldc, alpha, beta, A, B, C};
  pool_columns(large_columns, &job, N);
  return 1;
}

EXPORT void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha,
                        const float* A, int lda, const float* B, int ldb, float beta, float* C,
                        int ldc) {
  if (!p_sgemm) not_initialized("cblas_sgemm");
  if (ta == CONJ_TRANS) ta = TRANS;
  if (tb == CONJ_TRANS) tb = TRANS;
  /* Column-major C = op(A) op(B) is row-major C^T = op(B)^T op(A)^T. */
  int row = order == ROW_MAJOR;
  if (row ? sgemm_few_rows(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)
          : (order == COL_MAJOR && sgemm_few_rows(tb, ta, N, M, K, alpha, B, ldb, A, lda, beta, C, ldc))) {
    atomic_fetch_add_explicit(&n_few_rows, 1, memory_order_relaxed);
    return;
  }
  if ((order == ROW_MAJOR || order == COL_MAJOR) &&
      (row ? sgemm_as_gemv(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)
           : sgemm_as_gemv(tb, ta, N, M, K, alpha, B, ldb, A, lda, beta, C, ldc))) {
    atomic_fetch_add_explicit(&n_sgemv, 1, memory_order_relaxed);
    return;
  }
  if (row && sgemm_transposed(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) {
    atomic_fetch_add_explicit(&n_transposed, 1, memory_order_relaxed);
    return;
  }
  if (row ? sgemm_large(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)
          : (order == COL_MAJOR && sgemm_large(tb, ta, N, M, K, alpha, B, ldb, A, lda, beta, C, ldc))) {
    atomic_fetch_add_explicit(&n_large, 1, memory_order_relaxed);
    return;
  }
  atomic_fetch_add_explicit(&n_sgemm, 1, memory_order_relaxed);
  p_sgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

EXPORT void cblas_dgemm(int order, int ta, int tb, int M, int N, int K, double alpha,
                        const double* A, int lda, const double* B, int ldb, double beta,
                        double* C, int ldc) {
  if (!p_dgemm) not_initialized("cblas_dgemm");
  atomic_fetch_add_explicit(&n_dgemm, 1, memory_order_relaxed);
  p_dgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

EXPORT void cblas_cgemm(int order, int ta, int tb, int M, int N, int K, const void* alpha,
                        const void* A, int lda, const void* B, int ldb, const void* beta,
                        void* C, int ldc) {
  if (!p_cgemm) not_initialized("cblas_cgemm");
  atomic_fetch_add_explicit(&n_cgemm, 1, memory_order_relaxed);
  p_cgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
