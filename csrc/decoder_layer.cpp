// The decoder-layer op: shape and dtype checks, the lazy arrays, the BLAS
// it calls and its GPU refusal.
#include "decoder_layer.h"

#include <dlfcn.h>

#include <sstream>
#include <stdexcept>

#include "decoder_layer_blas.h"
#include "paged_attention.h"

namespace vllm_metal {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[decoder_layer] " + what);
}

void expect(const mx::array& a, const char* name, const mx::Shape& shape, mx::Dtype dtype) {
  if (a.shape() != shape || a.dtype() != dtype) {
    std::ostringstream os;
    os << name << " must be " << dtype << " " << shape << ", got " << a.dtype() << " " << a.shape();
    fail(os.str());
  }
}

} // namespace

SgemmFn decoder_layer_sgemm() {
  static const SgemmFn fn = reinterpret_cast<SgemmFn>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
  return fn;
}

std::string decoder_layer_blas() {
  Dl_info info{};
  auto fn = decoder_layer_sgemm();
  if (fn == nullptr || dladdr(reinterpret_cast<void*>(fn), &info) == 0 || info.dli_fname == nullptr) {
    return "";
  }
  return info.dli_fname;
}

std::vector<mx::array> decoder_layer(const mx::array& x, const mx::array& input_norm, const mx::array& qkv_weight,
                                     const mx::array& table, const mx::array& key_cache,
                                     const mx::array& value_cache, const mx::array& slots,
                                     const mx::array& block_tables, const mx::array& seq_lens,
                                     const mx::array& cu_seqlens_q, const mx::array& o_weight,
                                     const mx::array& post_norm, const mx::array& gate_up_weight,
                                     const mx::array& down_weight, const DecoderLayerParams& p,
                                     mx::StreamOrDevice s) {
  std::ostringstream os;
  const auto f32 = mx::float32;
  if (x.ndim() < 1 || x.dtype() != f32 || x.shape(-1) < 1) {
    os << "x must be float32 [..., hidden], got " << x.dtype() << " " << x.shape();
    fail(os.str());
  }
  const int hidden = x.shape(-1);
  const int tokens = static_cast<int>(x.size() / hidden);
  if (p.heads < 1 || p.kv_heads < 1 || p.heads % p.kv_heads != 0) {
    os << "heads (" << p.heads << ") must be a positive multiple of kv_heads (" << p.kv_heads << ")";
    fail(os.str());
  }
  if (!is_supported_head_dim(p.head_dim)) {
    os << "head_dim " << p.head_dim << " is not supported (1.." << kMaxHeadDim << ")";
    fail(os.str());
  }
  if (!(p.scale > 0.0f) || !(p.input_eps >= 0.0f) || !(p.post_eps >= 0.0f)) {
    fail("scale must be positive and the norms' eps non-negative");
  }
  const int q_cols = p.heads * p.head_dim;
  const int kv_cols = p.kv_heads * p.head_dim;
  expect(input_norm, "input_norm", {hidden}, f32);
  expect(post_norm, "post_norm", {hidden}, f32);
  expect(qkv_weight, "qkv_weight", {q_cols + 2 * kv_cols, hidden}, f32);
  expect(o_weight, "o_weight", {hidden, q_cols}, f32);
  if (gate_up_weight.ndim() != 2 || gate_up_weight.shape(0) < 2 || gate_up_weight.shape(0) % 2 != 0) {
    os << "gate_up_weight must be [2 * ffn, " << hidden << "], got " << gate_up_weight.shape();
    fail(os.str());
  }
  const int ffn = gate_up_weight.shape(0) / 2;
  expect(gate_up_weight, "gate_up_weight", {2 * ffn, hidden}, f32);
  expect(down_weight, "down_weight", {hidden, ffn}, f32);
  if (table.ndim() != 3 || table.shape(0) != tokens || table.shape(2) != 2 || table.shape(1) < 1 ||
      2 * table.shape(1) > p.head_dim || table.dtype() != f32) {
    os << "table must be float32 [tokens, rotated / 2, 2] with tokens = " << tokens << " and rotated <= head_dim = "
       << p.head_dim << ", got " << table.dtype() << " " << table.shape();
    fail(os.str());
  }
  if (key_cache.ndim() != 4 || key_cache.shape(2) != p.kv_heads || key_cache.shape(3) != p.head_dim ||
      key_cache.dtype() != f32) {
    os << "key_cache must be float32 [num_blocks, block_size, " << p.kv_heads << ", " << p.head_dim << "], got "
       << key_cache.dtype() << " " << key_cache.shape();
    fail(os.str());
  }
  expect(value_cache, "value_cache", key_cache.shape(), f32);
  if (!is_supported_block_size(key_cache.shape(1))) {
    os << "block_size " << key_cache.shape(1) << " is not supported (one of 8, 16, 32, 64, 128)";
    fail(os.str());
  }
  expect(slots, "slots", {tokens}, mx::int32);
  if (block_tables.ndim() != 2 || block_tables.dtype() != mx::int32 || block_tables.shape(1) < 1) {
    os << "block_tables must be int32 [num_seqs, max_blocks], got " << block_tables.dtype() << " "
       << block_tables.shape();
    fail(os.str());
  }
  const int seqs = block_tables.shape(0);
  expect(seq_lens, "seq_lens", {seqs}, mx::int32);
  expect(cu_seqlens_q, "cu_seqlens_q", {seqs + 1}, mx::int32);
  if (decoder_layer_sgemm() == nullptr) {
    fail("no cblas_sgemm is loaded in this process (MLX's CPU backend binds one: import vllm_metal before mlx)");
  }
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {x, input_norm, qkv_weight, table, key_cache, value_cache, slots,
                                   block_tables, seq_lens, cu_seqlens_q, o_weight, post_norm,
                                   gate_up_weight, down_weight};
  return mx::array::make_arrays({x.shape(), key_cache.shape(), value_cache.shape()}, {f32, f32, f32},
                                std::make_shared<DecoderLayer>(stream, p), std::move(inputs));
}

void DecoderLayer::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[decoder_layer] the DecoderLayer primitive runs on MLX's CPU device only; on the GPU, "
      "vllm_metal.native.ops.decoder_layer composes MLX's own kernels and paged_attention");
}

} // namespace vllm_metal
