/* The BLAS shim's few-row kernel (blas_shim.c sends it row-major
 * x[M,K] @ W[N,K]^T with 3..8 rows): W read once, two rows at a time against
 * all M rows of x (in cache), 4 x 2 outputs in AVX2 registers, the columns
 * split over a small pthread pool (one thread per usable core,
 * the caller included; set_threads), restarted in a fork's child. Each output is one
 * dot product of 8-lane partial sums in a fixed order: it does not depend on
 * the threads or on the other rows of the call. */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
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

/* Columns [n0, n1) of C: W's rows two at a time against A's rows four at a
 * time (8 accumulators in registers), then single rows; K's tail (K % 8)
 * in scalars. */
#ifndef PF_PAIRS_AHEAD
#define PF_PAIRS_AHEAD 2
#endif
#define DOT_TAIL(d, a, w) for (i64 k = K8; k < K; ++k) d += (a)[k] * (w)[k]

/* One row of A (decode at batch 1) on AVX-512: eight W rows at a time, each
 * its own FMA chain of 16-lane partial sums (K's tail through a masked load).
 * Bound by reading W: the next eight rows are prefetched into L2 meanwhile
 * (Prefetch above). Returns the first column it did not do. */
__attribute__((target("avx512f,avx512vl,avx512dq,fma"))) static i64 one_row_avx512(const FewRowsJob* j, i64 n0,
                                                                                   i64 n1) {
  const i64 K = j->K, K16 = K & ~(i64)15;
  const __mmask16 tail = (__mmask16)((1u << (K - K16)) - 1u);
  const float* a = j->A;
  i64 n = n0;
  for (; n + 8 <= n1; n += 8) {
    const float* w = j->B + n * j->ldb;
    const i64 ld = j->ldb;
    __m512 c[8];
    for (int r = 0; r < 8; ++r) c[r] = _mm512_setzero_ps();
    Prefetch f = prefetch_plan(w + 8 * ld, n + 16 <= n1 ? 8 * ld * 4 : 0, K16 / 16);
    for (i64 k = 0; k < K16; k += 16) {
      const __m512 v = _mm512_loadu_ps(a + k);
      prefetch_next(&f);
      for (int r = 0; r < 8; ++r) {
        c[r] = _mm512_fmadd_ps(v, _mm512_loadu_ps(w + r * ld + k), c[r]);
      }
    }
    if (tail) {
      const __m512 v = _mm512_maskz_loadu_ps(tail, a + K16);
      for (int r = 0; r < 8; ++r) c[r] = _mm512_fmadd_ps(v, _mm512_maskz_loadu_ps(tail, w + r * ld + K16), c[r]);
    }
    for (int r = 0; r < 8; ++r) store_out(j, 0, n + r, _mm512_reduce_add_ps(c[r]));
  }
  return n;
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
  if (j->M == 1 && avx512_allowed()) n = one_row_avx512(j, n0, n1);
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
    /* The pair PF_PAIRS_AHEAD pairs on, over the first k loop below. */
    Prefetch f = prefetch_plan(w0 + 2 * PF_PAIRS_AHEAD * j->ldb,
                               n + 2 * (PF_PAIRS_AHEAD + 1) <= n1 ? 2 * j->ldb * 4 : 0, K8 / 8);
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

/* A pool of helper threads (cores - 1; the caller is the last worker). A call
 * publishes its job under the lock, bumps the generation and wakes them; each
 * worker w takes the w-th slice of the columns; the caller waits for all. */
enum { MAX_THREADS = 64 };
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER, pool_done = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
static int pool_threads = 0;  /* total workers incl. the caller; 0: not started */
static int pool_requested = 0; /* set_threads value; 0: the CPUs this process may use */
static long pool_generation = 0;
static int pool_pending = 0;
/* Mirrors of the two above, read without the lock by the bounded spins. */
static atomic_long pool_generation_seen = 0;
static atomic_int pool_pending_seen = 0;
/* A waiting caller spins up to CALLER_SPIN_NS for the workers to finish (its
 * core has nothing else to do: the MLX stream waits for this product), and a
 * worker up to WORKER_SPIN_NS for the next job before sleeping on the
 * condition variable. The worker's spin is short: on two cores, Python's
 * main thread builds the next graph between evaluations and needs the core
 * a spinning worker would hold. Both bounded, so an idle pool or a busy
 * machine costs at most this per call, never a spinning core (OpenBLAS's
 * spinning threads collapse when another process wants the core; measured in
 * docs/benchmarks.md). */
enum { CALLER_SPIN_NS = 50000, WORKER_SPIN_NS = 10000 };

static i64 now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (i64)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

/* Spins until *value != old (1) or SPIN_NS passed (0). */
static int spin_while_long(atomic_long* value, long old) {
  const i64 until = now_ns() + WORKER_SPIN_NS;
  for (int i = 0;; ++i) {
    if (atomic_load_explicit(value, memory_order_acquire) != old) return 1;
    cpu_relax();
    if ((i & 63) == 63 && now_ns() > until) return 0;
  }
}

static int spin_until_zero(atomic_int* value) {
  const i64 until = now_ns() + CALLER_SPIN_NS;
  for (int i = 0;; ++i) {
    if (atomic_load_explicit(value, memory_order_acquire) == 0) return 1;
    cpu_relax();
    if ((i & 63) == 63 && now_ns() > until) return 0;
  }
}
static FewRowsJob pool_job;

/* Worker w's columns: even slices in whole multiples of 8 columns, so which
 * kernel path computes a column (8-row blocks, then 4, pairs, singles)
 * depends only on N, never on the number of threads: the same bits with any
 * pool size. (Handing out smaller chunks from a counter, so that a preempted
 * thread holds up only its chunk, measured ~10% slower at 8 rows when quiet;
 * docs/benchmarks.md#blas-shim.) */
static void slice(int w, int workers, i64 N, i64* n0, i64* n1) {
  const i64 blocks = (N + 7) / 8;
  *n0 = 8 * (blocks * w / workers);
  *n1 = 8 * (blocks * (w + 1) / workers);
  if (*n1 > N) *n1 = N;
  if (*n0 > N) *n0 = N;
}

static void run_slice(const FewRowsJob* j, int w, int workers) {
  i64 n0, n1;
  slice(w, workers, j->N, &n0, &n1);
#if defined(__x86_64__)
  if (n0 < n1) few_rows_range(j, n0, n1);
#endif
}

static void* pool_main(void* arg) {
  const int w = (int)(intptr_t)arg;
  long seen = 0;
  for (;;) {
    spin_while_long(&pool_generation_seen, seen);
    pthread_mutex_lock(&pool_lock);
    while (pool_generation == seen) pthread_cond_wait(&pool_wake, &pool_lock);
    seen = pool_generation;
    FewRowsJob job = pool_job;
    const int workers = pool_threads;
    pthread_mutex_unlock(&pool_lock);
    run_slice(&job, w, workers);
    pthread_mutex_lock(&pool_lock);
    atomic_store_explicit(&pool_pending_seen, pool_pending - 1, memory_order_release);
    if (--pool_pending == 0) pthread_cond_signal(&pool_done);
    pthread_mutex_unlock(&pool_lock);
  }
  return NULL;
}

static int usable_cpus(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

/* Starts the pool on first use (not in a fork's child: its threads would be gone). */
static void pool_start_locked(void) {
  if (pool_threads) return;
  int want = pool_requested > 0 ? pool_requested : usable_cpus();
  if (want > MAX_THREADS) want = MAX_THREADS;
  int started = 1;
  for (int w = 1; w < want; ++w) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, pool_main, (void*)(intptr_t)w) == 0) ++started;
    pthread_attr_destroy(&attr);
    if (started != w + 1) break;
  }
  pool_threads = started;
}

static void pool_reset_after_fork(void) {
  /* The child has only the forking thread: start a new pool on first use. */
  pthread_mutex_init(&pool_lock, NULL);
  pthread_mutex_init(&call_lock, NULL);
  pthread_cond_init(&pool_wake, NULL);
  pthread_cond_init(&pool_done, NULL);
  pool_threads = 0;
  pool_generation = 0;
  pool_pending = 0;
  atomic_store(&pool_generation_seen, 0);
  atomic_store(&pool_pending_seen, 0);
}

__attribute__((constructor)) static void register_fork_handler(void) {
  pthread_atfork(NULL, NULL, pool_reset_after_fork);
}

/* Threads the few-row kernel uses (caller included); 0: the CPUs this process
 * may use. Takes effect when the pool starts (its first call); returns the
 * number running (0: not started yet). */
EXPORT int vllm_metal_blas_shim_set_threads(int threads) {
  pthread_mutex_lock(&pool_lock);
  pool_requested = threads < 0 ? 0 : threads;
  int running = pool_threads;
  pthread_mutex_unlock(&pool_lock);
  return running;
}

int few_rows_cpu_supported(void) {
#if defined(__x86_64__)
  static int cached = -1;
  if (cached < 0) {
    __builtin_cpu_init();
    cached = isa_cap_level() >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
  return cached;
#else
  return 0;
#endif
}

/* 1 when this CPU can run the few-row kernel (AVX2 and FMA). */
EXPORT int vllm_metal_blas_shim_few_rows_supported(void) { return few_rows_cpu_supported(); }


void few_rows_sgemm(i64 M, i64 N, i64 K, float alpha, const float* A, i64 lda, const float* B,
                    i64 ldb, float beta, float* C, i64 ldc) {
  FewRowsJob job = {M, N, K, lda, ldb, ldc, alpha, beta, A, B, C};
  pthread_mutex_lock(&call_lock);
  pthread_mutex_lock(&pool_lock);
  pool_start_locked();
  const int workers = pool_threads;
  /* Products under ~1M multiply-adds run on the caller alone: a decode
   * step's 576 x 576 product took 0.031 ms there and 0.11 ms on two threads
   * (the wake-up and the join cost more than half the product); from about
   * 1M (576 x 1536) the two are even, and the pool wins from there (48k x 576:
   * 4.8 against 9.5 ms). Those were timed with W in cache. One or two rows
   * are bound by reading W, which in a model's decode step comes from memory
   * (the layers' weights outgrow the caches): from 256 KiB of W the pool's
   * second stream wins (a 30-layer chain of SmolLM2's batch-1 products, 4
   * per layer, 2.2-7 MB each: 28.5 -> 22.1 ms; docs/benchmarks.md#blas-shim). */
  const int use_pool = workers > 1 && (M * N * K >= (1 << 20) || (M <= 2 && N * K * 4 >= (256 << 10)));
  if (use_pool) {
    pool_job = job;
    pool_pending = workers - 1;
    atomic_store_explicit(&pool_pending_seen, pool_pending, memory_order_release);
    ++pool_generation;
    atomic_store_explicit(&pool_generation_seen, pool_generation, memory_order_release);
    pthread_cond_broadcast(&pool_wake);
  }
  pthread_mutex_unlock(&pool_lock);
  run_slice(&job, 0, use_pool ? workers : 1);
  if (use_pool) {
    spin_until_zero(&pool_pending_seen);
    pthread_mutex_lock(&pool_lock);
    while (pool_pending > 0) pthread_cond_wait(&pool_done, &pool_lock);
    pthread_mutex_unlock(&pool_lock);
  }
  pthread_mutex_unlock(&call_lock);
}
