// Implementation of parallel_for on a lazily started pool of worker threads.
#include "thread_pool.h"

#include <atomic>
#include <cstdint>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <pthread.h>
#include <thread>
#include <vector>

namespace vllm_metal {

namespace {

thread_local bool in_parallel_region = false;

// Tasks are claimed from one counter tagged with the job's generation, and
// the caller waits for the job's tasks, not for the workers: a worker that
// has not woken up yet (its core busy with another process: the API server,
// the benchmark client) holds nothing up, since the caller takes every task
// left. A late worker finds the counter at the end of its job, or tagged
// with a newer one, and claims nothing of a job it did not see start.
class ThreadPool {
 public:
  explicit ThreadPool(int num_workers) {
    for (int i = 0; i < num_workers; ++i) {
      workers_.emplace_back([this] { worker_loop(); });
    }
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) {
      w.join();
    }
  }

  // One job at a time: the MLX CPU stream is a single thread, and the lock
  // keeps a second stream (or a test thread) from interleaving jobs.
  void run(std::size_t n, const std::function<void(std::size_t)>& fn) {
    std::lock_guard<std::mutex> job_lock(job_mutex_);
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      gen = (generation_ + 1) & kGenerationMask;
      generation_ = gen;
      fn_ = &fn;
      n_ = n;
      error_ = nullptr;
      done_.store(0);
      ticket_.store(gen << 32);
    }
    wake_.notify_all();
    work(gen, &fn, n);  // the caller works too, until no task is left
    // Then waits for the tasks others claimed: briefly spinning (they are
    // short), then sleeping.
    for (int i = 0; i < kSpins && done_.load(std::memory_order_acquire) != n; ++i) {
      cpu_relax();
    }
    std::unique_lock<std::mutex> lock(mutex_);
    finished_.wait(lock, [&] { return done_.load(std::memory_order_acquire) == n; });
    fn_ = nullptr;
    if (error_) {
      std::rethrow_exception(error_);
    }
  }

 private:
  static constexpr uint64_t kGenerationMask = 0xffffffffu;
  static constexpr int kSpins = 2000;

  static void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_ia32_pause();
#endif
  }

  // Claims and runs tasks of job `gen` while any is left.
  void work(uint64_t gen, const std::function<void(std::size_t)>* fn, std::size_t n) {
    in_parallel_region = true;
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while ((t >> 32) == gen && (t & kGenerationMask) < n) {
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
        continue;  // t reloaded
      }
      const std::size_t i = t & kGenerationMask;
      try {
        (*fn)(i);
      } catch (...) {
        {
          std::lock_guard<std::mutex> lock(mutex_);
          if (!error_) {
            error_ = std::current_exception();
          }
        }
        stop(gen, n);
      }
      finish(1, n);
      t = ticket_.load(std::memory_order_acquire);
    }
    in_parallel_region = false;
  }

  // After an error: no more tasks handed out; the ones never claimed count as done.
  void stop(uint64_t gen, std::size_t n) {
    uint64_t t = ticket_.load();
    while ((t >> 32) == gen && (t & kGenerationMask) < n) {
      if (ticket_.compare_exchange_weak(t, (gen << 32) | n)) {
        finish(n - (t & kGenerationMask), n);
        return;
      }
    }
  }

  void finish(std::size_t tasks, std::size_t n) {
    if (done_.fetch_add(tasks, std::memory_order_acq_rel) + tasks == n) {
      std::lock_guard<std::mutex> lock(mutex_);  // the caller checks under it
      finished_.notify_one();
    }
  }

  void worker_loop() {
    uint64_t seen = 0;
    while (true) {
      const std::function<void(std::size_t)>* fn;
      std::size_t n;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) {
          return;
        }
        seen = generation_;
        fn = fn_;
        n = n_;
      }
      if (fn != nullptr) {
        work(seen, fn, n);
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex job_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable finished_;
  const std::function<void(std::size_t)>* fn_ = nullptr;
  std::size_t n_ = 0;
  std::atomic<uint64_t> ticket_{0};  // job generation << 32 | next task
  std::atomic<std::size_t> done_{0};
  uint64_t generation_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
};

// Leaked on purpose: joining threads during static destruction at interpreter
// exit can deadlock; the OS reclaims them. A forked child has none of the
// parent's threads, so it forgets the parent's pool and starts its own.
std::atomic<ThreadPool*> the_pool{nullptr};
std::mutex pool_init_mutex;

ThreadPool& pool() {
  if (auto* p = the_pool.load()) {
    return *p;
  }
  std::lock_guard<std::mutex> lock(pool_init_mutex);
  if (!the_pool.load()) {
    static const bool registered = [] {
      pthread_atfork(nullptr, nullptr, [] { the_pool.store(nullptr); });
      return true;
    }();
    (void)registered;
    the_pool.store(new ThreadPool(cpu_thread_count() - 1));
  }
  return *the_pool.load();
}

} // namespace

int cpu_thread_count() {
  static const int count = [] {
    if (const char* env = std::getenv("VLLM_METAL_CPU_THREADS")) {
      int v = std::atoi(env);
      if (v >= 1) {
        return v;
      }
    }
    unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : static_cast<int>(hw);
  }();
  return count;
}

void parallel_for(std::size_t n, const std::function<void(std::size_t)>& fn) {
  if (n == 0) {
    return;
  }
  if (n == 1 || in_parallel_region || cpu_thread_count() == 1 || n > 0xffffffffu) {
    for (std::size_t i = 0; i < n; ++i) {
      fn(i);
    }
    return;
  }
  pool().run(n, fn);
}

} // namespace vllm_metal
