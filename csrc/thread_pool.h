// A small persistent worker pool for the CPU kernels: parallel_for splits an
// index range across cores without creating threads on every call.
#pragma once

#include <cstddef>
#include <functional>

namespace vllm_metal {

// Number of threads parallel_for uses (the calling thread included):
// VLLM_METAL_CPU_THREADS if set, else the hardware concurrency.
int cpu_thread_count();

// Calls fn(i) exactly once for every i in [0, n), spread over the pool with
// dynamic scheduling (the caller takes whatever tasks the workers have not
// claimed: a worker slow to wake holds nothing up). Blocks until all calls returned. If any call throws, the
// first exception is rethrown here after the others finished. Calls from
// inside a worker run serially (no nested parallelism, no deadlock).
void parallel_for(std::size_t n, const std::function<void(std::size_t)>& fn);

} // namespace vllm_metal
