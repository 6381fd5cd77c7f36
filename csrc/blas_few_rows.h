/* Between blas_shim.c and its few-row kernel (blas_few_rows.c). */
#pragma once

#include <stdatomic.h>
#include <stdint.h>

#define EXPORT __attribute__((visibility("default")))

typedef int64_t i64;

/* 1 when this CPU runs the kernel (AVX2 and FMA). */
int few_rows_cpu_supported(void);

/* The most rows sent to the kernel by default (few_rows_max -1): 64 where its
 * AVX-512 path runs (33-64 only for weights of at most FEW_ROWS_WIDE_MAX_WEIGHTS
 * floats: blas_shim.c), 16 on its AVX2 path, 0 where it does not run. Measured
 * in docs/benchmarks.md#blas-shim: past those OpenBLAS's packed sgemm is as fast
 * or faster on a quiet machine, and the kernel's pool holds up better when
 * another process wants a core (served concurrency 64 on the tiny llama). */
int few_rows_auto_max(void);

/* Rows every weight runs on the kernel with the automatic bound (AVX-512); past
 * them, up to few_rows_auto_max(), only weights of at most this many floats. */
enum { FEW_ROWS_ALL_WEIGHTS = 32 };
#define FEW_ROWS_WIDE_MAX_WEIGHTS ((i64)4 << 20)

/* Row-major C[M,N] = alpha A[M,K] B[N,K]^T + beta C (beta 0: C not read),
 * A's and B's rows contiguous (strides lda, ldb), K >= 8; only where
 * few_rows_cpu_supported(). One call at a time runs; others wait. */
void few_rows_sgemm(i64 M, i64 N, i64 K, float alpha, const float* A, i64 lda, const float* B,
                    i64 ldb, float beta, float* C, i64 ldc);

/* Columns [n0, n1) of a product whose columns the pool splits. */
typedef void (*columns_fn)(const void* ctx, i64 n0, i64 n1);

/* Runs fn over the columns [0, N) on the few-row kernel's pool: one slice of
 * whole multiples of 8 columns per thread (the caller takes any slice a busy
 * worker has not started). One call at a time runs (few_rows_sgemm's too). */
void pool_columns(columns_fn fn, const void* ctx, i64 N);

/* Slices the calling thread computed for a pool worker that had not taken
 * them yet (its core busy elsewhere): vllm_metal_blas_shim_calls(6). */
extern atomic_llong few_rows_taken_over;
