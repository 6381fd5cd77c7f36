// What the CPU paged attention does on the thread running mx.eval before its
// kernel is dispatched, shared with the primitives that attend inside their
// own task (DecoderLayer): read the small index arrays, check everything the
// kernel would otherwise read out of bounds, and pick the kernel build.
#pragma once

#include <vector>

#include "cpu/paged_attention_kernel.h"

namespace vllm_metal {

// The int32 entries of a 1-D index array (any stride), on the host.
std::vector<int> read_index_ints(const mx::array& a);

// The data-dependent checks (cu_seqlens_q from 0 to num_tokens and
// non-decreasing, each seq_len between its new tokens and the block table's
// capacity, every used block id inside the cache): std::runtime_error
// "[<op>] ..." naming the first bad entry.
void validate_attention_batch(const cpu::Geometry& g, const std::vector<int>& seq_lens,
                              const std::vector<int>& cu_seqlens_q, const mx::array& block_tables, const char* op);

// The fastest kernel build this CPU runs.
void (*select_attention_kernel())(const cpu::KernelArgs&);

} // namespace vllm_metal
