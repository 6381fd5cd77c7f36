// nanobind module vllm_metal._ext: exposes the paged-attention and gated-delta ops and build
// facts. Lives in nanobind domain "mlx" so mx.array / mx.Stream cross over.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "mlx/version.h"

#include "decoder_layer.h"
#include "gated_delta.h"
#include "paged_attention.h"
#include "rms_norm.h"
#include "rope.h"
#include "rope_write_kv.h"
#include "swiglu.h"
#include "argmax_head.h"
#include "gelu.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

NB_MODULE(_ext, m) {
  m.doc() = "vllm-metal native MLX primitives";

  m.def(
      "paged_attention",
      &vllm_metal::paged_attention,
      "q"_a,
      "key_cache"_a,
      "value_cache"_a,
      "block_tables"_a,
      "seq_lens"_a,
      "cu_seqlens_q"_a,
      nb::kw_only(),
      "scale"_a,
      "sliding_window"_a = nb::none(),
      "softcap"_a = nb::none(),
      "sinks"_a = nb::none(),
      "v_head_dim"_a = nb::none(),
      "causal"_a = true,
      "cache_format"_a = 0,
      "stream"_a = nb::none(),
      "Lazy paged attention over packed varlen queries (see vllm_metal.native.ops).");

  m.def(
      "gated_delta",
      &vllm_metal::gated_delta,
      "q"_a,
      "k"_a,
      "v"_a,
      "g"_a,
      "beta"_a,
      "state"_a,
      "mask"_a = nb::none(),
      nb::kw_only(),
      "stream"_a = nb::none(),
      "Lazy gated delta rule recurrence -> [y, state] (see vllm_metal.native.ops).");

  m.def(
      "swiglu",
      &vllm_metal::swiglu,
      "gate"_a,
      "up"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "Lazy silu(gate) * up on MLX's CPU device (see vllm_metal.native.ops.swiglu).");

  m.def(
      "argmax_head",
      &vllm_metal::argmax_head,
      "hidden"_a,
      "weight"_a,
      nb::kw_only(),
      "screen_weight"_a = nb::none(),
      "screen_table"_a = nb::none(),
      "stream"_a = nb::none(),
      "Lazy argmax over the vocabulary of hidden @ weight^T on MLX's CPU device "
      "(see vllm_metal.native.ops.argmax_head).");

  m.def(
      "argmax_head_screen",
      &vllm_metal::argmax_head_screen,
      "weight"_a,
      "The bfloat16 screen of a float32 head for argmax_head (see vllm_metal.native.ops.argmax_head_screen).");

  m.def(
      "argmax_head_screen_build",
      &vllm_metal::argmax_head_screen_build,
      "The build of argmax_head's screened kernel this CPU runs: 'avx512bf16', 'avx2' or '' (none).");

  m.def(
      "argmax_head_screen_counters",
      &vllm_metal::argmax_head_screen_counters,
      "[calls, rows, exact, declined]: the screened kernel's work in this process.");

  m.def(
      "gelu",
      &vllm_metal::gelu,
      "x"_a,
      nb::kw_only(),
      "approximate"_a = false,
      "stream"_a = nb::none(),
      "Lazy GELU (erf, or tanh-approximated) on MLX's CPU device (see vllm_metal.native.ops.gelu).");

  m.def(
      "rms_norm",
      &vllm_metal::rms_norm,
      "x"_a,
      "weight"_a,
      "eps"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "Lazy RMSNorm over the last axis on MLX's CPU device (see vllm_metal.native.ops.rms_norm).");

  m.def(
      "layer_norm",
      &vllm_metal::layer_norm,
      "x"_a,
      "weight"_a,
      "bias"_a.none(),
      "eps"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "Lazy LayerNorm over the last axis on MLX's CPU device (see vllm_metal.native.ops.layer_norm).");

  m.def(
      "rope",
      &vllm_metal::rope,
      "x"_a,
      "table"_a,
      "traditional"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "Lazy RoPE of [tokens, heads, dim] by a per-token (cos, sin) table on MLX's CPU device "
      "(see vllm_metal.native.ops.rope).");

  m.def(
      "rope_write_kv",
      &vllm_metal::rope_write_kv,
      "q"_a,
      "k"_a,
      "v"_a,
      "table"_a,
      "key_cache"_a,
      "value_cache"_a,
      "slots"_a,
      "traditional"_a,
      nb::kw_only(),
      "in_place"_a = false,
      "stream"_a = nb::none(),
      "Lazy RoPE of q and k by a per-token table and the rotated keys' and the values' cache write, "
      "on MLX's CPU device: returns [rotated q, key_cache', value_cache'] "
      "(see vllm_metal.native.ops.rope_write_kv).");

  m.def(
      "decoder_layer",
      [](const mx::array& x, const mx::array& input_norm, const mx::array& qkv_weight, const mx::array& table,
         const mx::array& key_cache, const mx::array& value_cache, const mx::array& slots,
         const mx::array& block_tables, const mx::array& seq_lens, const mx::array& cu_seqlens_q,
         const mx::array& o_weight, const mx::array& post_norm, const mx::array& gate_up_weight,
         const mx::array& down_weight, int heads, int kv_heads, int head_dim, float input_eps, float post_eps,
         float scale, int sliding_window, bool traditional, bool in_place, mx::StreamOrDevice s) {
        vllm_metal::DecoderLayerParams p{heads, kv_heads, head_dim, input_eps, post_eps, scale, sliding_window,
                                         traditional, in_place};
        return vllm_metal::decoder_layer(x, input_norm, qkv_weight, table, key_cache, value_cache, slots,
                                         block_tables, seq_lens, cu_seqlens_q, o_weight, post_norm,
                                         gate_up_weight, down_weight, p, s);
      },
      "x"_a, "input_norm"_a, "qkv_weight"_a, "table"_a, "key_cache"_a, "value_cache"_a, "slots"_a,
      "block_tables"_a, "seq_lens"_a, "cu_seqlens_q"_a, "o_weight"_a, "post_norm"_a, "gate_up_weight"_a,
      "down_weight"_a, nb::kw_only(), "heads"_a, "kv_heads"_a, "head_dim"_a, "input_eps"_a, "post_eps"_a,
      "scale"_a, "sliding_window"_a, "traditional"_a, "in_place"_a = false, "stream"_a = nb::none(),
      "Lazy llama-shaped decoder layer (norm, q/k/v, RoPE + KV write, paged attention, output product and "
      "residual, norm, gate/up, SwiGLU, down product and residual) as one primitive on MLX's CPU device: "
      "returns [out, key_cache', value_cache'] (see vllm_metal.native.ops.decoder_layer).");
  m.def("decoder_layer_blas", &vllm_metal::decoder_layer_blas,
        "The file of the cblas_sgemm the DecoderLayer primitive calls (\"\" when none is loaded).");

  m.def(
      "is_materialized",
      [](const mx::array& a) { return a.is_available(); },
      "a"_a,
      "True when the array already holds data (evaluated, or made from host "
      "data): reading it then forces no computation.");

  m.def(
      "buffer_address",
      [](const mx::array& a) {
        return reinterpret_cast<std::uintptr_t>(a.buffer().raw_ptr());
      },
      "a"_a,
      "Address of the array's data buffer (for donation checks in tests).");

  m.def("cpu_attention_variant", &vllm_metal::cpu_attention_variant,
        "The CPU paged-attention kernel variant this machine runs: avx512, avx2 or generic.");
  m.def("cpu_host_isa", &vllm_metal::cpu_host_isa,
        "The best instruction set of the CPU kernels' builds this CPU runs, before any "
        "VLLM_METAL_CPU_ISA cap: avx512, avx2 or generic.");

  m.def("set_cpu_tile_override", &vllm_metal::set_cpu_tile_override, "prefill_rows"_a = 0,
        "verify_tokens"_a = 0, "verify_kv_heads"_a = 0,
        "Benchmark hook of the CPU kernel's tile table: rows per tile for prefill-class "
        "sequences; for verify-class ones (2..8 new tokens) tokens per tile (8: all) and KV "
        "heads per unit (1: one, 2 or more: all). 0 keeps the table's; all zeros restore it. "
        "Never set while serving.");

  m.def("cpu_verify_tile", &vllm_metal::cpu_verify_tile, "head_dim"_a, "num_seqs"_a,
        "The CPU tile table's verify tile for a call of num_seqs sequences: (tokens per tile, "
        "KV heads per unit), 0 meaning all of them.");

  // From the headers compiled in, not from the loaded libmlx.
  m.attr("BUILT_AGAINST_MLX") = std::to_string(MLX_VERSION_MAJOR) + "." +
      std::to_string(MLX_VERSION_MINOR) + "." + std::to_string(MLX_VERSION_PATCH);
#ifdef VLLM_METAL_HAS_METAL
  m.attr("HAS_METAL") = true;
#else
  m.attr("HAS_METAL") = false;
#endif
  m.attr("MAX_HEAD_DIM") = vllm_metal::kMaxHeadDim;  // keys (and q)
  m.attr("MAX_V_HEAD_DIM") = vllm_metal::kMaxVHeadDim;
}
