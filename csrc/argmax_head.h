// Greedy output head: argmax over the vocabulary of hidden @ weight^T, row by
// row, as one primitive for MLX's CPU device.
//
// A greedy engine step needs each row's best token, not its logits. MLX's CPU
// device computes the [rows, vocab] logits through BLAS (~95 GFLOP/s on the
// thin K of a small model's head, the product written out to memory), then
// argmax reads them back one row at a time (64 rows x 49k: ~4 ms). This
// primitive keeps the logits in registers: for four vocabulary rows at a time
// it accumulates their dot products with sixteen hidden rows per vector (the
// hidden rows transposed once per call, the weight read in place, each
// element broadcast), then folds them into each row's running maximum. The
// threads split the vocabulary; the first index wins ties, as in argmax. On
// Metal, MLX's own matmul and argmax are fast: vllm_metal.native.ops.argmax_head
// builds them on GPU streams and this primitive only on CPU streams (its
// eval_gpu refuses, naming the op to call).
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

#include <optional>
#include <string>
#include <vector>
#include <utility>

namespace vllm_metal {

namespace mx = mlx::core;

// int32 [rows]: argmax_v sum_k hidden[r, k] * weight[v, k]. hidden [rows,
// hidden_size] and weight [vocab, hidden_size], both float32. Lazy. With the
// weight's screen (argmax_head_screen: weight, table) the CPU finds the same
// tokens through it where argmax_screen_available() (cpu/argmax_head_screen.h).
mx::array argmax_head(const mx::array& hidden, const mx::array& weight, const std::optional<mx::array>& screen_weight,
                      const std::optional<mx::array>& screen_table, mx::StreamOrDevice s = {});

// The screen of a float32 [vocab, hidden_size] head, built now (the weight is
// evaluated): its bfloat16 copy (uint16 bit patterns, the kernel's layout)
// and float32 per-token bound factors. Raises std::invalid_argument naming
// why a weight cannot be screened.
std::pair<mx::array, mx::array> argmax_head_screen(const mx::array& weight);

// The screened kernel's build this CPU runs: "avx512bf16", "avx2", or ""
// (none: the kernels capped to their generic build, or not x86-64).
std::string argmax_head_screen_build();

// The screened kernel's process-wide counts: {calls, rows, exact (candidate
// logits computed), declined (calls sent to the exact kernel)}.
std::vector<int64_t> argmax_head_screen_counters();

class ArgmaxHead : public mx::UnaryPrimitive {
 public:
  explicit ArgmaxHead(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0)}};
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
  const char* name() const override {
    return "ArgmaxHead";
  }
};

} // namespace vllm_metal
