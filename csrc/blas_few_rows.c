/* The BLAS shim's few-row kernel (blas_shim.c sends it row-major
 * x[M,K] @ W[N,K]^T with 1..32 rows): W read once, two rows at a time against
 * all M rows of x (in cache), 4 x 2 outputs in AVX2 registers, the columns
 * split over a small pthread pool (one thread per usable core, the caller
 * included; set_threads), restarted in a fork's child. Each output is one
 * dot product of 8- or 16-lane partial sums in a fixed order (which path
 * computes a column depends only on N and M): it does not depend on the
 * threads or on the other rows of the call. */
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
#include "blas_few_rows_kernels.h"

/* A pool of helper threads (cores - 1; the caller is worker 0). A call
 * publishes its job under the lock, bumps the generation and wakes them; each
 * worker w takes the w-th slice of the columns, unless the caller, done with
 * slice 0, took it first; the caller then waits for the slices taken. */
enum { MAX_THREADS = 64 };
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER, pool_done = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
static int pool_threads = 0;  /* total workers incl. the caller; 0: not started */
static int pool_requested = 0; /* set_threads value; 0: the CPUs this process may use */
static int pool_workers = 0;   /* slices of the current job */
static long pool_generation = 0;
/* Mirror of the above, read without the lock by the workers' bounded spin. */
static atomic_long pool_generation_seen = 0;
/* Slice w of job g is computed by whoever first moves slice_owner[w] to g:
 * its worker, or the caller once done with its own slice (a worker slow to
 * wake, its core taken by another process, then holds nothing up). */
static atomic_long slice_owner[MAX_THREADS];
static atomic_int slices_done = 0;
atomic_llong few_rows_taken_over = 0; /* slices the caller took from a late worker */
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

static int spin_until_equal(atomic_int* value, int want) {
  const i64 until = now_ns() + CALLER_SPIN_NS;
  for (int i = 0;; ++i) {
    if (atomic_load_explicit(value, memory_order_acquire) == want) return 1;
    cpu_relax();
    if ((i & 63) == 63 && now_ns() > until) return 0;
  }
}

/* 1 when this thread takes slice w of job g (nobody took it for g yet). A
 * worker still holding an older job never takes a slice: by the time its
 * job ended, every slice of it had an owner of that job or a newer one. */
static int claim_slice(int w, long g) {
  long cur = atomic_load_explicit(&slice_owner[w], memory_order_acquire);
  while (cur < g) {
    if (atomic_compare_exchange_weak_explicit(&slice_owner[w], &cur, g, memory_order_acq_rel,
                                              memory_order_acquire))
      return 1;
  }
  return 0;
}

static void slice_done(int workers) {
  if (atomic_fetch_add_explicit(&slices_done, 1, memory_order_acq_rel) + 1 == workers) {
    pthread_mutex_lock(&pool_lock);
    pthread_cond_signal(&pool_done);
    pthread_mutex_unlock(&pool_lock);
  }
}
static FewRowsJob pool_job;

/* Worker w's columns: even slices in whole multiples of 8 columns, so which
 * kernel path computes a column (AVX2: 8-row blocks, then 4, pairs, singles;
 * on AVX-512 every path sums a column the same way anyway) depends only on
 * N, never on the number of threads: the same bits with any pool size.
 * (Handing out smaller chunks from a counter, so that a preempted thread
 * holds up only its chunk, measured ~10% slower at 8 rows when quiet;
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
  if (n0 >= n1) return;
  if (j->fn) {
    j->fn(j->ctx, n0, n1);
    return;
  }
#if defined(__x86_64__)
  few_rows_range(j, n0, n1);
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
    const int workers = pool_workers;
    pthread_mutex_unlock(&pool_lock);
    if (w < workers && claim_slice(w, seen)) {
      run_slice(&job, w, workers);
      slice_done(workers);
    }
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
  pool_workers = 0;
  atomic_store(&pool_generation_seen, 0);
  for (int w = 0; w < MAX_THREADS; ++w) atomic_store(&slice_owner[w], 0);
  atomic_store(&slices_done, 0);
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

int few_rows_auto_max(void) {
#if defined(__x86_64__)
  return !few_rows_cpu_supported() ? 0 : avx512_allowed() ? 64 : 16;
#else
  return 0;
#endif
}


/* Runs `job` split over the pool (want_pool, and more than one thread) or on
 * the caller alone. */
static void pool_run(const FewRowsJob* job, int want_pool) {
  pthread_mutex_lock(&call_lock);
  pthread_mutex_lock(&pool_lock);
  pool_start_locked();
  const int workers = pool_threads;
  const int use_pool = workers > 1 && want_pool;
  long gen = 0;
  if (use_pool) {
    pool_job = *job;
    pool_workers = workers;
    atomic_store_explicit(&slices_done, 0, memory_order_release);
    gen = ++pool_generation;
    atomic_store_explicit(&pool_generation_seen, gen, memory_order_release);
    pthread_cond_broadcast(&pool_wake);
  }
  pthread_mutex_unlock(&pool_lock);
  if (!use_pool) {
    run_slice(job, 0, 1);
  } else {
    /* Slice 0, then any slice whose worker has not taken it yet. */
    for (int w = 0; w < workers; ++w) {
      if (claim_slice(w, gen)) {
        if (w > 0) atomic_fetch_add_explicit(&few_rows_taken_over, 1, memory_order_relaxed);
        run_slice(job, w, workers);
        slice_done(workers);
      }
    }
    if (!spin_until_equal(&slices_done, workers)) {
      pthread_mutex_lock(&pool_lock);
      while (atomic_load_explicit(&slices_done, memory_order_acquire) != workers)
        pthread_cond_wait(&pool_done, &pool_lock);
      pthread_mutex_unlock(&pool_lock);
    }
  }
  pthread_mutex_unlock(&call_lock);
}

void pool_columns(columns_fn fn, const void* ctx, i64 N) {
  FewRowsJob job = {0};
  job.N = N;
  job.fn = fn;
  job.ctx = ctx;
  pool_run(&job, 1);
}

void few_rows_sgemm(i64 M, i64 N, i64 K, float alpha, const float* A, i64 lda, const float* B,
                    i64 ldb, float beta, float* C, i64 ldc) {
  FewRowsJob job = {M, N, K, lda, ldb, ldc, alpha, beta, A, B, C, NULL, NULL};
  /* Products under ~1M multiply-adds run on the caller alone: a decode
   * step's 576 x 576 product took 0.031 ms there and 0.11 ms on two threads
   * (the wake-up and the join cost more than half the product); from about
   * 1M (576 x 1536) the two are even, and the pool wins from there (48k x 576:
   * 4.8 against 9.5 ms). Those were timed with W in cache. One or two rows
   * are bound by reading W, which in a model's decode step comes from memory
   * (the layers' weights outgrow the caches): from 256 KiB of W the pool's
   * second stream wins (a 30-layer chain of SmolLM2's batch-1 products, 4
   * per layer, 2.2-7 MB each: 28.5 -> 22.1 ms; docs/benchmarks.md#blas-shim). */
  pool_run(&job, M * N * K >= (1 << 20) || (M <= 2 && N * K * 4 >= (256 << 10)));
}
