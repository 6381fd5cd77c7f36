// DecoderLayer::eval_cpu: a whole llama-shaped layer as one task on the
// stream's thread. The index data is read and checked here, on the thread
// running mx.eval (as PagedAttention::eval_cpu does: nothing may throw from
// the task); the task then runs the layer's kernels in the order its graph
// would: RMSNorm, the q/k/v product, RoPE + KV write, paged attention, the
// output product and the residual add, RMSNorm, the gate/up product,
// SwiGLU, the down product and the residual add.
#include <memory>
#include <vector>

#include "cpu/elementwise_op.h"
#include "cpu/kernel_dtype.h"
#include "cpu/paged_attention_kernel.h"
#include "cpu/rms_norm_kernel.h"
#include "cpu/rope_write_kv_kernel.h"
#include "cpu/swiglu_kernel.h"
#include "decoder_layer.h"
#include "decoder_layer_blas.h"
#include "op_util.h"
#include "paged_attention.h"
#include "paged_attention_batch.h"

namespace vllm_metal {

namespace {

// a's elements in row-major order: a's own data when it is row-contiguous,
// else a copy into `tmp`.
const float* row_major(const mx::array& a, std::vector<float>& tmp) {
  if (a.flags().row_contiguous) {
    return a.data<float>();
  }
  tmp.resize(a.size());
  const float* p = a.data<float>();
  const int nd = a.ndim();
  std::vector<int> idx(nd, 0);
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) off += idx[d] * a.strides()[d];
    tmp[i] = p[off];
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < a.shape(d)) break;
      idx[d] = 0;
    }
  }
  return tmp.data();
}

// C[M, N] = A[M, K] W[N, K]^T: the call MLX's Matmul makes for x @ w.T.
void product(SgemmFn sgemm, int m, int n, int k, const float* a, const float* w, float* c) {
  sgemm(kCblasRowMajor, kCblasNoTrans, kCblasTrans, m, n, k, 1.0f, a, k, w, k, 0.0f, c, n);
}

// Scratch floats a task uses, from MLX's allocator (its buffer cache makes
// the next step's request free), released when the task ends.
class Scratch {
 public:
  explicit Scratch(size_t floats) : data_(mx::allocator::malloc(floats * sizeof(float))) {}
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  float* take(size_t floats) {
    float* p = static_cast<float*>(data_.buffer().raw_ptr()) + used_;
    used_ += floats;
    return p;
  }

 private:
  mx::allocator::Data data_;  // freed (back to MLX's cache) with the Scratch
  size_t used_ = 0;
};

} // namespace

void DecoderLayer::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  static const auto norm_kernel = VLLM_METAL_BEST_KERNEL(rms_norm);
  static const auto rope_kernel = VLLM_METAL_BEST_KERNEL(rope_write_kv);
  static const auto swiglu_kernel = VLLM_METAL_BEST_KERNEL(swiglu);
  static const auto attention_kernel = select_attention_kernel();
  const auto sgemm = decoder_layer_sgemm();

  const auto& kc = inputs[kKeyCache];
  const auto& bt = inputs[kBlockTables];
  const int hidden = inputs[kX].shape(-1);
  const int tokens = static_cast<int>(inputs[kX].size() / hidden);
  const auto p = params_;
  cpu::Geometry g{};
  g.num_tokens = tokens;
  g.num_heads = p.heads;
  g.head_dim = p.head_dim;
  g.v_head_dim = p.head_dim;
  g.num_blocks = kc.shape(0);
  g.block_size = kc.shape(1);
  g.num_kv_heads = p.kv_heads;
  g.group = p.heads / p.kv_heads;
  g.num_seqs = bt.shape(0);
  g.max_blocks = bt.shape(1);
  g.q_st[0] = static_cast<int64_t>(p.heads) * p.head_dim;
  g.q_st[1] = p.head_dim;
  g.q_st[2] = 1;
  // The caches as the task writes them: row-contiguous.
  g.k_st[3] = g.v_st[3] = 1;
  g.k_st[2] = g.v_st[2] = p.head_dim;
  g.k_st[1] = g.v_st[1] = static_cast<int64_t>(p.kv_heads) * p.head_dim;
  g.k_st[0] = g.v_st[0] = g.k_st[1] * g.block_size;
  for (int i = 0; i < 2; ++i) g.bt_st[i] = bt.strides(i);

  bool ready = true;
  for (int i = kBlockTables; i <= kCuSeqlens; ++i) {
    ready = ready && inputs[i].status() == mx::array::Status::available;
  }
  if (!ready) {
    mx::synchronize(stream());
  }
  auto seq_lens = read_index_ints(inputs[kSeqLens]);
  auto cu_seqlens_q = read_index_ints(inputs[kCuSeqlens]);
  validate_attention_batch(g, seq_lens, cu_seqlens_q, bt, "decoder_layer");

  // Only now (nothing was wrong) the outputs: the caches' buffers donated when nothing else holds them
  // (always taken with params_.in_place: an alias write).
  release_sibling_inputs(inputs, outputs);
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  bool copy[2] = {false, false};
  take_cache_buffers(inputs, kKeyCache, outputs, copy, params_.in_place);

  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  for (auto& o : outputs) {
    encoder.set_output_array(o);
  }
  encoder.dispatch([inputs, outputs, p, g, seq_lens = std::move(seq_lens),
                    cu_seqlens_q = std::move(cu_seqlens_q), copy0 = copy[0], copy1 = copy[1], sgemm, hidden,
                    tokens]() mutable {
    if (copy0) copy_4d_any_layout(inputs[kKeyCache], outputs[1].data<void>());
    if (copy1) copy_4d_any_layout(inputs[kValueCache], outputs[2].data<void>());
    if (tokens == 0) {
      return;
    }
    std::vector<float> tmp[8];
    const float* x = row_major(inputs[kX], tmp[0]);
    const float* w_in = row_major(inputs[kInputNorm], tmp[1]);
    const float* w_qkv = row_major(inputs[kQkv], tmp[2]);
    const float* table = row_major(inputs[kTable], tmp[3]);
    const float* w_o = row_major(inputs[kO], tmp[4]);
    const float* w_post = row_major(inputs[kPostNorm], tmp[5]);
    const float* w_gu = row_major(inputs[kGateUp], tmp[6]);
    const float* w_down = row_major(inputs[kDown], tmp[7]);
    const int q_cols = p.heads * p.head_dim;
    const int kv_cols = p.kv_heads * p.head_dim;
    const int qkv_cols = q_cols + 2 * kv_cols;
    const int ffn = inputs[kGateUp].shape(0) / 2;
    const size_t t = tokens;
    Scratch scratch(t * (2 * hidden + qkv_cols + 2 * q_cols + 3 * ffn));
    float* normed = scratch.take(t * hidden);
    float* qkv = scratch.take(t * qkv_cols);
    float* q_rot = scratch.take(t * q_cols);
    float* attended = scratch.take(t * q_cols);
    float* projected = scratch.take(t * hidden);
    float* gate_up = scratch.take(t * 2 * ffn);
    float* act = scratch.take(t * ffn);
    float* h = outputs[0].data<float>();
    const auto f32 = cpu::KernelDtype::float32;

    norm_kernel({f32, x, w_in, normed, tokens, hidden, p.input_eps});
    product(sgemm, tokens, qkv_cols, hidden, normed, w_qkv, qkv);

    cpu::RopeWriteKvArgs rw{};
    rw.dtype = f32;
    rw.q = qkv;
    rw.k = qkv + q_cols;
    rw.v = qkv + q_cols + kv_cols;
    for (auto* st : {rw.q_st, rw.k_st, rw.v_st}) {
      st[0] = qkv_cols;
      st[1] = p.head_dim;
      st[2] = 1;
    }
    rw.table = table;
    rw.slots = inputs[kSlots].data<int32_t>();
    rw.q_out = q_rot;
    rw.key_cache = outputs[1].data<void>();
    rw.value_cache = outputs[2].data<void>();
    rw.tokens = tokens;
    rw.num_slots = static_cast<int64_t>(g.num_blocks) * g.block_size;
    rw.heads = p.heads;
    rw.kv_heads = p.kv_heads;
    rw.dim = p.head_dim;
    rw.rotated = static_cast<int>(2 * inputs[kTable].shape(1));
    rw.traditional = p.traditional;
    rope_kernel(rw);

    PagedAttentionParams ap{p.scale, p.sliding_window, 0.0f, p.head_dim, 1, kCacheAsQuery};
    cpu::KernelArgs args{f32, q_rot, outputs[1].data<void>(), outputs[2].data<void>(),
                         inputs[kBlockTables].data<int32_t>(), attended, nullptr, 0, ap, g,
                         std::move(seq_lens), std::move(cu_seqlens_q)};
    attention_kernel(args);

    product(sgemm, tokens, hidden, q_cols, attended, w_o, projected);
    for (size_t i = 0; i < t * hidden; ++i) h[i] = x[i] + projected[i];

    norm_kernel({f32, h, w_post, normed, tokens, hidden, p.post_eps});
    product(sgemm, tokens, 2 * ffn, hidden, normed, w_gu, gate_up);
    swiglu_kernel({f32, gate_up, gate_up + ffn, act, tokens, ffn, 2 * static_cast<int64_t>(ffn),
                   2 * static_cast<int64_t>(ffn)});
    product(sgemm, tokens, hidden, ffn, act, w_down, projected);
    for (size_t i = 0; i < t * hidden; ++i) h[i] += projected[i];
  });
}

} // namespace vllm_metal
