// Host side of the executor runtime: guarded buffers and the C API that
// Python calls through ctypes (launch a kernel, list registered kernels).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "msl_runtime.h"

namespace msl_rt {

namespace {

constexpr size_t kGuardBytes = 1 << 20;  // inaccessible bytes on each side

size_t page_size() {
  static const size_t size = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

} // namespace

GuardedBuffer::GuardedBuffer(size_t bytes, bool at_start) : bytes_(bytes) {
  const size_t page = page_size();
  const size_t data_pages = (bytes + page - 1) / page * page;
  map_bytes_ = kGuardBytes + data_pages + kGuardBytes;
  map_ = mmap(nullptr, map_bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (map_ == MAP_FAILED) {
    throw std::runtime_error("msl executor: cannot map a guarded buffer");
  }
  auto* base = static_cast<unsigned char*>(map_) + kGuardBytes;
  if (data_pages > 0 && mprotect(base, data_pages, PROT_READ | PROT_WRITE) != 0) {
    munmap(map_, map_bytes_);
    throw std::runtime_error("msl executor: cannot unprotect a guarded buffer");
  }
  data_ = at_start ? base : base + data_pages - bytes;
}

GuardedBuffer::~GuardedBuffer() {
  munmap(map_, map_bytes_);
}

} // namespace msl_rt

// ------------------------------------------------------------ C API (ctypes)

// Runs one kernel over `count` buffers of `sizes` bytes, each copied into a
// guarded buffer and copied back afterwards. Returns 0, or 1 with a message.
extern "C" int msl_launch(const char* kernel, void** buffers, const uint64_t* sizes, int count,
                          const uint32_t* grid, const uint32_t* group, uint64_t seed,
                          int workers, int at_start, char* error, uint64_t error_bytes) {
  try {
    std::vector<std::unique_ptr<msl_rt::GuardedBuffer>> guarded;
    std::vector<void*> bound;
    for (int i = 0; i < count; ++i) {
      if (buffers[i] == nullptr) {
        guarded.emplace_back();
        bound.push_back(nullptr);
        continue;
      }
      guarded.push_back(std::make_unique<msl_rt::GuardedBuffer>(sizes[i], at_start != 0));
      std::memcpy(guarded.back()->data(), buffers[i], sizes[i]);
      bound.push_back(guarded.back()->data());
    }
    msl_rt::dispatch_threadgroups(kernel, bound.data(), {grid[0], grid[1], grid[2]},
                                  {group[0], group[1], group[2]}, {seed, workers});
    for (int i = 0; i < count; ++i) {
      if (buffers[i] != nullptr) {
        std::memcpy(buffers[i], guarded[i]->data(), sizes[i]);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(error, error_bytes, "%s", e.what());
    return 1;
  }
}

// Newline-separated host names of every registered kernel.
extern "C" uint64_t msl_kernel_names(char* out, uint64_t out_bytes) {
  std::string names;
  for (const auto& name : msl_rt::kernel_names()) {
    names += name + "\n";
  }
  std::snprintf(out, out_bytes, "%s", names.c_str());
  return names.size();
}
