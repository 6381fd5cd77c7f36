// Interface between the MSL shim (what kernel code sees: include/metal_stdlib)
// and the executor runtime (msl_runtime.cpp), which runs each threadgroup's
// threads as fibers with real barrier and simdgroup semantics on the CPU.
// Plain C++: included before the shim defines MSL's address-space keywords.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace msl_rt {

constexpr int kSimdWidth = 32;       // Apple GPUs
constexpr size_t kMaxSimdBytes = 32; // largest value a simd operation exchanges
constexpr size_t kThreadgroupMemoryLimit = 32768;  // Metal's per-threadgroup limit
constexpr uint32_t kMaxThreadsPerThreadgroup = 1024;

struct Dim3 {
  uint32_t x, y, z;
};

// Values of MSL's thread-position attributes for one thread.
struct ThreadIds {
  Dim3 thread_position_in_grid;
  Dim3 threadgroup_position_in_grid;
  Dim3 thread_position_in_threadgroup;
  Dim3 threads_per_threadgroup;
  Dim3 threadgroups_per_grid;
  Dim3 threads_per_grid;
  uint32_t thread_index_in_threadgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t threads_per_simdgroup;
};

// A kernel instantiation as the executor calls it: buffers indexed like
// [[buffer(n)]], plus the calling thread's ids. Generated glue (msl_build.py)
// defines one per [[host_name]] and registers it at load time.
using KernelThunk = void (*)(void* const* buffers, const ThreadIds& ids);
struct KernelRegistration {
  KernelRegistration(const char* host_name, KernelThunk thunk);
};
KernelThunk find_kernel(const std::string& host_name);
std::vector<std::string> kernel_names();

// Where a thread synchronises; all threads meeting at a barrier (or lanes at
// a simd operation) must have come from the same call site.
struct SyncSite {
  const char* file;
  unsigned line;
  unsigned column;
  const char* what;
};

// Called from kernel threads (fibers) only.
const ThreadIds& current_ids();
void threadgroup_barrier(SyncSite site);
// Each lane of the caller's simdgroup contributes `bytes` bytes; once every
// lane has arrived, `all` receives every lane's contribution, lane i at
// all + i * bytes. Returns the number of lanes in the simdgroup.
uint32_t simd_exchange(const void* mine, void* all, size_t bytes, SyncSite site);
// Threadgroup storage for the k-th threadgroup array a thread declares: the
// same memory for every thread of the threadgroup, filled with 0xFF bytes
// (NaN, -1) when the threadgroup starts.
void* threadgroup_alloc(size_t bytes, size_t align);
[[noreturn]] void fail(const std::string& message);

struct LaunchOptions {
  uint64_t seed = 0;  // scheduling order of threads between sync points
  int workers = 1;    // OS threads running threadgroups in parallel
};

// Runs every threadgroup of `grid` (threadgroups) x `group` (threads); throws
// std::runtime_error when a kernel thread fails (divergent barrier, etc.).
void dispatch_threadgroups(const std::string& kernel, void* const* buffers,
                           Dim3 grid, Dim3 group, const LaunchOptions& options);

// Memory with inaccessible pages around the data, so an out-of-bounds read
// just past (or, with at_start, just before) the data faults.
class GuardedBuffer {
 public:
  GuardedBuffer(size_t bytes, bool at_start);
  ~GuardedBuffer();
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;
  unsigned char* data() const { return data_; }
  size_t size() const { return bytes_; }

 private:
  void* map_;
  size_t map_bytes_;
  unsigned char* data_;
  size_t bytes_;
};

} // namespace msl_rt
