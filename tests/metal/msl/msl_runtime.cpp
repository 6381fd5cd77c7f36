// Executor runtime: runs MSL kernels compiled as C++ on the CPU, each
// threadgroup's threads as fibers (one stack each) that a scheduler switches
// between at synchronisation points, so barriers and simdgroup operations
// have their real semantics: no thread passes a barrier until all threads of
// its threadgroup (or lanes of its simdgroup) have arrived at it. Guarded
// buffers and the C API are in msl_host_api.cpp.
//
// Between sync points the scheduler runs threads in a seeded random order,
// and threadgroup memory starts filled with NaN bytes, so a missing barrier
// shows up as reading another thread's data before it was written.
#include "msl_runtime.h"

#include "fiber_context.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

namespace msl_rt {

namespace {

size_t page_size() {
  static const size_t size = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

// ------------------------------------------------------------ state

enum class State { Runnable, AtBarrier, AtSimd, Done };

struct Fiber {
  Context ctx;
  ThreadIds ids{};
  State state = State::Runnable;
  SyncSite site{};
  size_t tg_allocs = 0;  // threadgroup arrays declared so far
};

struct SimdGroup {
  uint32_t lanes = 0;
  uint32_t arrived = 0;
  SyncSite site{};
  size_t bytes = 0;
  unsigned char slots[kSimdWidth][kMaxSimdBytes];
  unsigned char snapshot[kSimdWidth][kMaxSimdBytes];
};

struct Allocation {
  size_t offset, bytes;
};

// One OS thread's executor: runs threadgroups one at a time.
struct Worker {
  std::vector<Fiber> fibers;
  std::vector<SimdGroup> simdgroups;
  uint32_t barrier_arrived = 0;
  SyncSite barrier_site{};
  uint32_t done = 0;
  Context scheduler;
  Fiber* current = nullptr;
  KernelThunk thunk = nullptr;
  void* const* buffers = nullptr;
  std::vector<Allocation> allocations;
  size_t arena_used = 0;
  alignas(64) unsigned char arena[kThreadgroupMemoryLimit];
  char* stacks = nullptr;
  size_t stacks_count = 0;
  std::string error;
  uint64_t rng = 0;

  ~Worker() {
    if (stacks != nullptr) {
      munmap(stacks, stacks_count * (kStackBytes + page_size()));
    }
  }

  char* stack_top(size_t i) {
    return stacks + (i + 1) * (kStackBytes + page_size());
  }

  // One stack per thread, each above an inaccessible page that catches
  // overflows.
  void reserve_stacks(size_t count) {
    if (count <= stacks_count) {
      return;
    }
    const size_t stride = kStackBytes + page_size();
    if (stacks != nullptr) {
      munmap(stacks, stacks_count * stride);
    }
    void* p = mmap(nullptr, count * stride, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      throw std::runtime_error("msl executor: cannot map fiber stacks");
    }
    stacks = static_cast<char*>(p);
    stacks_count = count;
    for (size_t i = 0; i < count; ++i) {
      mprotect(stacks + i * stride, page_size(), PROT_NONE);
    }
  }

  uint64_t next_random() {  // xorshift64*
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return rng * 0x2545F4914F6CDD1DULL;
  }
};

thread_local Worker* tls_worker = nullptr;

Worker& worker() {
  if (tls_worker == nullptr || tls_worker->current == nullptr) {
    throw std::logic_error("msl executor: MSL runtime function called outside a kernel");
  }
  return *tls_worker;
}

bool same_site(const SyncSite& a, const SyncSite& b) {
  return a.line == b.line && a.column == b.column && std::strcmp(a.file, b.file) == 0 &&
      std::strcmp(a.what, b.what) == 0;
}

std::string describe(const SyncSite& s) {
  std::ostringstream os;
  os << s.what << " at " << s.file << ":" << s.line << ":" << s.column;
  return os.str();
}

std::string describe(const Dim3& d) {
  std::ostringstream os;
  os << "(" << d.x << ", " << d.y << ", " << d.z << ")";
  return os.str();
}

// Hands control back to the scheduler until this fiber is runnable again.
void yield(Worker& w, Fiber& f) {
  switch_context(f.ctx, w.scheduler);
}

void fiber_main() {
  Worker& w = *tls_worker;
  Fiber& f = *w.current;
  try {
    w.thunk(w.buffers, f.ids);
  } catch (const std::exception& e) {  // must not unwind past this frame
    w.error = e.what();
  }
  f.state = State::Done;
  ++w.done;
  switch_context(f.ctx, w.scheduler);
  __builtin_trap();  // a finished fiber is never resumed
}

std::string stall_report(const Worker& w) {
  std::map<std::string, int> waiting;
  int finished = 0;
  for (const auto& f : w.fibers) {
    if (f.state == State::Done) {
      ++finished;
    } else {
      ++waiting[describe(f.site)];
    }
  }
  std::ostringstream os;
  os << "threadgroup " << describe(w.fibers[0].ids.threadgroup_position_in_grid)
     << " can never continue (divergent barrier or simd operation): " << finished
     << " threads finished";
  for (const auto& [where, n] : waiting) {
    os << "; " << n << " wait at " << where;
  }
  return os.str();
}

void run_threadgroup(Worker& w, Dim3 tg, Dim3 grid, Dim3 group) {
  const uint32_t n = group.x * group.y * group.z;
  const uint32_t nsimd = (n + kSimdWidth - 1) / kSimdWidth;
  w.fibers.assign(n, Fiber{});
  w.simdgroups.resize(nsimd);
  for (uint32_t g = 0; g < nsimd; ++g) {
    w.simdgroups[g].lanes = std::min<uint32_t>(kSimdWidth, n - g * kSimdWidth);
    w.simdgroups[g].arrived = 0;
  }
  w.barrier_arrived = 0;
  w.done = 0;
  w.allocations.clear();
  w.arena_used = 0;
  std::memset(w.arena, 0xFF, sizeof(w.arena));
  w.reserve_stacks(n);

  for (uint32_t i = 0; i < n; ++i) {
    Fiber& f = w.fibers[i];
    ThreadIds& id = f.ids;
    id.thread_position_in_threadgroup = {i % group.x, (i / group.x) % group.y, i / (group.x * group.y)};
    id.threadgroup_position_in_grid = tg;
    id.threads_per_threadgroup = group;
    id.threadgroups_per_grid = grid;
    id.threads_per_grid = {grid.x * group.x, grid.y * group.y, grid.z * group.z};
    id.thread_position_in_grid = {tg.x * group.x + id.thread_position_in_threadgroup.x,
                                  tg.y * group.y + id.thread_position_in_threadgroup.y,
                                  tg.z * group.z + id.thread_position_in_threadgroup.z};
    id.thread_index_in_threadgroup = i;
    id.simdgroup_index_in_threadgroup = i / kSimdWidth;
    id.thread_index_in_simdgroup = i % kSimdWidth;
    id.simdgroups_per_threadgroup = nsimd;
    id.threads_per_simdgroup = kSimdWidth;
    make_context(f.ctx, w.stack_top(i), fiber_main);
  }

  std::vector<uint32_t> order(n);
  for (uint32_t i = 0; i < n; ++i) {
    order[i] = i;
  }
  while (w.done < n) {
    for (uint32_t i = n; i > 1; --i) {  // Fisher-Yates
      std::swap(order[i - 1], order[w.next_random() % i]);
    }
    bool ran = false;
    for (uint32_t i : order) {
      Fiber& f = w.fibers[i];
      if (f.state != State::Runnable) {
        continue;
      }
      w.current = &f;
      switch_context(w.scheduler, f.ctx);
      w.current = nullptr;
      ran = true;
      if (!w.error.empty()) {
        return;
      }
    }
    if (!ran && w.done < n) {
      w.error = stall_report(w);
      return;
    }
  }
}

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

std::map<std::string, KernelThunk>& registry() {
  static std::map<std::string, KernelThunk> r;
  return r;
}

} // namespace

// ------------------------------------------------------------ kernel-side API

const ThreadIds& current_ids() {
  return worker().current->ids;
}

void fail(const std::string& message) {
  Worker& w = worker();
  Fiber& f = *w.current;
  std::ostringstream os;
  os << "thread " << f.ids.thread_index_in_threadgroup << " of threadgroup "
     << describe(f.ids.threadgroup_position_in_grid) << ": " << message;
  w.error = os.str();
  yield(w, f);  // the scheduler sees the error and abandons the threadgroup
  __builtin_trap();
}

void threadgroup_barrier(SyncSite site) {
  Worker& w = worker();
  Fiber& f = *w.current;
  if (w.barrier_arrived == 0) {
    w.barrier_site = site;
  } else if (!same_site(site, w.barrier_site)) {
    fail("reached " + describe(site) + " while other threads wait at " +
         describe(w.barrier_site));
  }
  f.state = State::AtBarrier;
  f.site = site;
  if (++w.barrier_arrived == w.fibers.size()) {
    w.barrier_arrived = 0;
    for (auto& other : w.fibers) {
      other.state = State::Runnable;
    }
  }
  yield(w, f);
}

uint32_t simd_exchange(const void* mine, void* all, size_t bytes, SyncSite site) {
  Worker& w = worker();
  Fiber& f = *w.current;
  if (bytes > kMaxSimdBytes) {
    fail("simd operation on a value larger than the executor supports");
  }
  const uint32_t g_index = f.ids.simdgroup_index_in_threadgroup;
  SimdGroup& g = w.simdgroups[g_index];
  if (g.arrived == 0) {
    g.site = site;
    g.bytes = bytes;
  } else if (!same_site(site, g.site) || bytes != g.bytes) {
    fail("reached " + describe(site) + " while other lanes of its simdgroup wait at " +
         describe(g.site));
  }
  std::memcpy(g.slots[f.ids.thread_index_in_simdgroup], mine, bytes);
  f.state = State::AtSimd;
  f.site = site;
  if (++g.arrived == g.lanes) {
    // Snapshot, so lanes that run ahead into the next operation cannot
    // overwrite values the slower lanes have yet to read.
    std::memcpy(g.snapshot, g.slots, sizeof(g.slots));
    g.arrived = 0;
    for (uint32_t lane = 0; lane < g.lanes; ++lane) {
      w.fibers[g_index * kSimdWidth + lane].state = State::Runnable;
    }
  }
  yield(w, f);
  auto* out = static_cast<unsigned char*>(all);
  for (uint32_t lane = 0; lane < g.lanes; ++lane) {
    std::memcpy(out + lane * bytes, g.snapshot[lane], bytes);
  }
  return g.lanes;
}

void* threadgroup_alloc(size_t bytes, size_t align) {
  Worker& w = worker();
  Fiber& f = *w.current;
  const size_t k = f.tg_allocs++;
  if (k < w.allocations.size()) {
    if (w.allocations[k].bytes != bytes) {
      fail("threads of one threadgroup declared different threadgroup arrays");
    }
    return w.arena + w.allocations[k].offset;
  }
  if (k != w.allocations.size()) {
    fail("threadgroup array declarations out of order");
  }
  const size_t offset = (w.arena_used + align - 1) / align * align;
  if (offset + bytes > kThreadgroupMemoryLimit) {
    fail("threadgroup memory exceeds Metal's 32 KiB per threadgroup");
  }
  w.allocations.push_back({offset, bytes});
  w.arena_used = offset + bytes;
  return w.arena + offset;
}

// ------------------------------------------------------------ host-side API

KernelRegistration::KernelRegistration(const char* host_name, KernelThunk thunk) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[host_name] = thunk;
}

std::vector<std::string> kernel_names() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::string> names;
  for (const auto& entry : registry()) {
    names.push_back(entry.first);
  }
  return names;
}

KernelThunk find_kernel(const std::string& host_name) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(host_name);
  return it == registry().end() ? nullptr : it->second;
}

void dispatch_threadgroups(const std::string& kernel, void* const* buffers, Dim3 grid,
                           Dim3 group, const LaunchOptions& options) {
  const KernelThunk thunk = find_kernel(kernel);
  if (thunk == nullptr) {
    throw std::runtime_error("msl executor: no kernel instantiated as \"" + kernel + "\"");
  }
  const uint64_t threads = uint64_t(group.x) * group.y * group.z;
  if (threads == 0 || threads > kMaxThreadsPerThreadgroup) {
    throw std::runtime_error("msl executor: threadgroup of " + std::to_string(threads) +
                             " threads (Metal allows 1..1024)");
  }
  const uint64_t count = uint64_t(grid.x) * grid.y * grid.z;
  if (count == 0) {
    return;
  }

  // Workers are reused across launches (stacks stay mapped); launches are
  // serialised, as they would be on one command queue.
  static std::mutex launch_mutex;
  static std::vector<std::unique_ptr<Worker>> pool;
  std::lock_guard<std::mutex> lock(launch_mutex);
  const int workers = static_cast<int>(
      std::clamp<uint64_t>(uint64_t(std::max(options.workers, 1)), 1, count));
  while (pool.size() < size_t(workers)) {
    pool.push_back(std::make_unique<Worker>());
  }

  std::atomic<uint64_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex error_mutex;
  std::string first_error;
  auto work = [&](Worker& w) {
    tls_worker = &w;
    w.thunk = thunk;
    w.buffers = buffers;
    for (uint64_t i; !stop && (i = next++) < count;) {
      const Dim3 tg{uint32_t(i % grid.x), uint32_t((i / grid.x) % grid.y),
                    uint32_t(i / (uint64_t(grid.x) * grid.y))};
      w.rng = (options.seed + 1) * 0x9E3779B97F4A7C15ULL ^ (i + 1) * 0xD1B54A32D192ED03ULL;
      w.error.clear();
      try {
        run_threadgroup(w, tg, grid, group);
      } catch (const std::exception& e) {
        w.error = e.what();
      }
      if (!w.error.empty()) {
        std::lock_guard<std::mutex> elock(error_mutex);
        if (first_error.empty()) {
          first_error = kernel + ": " + w.error;
        }
        stop = true;
      }
    }
    tls_worker = nullptr;
  };
  std::vector<std::thread> threads_;
  for (int i = 1; i < workers; ++i) {
    threads_.emplace_back(work, std::ref(*pool[i]));
  }
  work(*pool[0]);
  for (auto& t : threads_) {
    t.join();
  }
  if (!first_error.empty()) {
    throw std::runtime_error(first_error);
  }
}

} // namespace msl_rt
