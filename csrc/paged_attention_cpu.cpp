// PagedAttention::eval_cpu: the CPU backend of the paged-attention primitive.
// Reads the index arrays, validates them (the only data-dependent checks: a
// bad block id or length raises from mx.eval, before anything is read
// through it) and runs the kernel variant for this CPU's instruction set.
#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/stream.h"

#include "cpu/isa.h"
#include "cpu/kernel_dtype.h"
#include "cpu/paged_attention_kernel.h"
#include "cpu/paged_attention_tiles.h"
#include "paged_attention.h"
#include "paged_attention_batch.h"

namespace vllm_metal {

using cpu::Geometry;
using cpu::KernelArgs;
using cpu::KernelDtype;

std::vector<int> read_index_ints(const mx::array& a) {
  std::vector<int> v(a.size());
  const int32_t* p = a.data<int32_t>();
  const int64_t st = a.strides(0);
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = p[i * st];
  }
  return v;
}

void validate_attention_batch(const Geometry& g, const std::vector<int>& seq_lens,
                              const std::vector<int>& cu, const mx::array& block_tables, const char* op) {
  auto fail_at_eval = [op](const std::string& msg) {
    throw std::runtime_error(std::string("[") + op + "] " + msg);
  };
  std::ostringstream os;
  if (cu[0] != 0 || cu[g.num_seqs] != g.num_tokens) {
    os << "cu_seqlens_q must start at 0 and end at num_tokens = " << g.num_tokens
       << ", got [" << cu[0] << ", ..., " << cu[g.num_seqs] << "]";
    fail_at_eval(os.str());
  }
  for (int s = 0; s < g.num_seqs; ++s) {
    if (cu[s + 1] < cu[s]) {
      os << "cu_seqlens_q must be non-decreasing, but cu_seqlens_q[" << s + 1
         << "] = " << cu[s + 1] << " < cu_seqlens_q[" << s << "] = " << cu[s];
      fail_at_eval(os.str());
    }
  }
  const int capacity = g.max_blocks * g.block_size;
  const int32_t* bt = block_tables.data<int32_t>();
  for (int s = 0; s < g.num_seqs; ++s) {
    const int n = cu[s + 1] - cu[s];
    if (seq_lens[s] < n || seq_lens[s] > capacity) {
      os << "seq_lens[" << s << "] = " << seq_lens[s] << " must be >= the "
         << n << " new tokens of that sequence and <= the block table capacity "
         << g.max_blocks << " blocks x " << g.block_size << " = " << capacity;
      fail_at_eval(os.str());
    }
    const int used_blocks = (seq_lens[s] + g.block_size - 1) / g.block_size;
    for (int b = 0; b < used_blocks; ++b) {
      const int id = bt[s * g.bt_st[0] + b * g.bt_st[1]];
      if (id < 0 || id >= g.num_blocks) {
        os << "block_tables[" << s << ", " << b << "] = " << id
           << " is out of range [0, " << g.num_blocks << ")";
        fail_at_eval(os.str());
      }
    }
  }
}

cpu::TileOverride& cpu::tile_override() {
  static TileOverride o;
  return o;
}

void set_cpu_tile_override(int prefill_rows, int verify_tokens, int verify_kv_heads) {
  cpu::TileOverride& o = cpu::tile_override();
  o.prefill_rows = std::max(prefill_rows, 0);
  o.verify_tokens = std::max(verify_tokens, 0);
  o.verify_kv_heads = std::max(verify_kv_heads, 0);
}

std::pair<int, int> cpu_verify_tile(int head_dim, int num_seqs) {
  const cpu::VerifyTile t =
      cpu::kVerifyTiles[cpu::head_dim_class(head_dim)][static_cast<int>(cpu::verify_batch(num_seqs))];
  return {t.tokens, t.kv_heads};
}

// The fastest variant this CPU can run.
void (*select_attention_kernel())(const KernelArgs&) {
#if defined(__x86_64__) || defined(_M_X64)
  return cpu::pick_variant(&cpu::paged_attention_generic, &cpu::paged_attention_avx2,
                           &cpu::paged_attention_avx512);
#else
  return cpu::paged_attention_generic;
#endif
}

std::string cpu_attention_variant() {
  return cpu::isa_name(cpu::best_isa());
}

std::string cpu_host_isa() {
  return cpu::isa_name(cpu::host_isa());
}

void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& q = inputs[0];
  const auto& kc = inputs[1];
  const auto& vc = inputs[2];
  Geometry g{};
  g.num_tokens = q.shape(0);
  g.num_heads = q.shape(1);
  g.head_dim = q.shape(2);
  g.v_head_dim = params_.v_head_dim;
  g.num_blocks = kc.shape(0);
  g.block_size = kc.shape(1);
  g.num_kv_heads = kc.shape(2);
  g.group = g.num_heads / g.num_kv_heads;
  g.num_seqs = inputs[4].shape(0);
  g.max_blocks = inputs[3].shape(1);
  for (int i = 0; i < 3; ++i) g.q_st[i] = q.strides(i);
  for (int i = 0; i < 4; ++i) g.k_st[i] = kc.strides(i);
  for (int i = 0; i < 4; ++i) g.v_st[i] = vc.strides(i);
  for (int i = 0; i < 2; ++i) g.bt_st[i] = inputs[3].strides(i);

  KernelDtype dtype = cpu::kernel_dtype(out.dtype());
  static const auto kernel = select_attention_kernel();

  // The index data is validated here, on the thread running mx.eval, so a
  // bad block id or length raises before anything is dispatched. It must not
  // throw from the CPU task: in MLX 0.32 CommandEncoder::dispatch counts a
  // new task and then enqueues, and that enqueue rethrows a failed task's
  // pending error, so the count can leak; after ~10 leaks (~100 errors)
  // every later eval waits forever (found by tests/reliability fuzzing).
  // Index arrays made from host data (the engine's) are ready now; arrays
  // computed in this graph are waited for.
  bool ready = true;
  for (int i = 3; i < 6; ++i) {  // (not the sinks: read only by the task)
    ready = ready && inputs[i].status() == mx::array::Status::available;
  }
  if (!ready) {
    mx::synchronize(stream());
  }
  auto seq_lens = read_index_ints(inputs[4]);
  auto cu_seqlens_q = read_index_ints(inputs[5]);
  validate_attention_batch(g, seq_lens, cu_seqlens_q, inputs[3], "paged_attention");

  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  // MLX keeps the input buffers alive until this task has run (no encoder
  // temporaries needed); the arrays are captured only to read them.
  encoder.dispatch([inputs, out, params = params_, g, dtype, seq_lens = std::move(seq_lens),
                    cu_seqlens_q = std::move(cu_seqlens_q)]() mutable {
    const bool sinks = has_sinks(inputs);
    KernelArgs args{dtype, inputs[0].data<void>(), inputs[1].data<void>(),
                    inputs[2].data<void>(), inputs[3].data<int32_t>(),
                    out.data<void>(),
                    sinks ? inputs[kSinksInput].data<float>() : nullptr,
                    sinks ? inputs[kSinksInput].strides(0) : 0,
                    params, g, std::move(seq_lens), std::move(cu_seqlens_q)};
    kernel(args);
  });
}

} // namespace vllm_metal
