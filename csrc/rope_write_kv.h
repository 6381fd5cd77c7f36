// RoPE of a step's queries and keys and the keys' and values' cache write,
// as one primitive for MLX's CPU device.
//
// A decoder layer's attention inputs were five MLX operations apart from the
// views: RoPE of q, RoPE of k (each first copying its strided column slice
// of the fused q/k/v product), and two scatters into the caches. On MLX's
// CPU device each dispatched operation costs ~8 us beside its arithmetic
// (a decode step of a 30-layer model: ~80 us a layer). This primitive reads
// q, k and v where they lie, writes the rotated queries, and rotates each
// key and copies each value straight into its cache slot. The caches are
// written in place when MLX lets their buffers be donated (nothing else
// holds them, as with the scatter it replaces); otherwise the output is a
// copy. On Metal the adapter keeps MLX's fused RoPE and scatter; eval_gpu
// (rope_write_kv_metal.cpp) runs only the write-only form (a table of no
// pairs: kv_writes.write_kv(..., in_place=True), the alias write of layers
// sharing a KV tensor) as the Metal kernel of metal/write_kv.metal, and
// refuses RoPE, naming MLX's.
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace vllm_metal {

namespace mx = mlx::core;

// q [tokens, heads, dim], k and v [tokens, kv_heads, dim] (float32, float16
// or bfloat16, one dtype; any layout); table float32 [tokens, rotated / 2,
// 2] as for rope(); key_cache and value_cache [num_blocks, block_size,
// kv_heads, dim] of q's dtype; slots int32 [tokens]: a token's slot
// (block * block_size + offset), -1 (or anything outside the cache) for
// none. Returns the lazy {rotated q (row-contiguous), key_cache',
// value_cache'}. A table of no pairs ([tokens, 0, 2]) rotates nothing (a
// plain write). in_place: the caches' outputs always take the input caches'
// buffers (an alias write, take_cache_buffers), never a copy.
std::vector<mx::array> rope_write_kv(const mx::array& q, const mx::array& k, const mx::array& v,
                                     const mx::array& table, const mx::array& key_cache,
                                     const mx::array& value_cache, const mx::array& slots, bool traditional,
                                     bool in_place = false, mx::StreamOrDevice s = {});

class RopeWriteKV : public mx::Primitive {
 public:
  RopeWriteKV(mx::Stream stream, bool traditional, bool in_place = false)
      : mx::Primitive(stream), traditional_(traditional), in_place_(in_place) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[kKeyCache].shape(), inputs[kValueCache].shape()};
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RopeWriteKV&>(other);
    return traditional_ == o.traditional_ && in_place_ == o.in_place_;
  }
  const char* name() const override {
    return "RopeWriteKV";
  }

  static constexpr int kTable = 3;
  static constexpr int kKeyCache = 4;
  static constexpr int kValueCache = 5;
  static constexpr int kSlots = 6;

 private:
  bool traditional_;
  bool in_place_;
};

} // namespace vllm_metal
