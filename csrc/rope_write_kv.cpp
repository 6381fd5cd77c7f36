// The RoPE + KV-write op (validation, the lazy arrays). eval_gpu: rope_write_kv_metal.cpp
// (the write-only form on Metal) or rope_write_kv_no_metal.cpp.
#include "rope_write_kv.h"

#include <sstream>
#include <stdexcept>
#include <string>

#include "mlx/ops.h"

namespace vllm_metal {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[rope_write_kv] " + what);
}

} // namespace

std::vector<mx::array> rope_write_kv(const mx::array& q, const mx::array& k, const mx::array& v,
                                     const mx::array& table, const mx::array& key_cache,
                                     const mx::array& value_cache, const mx::array& slots, bool traditional,
                                     bool in_place, mx::StreamOrDevice s) {
  std::ostringstream os;
  if (q.ndim() != 3 || k.ndim() != 3 || v.ndim() != 3) {
    os << "q, k and v must be [tokens, heads, dim], got " << q.shape() << ", " << k.shape() << ", " << v.shape();
    fail(os.str());
  }
  const auto tokens = q.shape(0);
  const auto dim = q.shape(2);
  if (k.shape() != v.shape() || k.shape(0) != tokens || k.shape(2) != dim) {
    os << "k and v must be [" << tokens << ", kv_heads, " << dim << "] to match q " << q.shape() << ", got "
       << k.shape() << " and " << v.shape();
    fail(os.str());
  }
  const auto dtype = q.dtype();
  if (dtype != mx::float32 && dtype != mx::float16 && dtype != mx::bfloat16) {
    fail("q must be float32, float16 or bfloat16");
  }
  if (k.dtype() != dtype || v.dtype() != dtype) {
    fail("k and v must have q's dtype");
  }
  if (table.ndim() != 3 || table.shape(0) != tokens || table.shape(2) != 2 || table.shape(1) < 0 ||
      2 * table.shape(1) > dim || table.dtype() != mx::float32) {
    os << "table must be float32 [tokens, rotated / 2, 2] with tokens = " << tokens << " and rotated <= dim = "
       << dim << ", got " << table.shape() << " " << table.dtype();
    fail(os.str());
  }
  if (key_cache.ndim() != 4 || key_cache.shape(2) != k.shape(1) || key_cache.shape(3) != dim) {
    os << "key_cache must be [num_blocks, block_size, " << k.shape(1) << ", " << dim << "], got "
       << key_cache.shape();
    fail(os.str());
  }
  if (value_cache.shape() != key_cache.shape() || key_cache.dtype() != dtype || value_cache.dtype() != dtype) {
    os << "value_cache " << value_cache.shape() << " must match key_cache " << key_cache.shape()
       << ", both of q's dtype";
    fail(os.str());
  }
  if (slots.ndim() != 1 || slots.shape(0) != tokens || slots.dtype() != mx::int32) {
    os << "slots must be int32 [" << tokens << "], got " << slots.shape() << " " << slots.dtype();
    fail(os.str());
  }
  auto stream = mx::to_stream(s);
  // q, k and v are read in any layout and the caches taken as they come, so
  // that nothing else holds a cache's buffer and it can be written in place.
  std::vector<mx::array> inputs = {q, k, v, mx::contiguous(table, false, stream), key_cache, value_cache,
                                   mx::contiguous(slots, false, stream)};
  return mx::array::make_arrays({q.shape(), key_cache.shape(), value_cache.shape()}, {dtype, dtype, dtype},
                                std::make_shared<RopeWriteKV>(stream, traditional, in_place), std::move(inputs));
}

} // namespace vllm_metal
