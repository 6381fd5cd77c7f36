// One pre-norm decoder layer of the llama shape as one primitive for MLX's
// CPU device:
//
//   h   = x + o_proj(attention(rope(q), cache <- (rope(k), v)))
//         where q, k, v = split(qkv_proj(rms_norm(x, input_norm)))
//   out = h + down_proj(silu(gate) * up)
//         where gate, up = split(gate_up_proj(rms_norm(h, post_norm)))
//
// On MLX's CPU device each operation of a layer (~36 graph nodes of a
// decode step's layer: products, norms, views, copies, adds) is built in
// Python, evaluated on the thread running mx.eval, and dispatched as a task
// of its own to the stream's thread. This primitive is one node and one
// task a layer. Inside it runs exactly what those nodes ran, in the same
// order: vllm-metal's RMSNorm, RoPE + KV write, paged attention and SwiGLU
// kernels, and the process's cblas_sgemm (the symbol MLX's own products
// call, found at run time: the BLAS shim of fast_blas.py, or the system
// BLAS) with MLX's arguments, so the output has the layer's bits. The
// caches are written in place when MLX lets their buffers be donated
// (nothing else holds them), as RopeWriteKV does; otherwise the outputs are
// copies. float32 only. On Metal, eval_gpu refuses, naming what to call:
// vllm_metal.native.ops.decoder_layer composes MLX's own kernels there.
#pragma once

#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace vllm_metal {

namespace mx = mlx::core;

struct DecoderLayerParams {
  int heads;
  int kv_heads;
  int head_dim;
  float input_eps;  // RMSNorm eps before attention
  float post_eps;  // RMSNorm eps before the MLP
  float scale;  // attention score scale
  int sliding_window;  // <= 0: off
  bool traditional;  // RoPE pairs (2i, 2i + 1) instead of (i, i + rotated / 2)
  bool in_place = false;  // the caches' outputs always take the inputs' buffers (an alias write, op_util.h)

  bool operator==(const DecoderLayerParams&) const = default;
};

// x [..., hidden] float32 (any layout); input_norm and post_norm [hidden];
// qkv_weight [(heads + 2 kv_heads) * head_dim, hidden] (q rows, then k,
// then v); table float32 [tokens, rotated / 2, 2] (rope()); key_cache and
// value_cache [num_blocks, block_size, kv_heads, head_dim]; slots int32
// [tokens] (rope_write_kv(): outside the cache, no write); block_tables,
// seq_lens, cu_seqlens_q as paged_attention() takes them; o_weight
// [hidden, heads * head_dim]; gate_up_weight [2 * ffn, hidden] (gate rows,
// then up); down_weight [hidden, ffn]. Every array float32 except the
// int32 index arrays. Returns the lazy {out (x's shape), key_cache',
// value_cache'}. Shapes and dtypes are checked here (std::invalid_argument);
// the index data at eval, as paged_attention() does.
std::vector<mx::array> decoder_layer(const mx::array& x, const mx::array& input_norm, const mx::array& qkv_weight,
                                     const mx::array& table, const mx::array& key_cache,
                                     const mx::array& value_cache, const mx::array& slots,
                                     const mx::array& block_tables, const mx::array& seq_lens,
                                     const mx::array& cu_seqlens_q, const mx::array& o_weight,
                                     const mx::array& post_norm, const mx::array& gate_up_weight,
                                     const mx::array& down_weight, const DecoderLayerParams& params,
                                     mx::StreamOrDevice s = {});

// The file of the cblas_sgemm the primitive calls ("" if none is loaded).
std::string decoder_layer_blas();

class DecoderLayer : public mx::Primitive {
 public:
  DecoderLayer(mx::Stream stream, DecoderLayerParams params) : mx::Primitive(stream), params_(params) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[kX].shape(), inputs[kKeyCache].shape(), inputs[kValueCache].shape()};
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return params_ == static_cast<const DecoderLayer&>(other).params_;
  }
  const char* name() const override {
    return "DecoderLayer";
  }

  // Input positions (the order decoder_layer() takes them in).
  static constexpr int kX = 0;
  static constexpr int kInputNorm = 1;
  static constexpr int kQkv = 2;
  static constexpr int kTable = 3;
  static constexpr int kKeyCache = 4;
  static constexpr int kValueCache = 5;
  static constexpr int kSlots = 6;
  static constexpr int kBlockTables = 7;
  static constexpr int kSeqLens = 8;
  static constexpr int kCuSeqlens = 9;
  static constexpr int kO = 10;
  static constexpr int kPostNorm = 11;
  static constexpr int kGateUp = 12;
  static constexpr int kDown = 13;

 private:
  DecoderLayerParams params_;
};

} // namespace vllm_metal
