// PagedAttention: a lazy, read-only MLX primitive that attends the packed new
// tokens of many sequences to their K/V stored in a paged (block) cache.
//
// One call serves decode, prefill and mixed batches ("varlen"): sequence s owns
// the query rows cu_seqlens_q[s] .. cu_seqlens_q[s+1]-1; its j-th new token sits
// at absolute position seq_lens[s] - n_s + j and attends causally to every
// cached and new position <= its own (optionally only the last sliding_window
// positions). With causal = false (encoders) it attends to every position of
// its sequence, below seq_lens[s] (optionally only those less than
// sliding_window away on either side). Softmax is accumulated in float32
// whatever the storage dtype.
//
// Optional: attention sinks (one extra logit per query head in the softmax
// denominator that contributes no value, as mx.fast.scaled_dot_product_attention
// and gpt-oss define them) and a value head size different from the key's
// (the values are the first v_head_dim entries of each value_cache row, which
// lets latent attention (MLA) pass one cache as both key_cache and value_cache).
#pragma once

#include <string>
#include <utility>

#include <optional>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace vllm_metal {

namespace mx = mlx::core;

// How the caches hold K and V: in q's dtype, or as 8-bit floats (uint8
// arrays of the bit patterns: OCP FP8 E4M3 "fn", finite, max 448; or E5M2,
// the top byte of a float16). An 8-bit cache is read as the stored value
// times one per-layer scale per cache; the caller folds the key scale into
// `scale` and applies the value scale to the output (vllm_metal.native.ops).
// kCacheFp8E4M3Row (vLLM's fp8_per_token_head): E4M3 codes, each row (one
// token, one KV head) followed by its own float32 scale (4 bytes, little
// endian): rows of head_dim + 4 (keys) and v_head_dim + 4 (values) bytes.
enum CacheFormat : int { kCacheAsQuery = 0, kCacheFp8E4M3 = 1, kCacheFp8E5M2 = 2, kCacheFp8E4M3Row = 3 };
constexpr int kRowScaleBytes = 4;

// Everything that is not an array input. sliding_window <= 0 and softcap <= 0
// mean "off". Sinks are an array input (the 7th, when present).
struct PagedAttentionParams {
  float scale;
  int sliding_window;
  float softcap;
  int v_head_dim;  // values per row read from value_cache (its first ones)
  int causal;      // 1: keys up to the row's own position; 0: the whole sequence
  int cache_format;  // CacheFormat

  bool operator==(const PagedAttentionParams&) const = default;
};

// Head dims and block sizes the kernels are instantiated for (CPU and Metal
// accept the same set so a model never runs on one backend only): key head
// dims 1..576 (MLA: kv_lora_rank 512 + rope 64) and value head dims 1..512,
// in any combination.
constexpr int kMaxHeadDim = 576;
constexpr int kMaxVHeadDim = 512;
bool is_supported_head_dim(int head_dim);
bool is_supported_v_head_dim(int v_head_dim);
bool is_supported_block_size(int block_size);

// Validates shapes/dtypes (std::invalid_argument -> Python ValueError) and
// returns the lazy output [num_tokens, num_heads, v_head_dim] in q's dtype.
// Inputs (in this order): q, key_cache, value_cache, block_tables, seq_lens,
// cu_seqlens_q[, sinks as float32]. Data-dependent checks (block ids,
// lengths) happen at eval. value_cache may be the same array as key_cache.
// cache_format: a CacheFormat; an 8-bit one takes uint8 caches.
mx::array paged_attention(
    const mx::array& q,
    const mx::array& key_cache,
    const mx::array& value_cache,
    const mx::array& block_tables,
    const mx::array& seq_lens,
    const mx::array& cu_seqlens_q,
    float scale,
    std::optional<int> sliding_window,
    std::optional<float> softcap,
    const std::optional<mx::array>& sinks = std::nullopt,
    std::optional<int> v_head_dim = std::nullopt,
    bool causal = true,
    int cache_format = kCacheAsQuery,
    mx::StreamOrDevice s = {});

// Invariant for every eval_* below: no encoder.add_temporary(). A temporary
// held by the command encoder outlives the fence that orders this primitive
// against later command buffers under lazy evaluation; all scratch memory is
// plain host memory owned by the eval itself (CPU) or threadgroup memory (GPU).
class PagedAttention : public mx::UnaryPrimitive {
 public:
  PagedAttention(mx::Stream stream, PagedAttentionParams params)
      : mx::UnaryPrimitive(stream), params_(params) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;
  bool is_equivalent(const mx::Primitive& other) const override;
  const char* name() const override {
    return "PagedAttention";
  }

  const PagedAttentionParams& params() const {
    return params_;
  }

  // Position of the optional sinks among the inputs.
  static constexpr int kSinksInput = 6;
  static bool has_sinks(const std::vector<mx::array>& inputs) {
    return inputs.size() > kSinksInput;
  }

 private:
  PagedAttentionParams params_;
};

// The CPU kernel variant this machine runs ("avx512", "avx2" or "generic"),
// chosen once from the instruction sets it supports.
std::string cpu_attention_variant();

// The best instruction set of those builds the CPU runs, uncapped.
std::string cpu_host_isa();

// Benchmark hook: the CPU kernel's rows per tile for prefill-class sequences
// and the tile of verify-class ones (tokens per tile, KV heads per unit); 0
// keeps the table's (cpu/paged_attention_tiles.h). Never set while serving.
void set_cpu_tile_override(int prefill_rows, int verify_tokens, int verify_kv_heads);

// The CPU tile table's verify tile for a call of `num_seqs` sequences at this
// key head dim: (tokens per tile, KV heads per unit), 0 meaning all (the
// table's entry, whatever the override).
std::pair<int, int> cpu_verify_tile(int head_dim, int num_seqs);

} // namespace vllm_metal
