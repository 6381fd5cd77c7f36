// The cblas_sgemm the DecoderLayer primitive calls: the one MLX's own CPU
// products bind (the first in the process's global scope), found once.
#pragma once

namespace vllm_metal {

// LP64 CBLAS cblas_sgemm(order, trans_a, trans_b, M, N, K, alpha, A, lda, B,
// ldb, beta, C, ldc); the enums as ints (identical in every CBLAS).
using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                         int);
constexpr int kCblasRowMajor = 101;
constexpr int kCblasNoTrans = 111;
constexpr int kCblasTrans = 112;

// nullptr when no BLAS is loaded.
SgemmFn decoder_layer_sgemm();

} // namespace vllm_metal
