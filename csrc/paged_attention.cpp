// The paged_attention op: the single place that validates static shapes and
// dtypes and builds the lazy output array. Backends trust what passes here.
#include "paged_attention.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "mlx/ops.h"

#include "op_util.h"

namespace vllm_metal {

bool is_supported_head_dim(int head_dim) {
  return head_dim >= 1 && head_dim <= kMaxHeadDim;
}

bool is_supported_v_head_dim(int v_head_dim) {
  return v_head_dim >= 1 && v_head_dim <= kMaxVHeadDim;
}

bool is_supported_block_size(int block_size) {
  return block_size == 8 || block_size == 16 || block_size == 32 ||
      block_size == 64 || block_size == 128;
}

namespace {

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("[paged_attention] " + msg);
}

void check_rank(const mx::array& a, const char* name, int rank, const char* layout) {
  if (a.ndim() != rank) {
    std::ostringstream os;
    os << name << " must have rank " << rank << " " << layout << ", got shape "
       << shape_str(a);
    fail(os.str());
  }
}

void check_int32(const mx::array& a, const char* name) {
  if (a.dtype() != mx::int32) {
    std::ostringstream os;
    os << name << " must be int32, got " << a.dtype();
    fail(os.str());
  }
}

} // namespace

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
    const std::optional<mx::array>& sinks,
    std::optional<int> v_head_dim,
    bool causal,
    int cache_format,
    mx::StreamOrDevice s) {
  check_rank(q, "q", 3, "[num_tokens, num_heads, head_dim]");
  check_rank(key_cache, "key_cache", 4,
             "[num_blocks, block_size, num_kv_heads, head_dim]");
  check_rank(value_cache, "value_cache", 4,
             "[num_blocks, block_size, num_kv_heads, >= v_head_dim]");
  check_rank(block_tables, "block_tables", 2, "[num_seqs, max_blocks_per_seq]");
  check_rank(seq_lens, "seq_lens", 1, "[num_seqs]");
  check_rank(cu_seqlens_q, "cu_seqlens_q", 1, "[num_seqs + 1]");

  auto dt = q.dtype();
  if (dt != mx::float32 && dt != mx::float16 && dt != mx::bfloat16) {
    std::ostringstream os;
    os << "q must be float32, float16 or bfloat16, got " << dt;
    fail(os.str());
  }
  if (cache_format < kCacheAsQuery || cache_format > kCacheFp8E4M3Row) {
    std::ostringstream os;
    os << "cache_format must be 0 (the caches in q's dtype), 1 (fp8 e4m3), 2 (fp8 e5m2) or 3 (fp8 e4m3 "
       << "with a scale per row), got " << cache_format;
    fail(os.str());
  }
  // Bytes after each row's values: its scale (kCacheFp8E4M3Row).
  const int row_extra = cache_format == kCacheFp8E4M3Row ? kRowScaleBytes : 0;
  const auto cache_dt = cache_format == kCacheAsQuery ? dt : mx::uint8;
  for (auto [a, name] : {std::pair{&key_cache, "key_cache"},
                         std::pair{&value_cache, "value_cache"}}) {
    if (a->dtype() != cache_dt) {
      std::ostringstream os;
      if (cache_format == kCacheAsQuery) {
        os << name << " dtype " << a->dtype() << " does not match q dtype " << dt;
      } else {
        os << name << " dtype " << a->dtype() << " must be uint8 (fp8 bit patterns) for cache_format "
           << cache_format;
      }
      fail(os.str());
    }
  }
  check_int32(block_tables, "block_tables");
  check_int32(seq_lens, "seq_lens");
  check_int32(cu_seqlens_q, "cu_seqlens_q");

  // The caches agree on everything but the row size: values may be a prefix
  // of a wider row (latent attention keeps one cache for both).
  const char* axis_names[] = {"num_blocks", "block_size", "num_kv_heads"};
  for (int axis = 0; axis < 3; ++axis) {
    if (key_cache.shape(axis) != value_cache.shape(axis)) {
      std::ostringstream os;
      os << "key_cache shape " << shape_str(key_cache) << " differs from value_cache shape "
         << shape_str(value_cache) << " in " << axis_names[axis] << " (" << key_cache.shape(axis)
         << " vs " << value_cache.shape(axis) << "); only the last axis may differ";
      fail(os.str());
    }
  }
  const int num_heads = q.shape(1);
  const int head_dim = q.shape(2);
  const int num_blocks = key_cache.shape(0);
  const int block_size = key_cache.shape(1);
  const int num_kv_heads = key_cache.shape(2);
  const int value_row = value_cache.shape(3) - row_extra;
  std::ostringstream os;
  if (key_cache.shape(3) - row_extra != head_dim) {
    os << "head_dim mismatch: q has " << head_dim << ", key_cache has "
       << key_cache.shape(3) << (row_extra ? " (head_dim + 4 scale bytes expected)" : "");
    fail(os.str());
  }
  if (!is_supported_head_dim(head_dim)) {
    os << "head_dim " << head_dim << " is not supported (1.." << kMaxHeadDim
       << ")";
    fail(os.str());
  }
  if (v_head_dim) {
    if (*v_head_dim < 1) {
      os << "v_head_dim must be >= 1 (or None), got " << *v_head_dim;
      fail(os.str());
    }
    if (*v_head_dim > value_row) {
      os << "v_head_dim " << *v_head_dim << " exceeds the value_cache row of " << value_row
         << " values (value_cache shape " << shape_str(value_cache) << ")";
      fail(os.str());
    }
  } else if (value_row != head_dim) {
    os << "value_cache rows hold " << value_row << " values but the key head_dim is "
       << head_dim << "; pass v_head_dim to read the first v_head_dim values of each row";
    fail(os.str());
  }
  const int v_dim = v_head_dim.value_or(head_dim);
  if (row_extra && v_dim != value_row) {
    os << "value_cache rows with a scale must hold exactly v_head_dim (" << v_dim << ") values + 4 bytes, got "
       << value_cache.shape(3) << " bytes";
    fail(os.str());
  }
  if (!is_supported_v_head_dim(v_dim)) {
    os << "v_head_dim " << v_dim
       << (v_head_dim ? "" : " (the key head_dim, v_head_dim being None)")
       << " is not supported (1.." << kMaxVHeadDim << ")";
    fail(os.str());
  }
  if (!is_supported_block_size(block_size)) {
    os << "block_size " << block_size
       << " is not supported (one of 8, 16, 32, 64, 128)";
    fail(os.str());
  }
  if (num_kv_heads < 1 || num_heads < 1 || num_heads % num_kv_heads != 0) {
    os << "num_heads (" << num_heads << ", from q) must be a positive multiple"
       << " of num_kv_heads (" << num_kv_heads << ", from key_cache)";
    fail(os.str());
  }
  if (num_blocks < 1) {
    fail("key_cache must hold at least one block");
  }
  const int num_seqs = seq_lens.shape(0);
  if (block_tables.shape(0) != num_seqs) {
    os << "block_tables has " << block_tables.shape(0)
       << " rows but seq_lens has " << num_seqs << " sequences";
    fail(os.str());
  }
  if (cu_seqlens_q.shape(0) != num_seqs + 1) {
    os << "cu_seqlens_q must have num_seqs + 1 = " << num_seqs + 1
       << " entries, got " << cu_seqlens_q.shape(0);
    fail(os.str());
  }
  if (!(scale > 0.0f) || !std::isfinite(scale)) {
    fail("scale must be a positive finite number");
  }
  if (sliding_window && *sliding_window < 1) {
    os << "sliding_window must be >= 1 (or None), got " << *sliding_window;
    fail(os.str());
  }
  if (softcap && (!(*softcap > 0.0f) || !std::isfinite(*softcap))) {
    fail("softcap must be a positive finite number (or None)");
  }
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {q, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q};
  if (sinks) {
    if (sinks->ndim() != 1 || sinks->shape(0) != num_heads) {
      os << "sinks must have shape [num_heads] = (" << num_heads << ",) (one logit per query head),"
         << " got shape " << shape_str(*sinks);
      fail(os.str());
    }
    if (!mx::issubdtype(sinks->dtype(), mx::floating)) {
      os << "sinks must be a floating-point array, got " << sinks->dtype();
      fail(os.str());
    }
    inputs.push_back(mx::astype(*sinks, mx::float32, stream));
  }

  PagedAttentionParams params{
      scale, sliding_window.value_or(0), softcap.value_or(0.0f), v_dim, causal ? 1 : 0, cache_format};
  return mx::array(
      {q.shape(0), num_heads, v_dim},
      dt,
      std::make_shared<PagedAttention>(stream, params),
      std::move(inputs));
}

std::vector<mx::Shape> PagedAttention::output_shapes(
    const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[0].shape(1), params_.v_head_dim}};
}

bool PagedAttention::is_equivalent(const mx::Primitive& other) const {
  return params_ == static_cast<const PagedAttention&>(other).params_;
}

} // namespace vllm_metal
