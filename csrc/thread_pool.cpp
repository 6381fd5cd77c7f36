// Implementation of parallel_for on a lazily started pool of worker threads.
#include "thread_pool.h"

#include <atomic>
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
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      active_ = static_cast<int>(workers_.size());
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    work();  // the caller works too
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return active_ == 0; });
    fn_ = nullptr;
    if (error_) {
      std::rethrow_exception(error_);
    }
  }

 private:
  void work() {
    in_parallel_region = true;
    for (std::size_t i; (i = next_.fetch_add(1)) < n_;) {
      try {
        (*fn_)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) {
          error_ = std::current_exception();
        }
        next_.store(n_);  // stop handing out work
      }
    }
    in_parallel_region = false;
  }

  void worker_loop() {
    std::size_t seen = 0;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) {
          return;
        }
        seen = generation_;
      }
      work();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --active_;
      }
      done_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex job_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(std::size_t)>* fn_ = nullptr;
  std::size_t n_ = 0;
  std::atomic<std::size_t> next_{0};
  std::size_t generation_ = 0;
  int active_ = 0;
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
  if (n == 1 || in_parallel_region || cpu_thread_count() == 1) {
    for (std::size_t i = 0; i < n; ++i) {
      fn(i);
    }
    return;
  }
  pool().run(n, fn);
}

} // namespace vllm_metal
