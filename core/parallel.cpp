// core/parallel.cpp: a small fixed thread pool for CPU kernels, sized per process.
#include "core/parallel.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"

namespace shardlab {
namespace {

thread_local bool inside_parallel_region = false;

int cores_given_to_process() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) {
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }
  return std::max(1, CPU_COUNT(&set));
}

int default_thread_count() {
  if (const char* text = std::getenv("SHARDLAB_NUM_THREADS")) {
    const int threads = std::atoi(text);
    SHARDLAB_CHECK(threads > 0, "SHARDLAB_NUM_THREADS must be a positive integer, got '{}'", text);
    return threads;
  }
  const int cores = cores_given_to_process();
  // A process that mpirun did not pin sees every core of the node; share them among the
  // node's ranks so two ranks on two cores use one each instead of fighting over both.
  const char* local_size = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const int hardware = static_cast<int>(std::thread::hardware_concurrency());
  if (local_size != nullptr && cores == hardware) {
    return std::max(1, cores / std::max(1, std::atoi(local_size)));
  }
  return cores;
}

// How long a worker waits for the next task, and parallel_for for its last chunk, by spinning before
// they sleep on a condition variable. Waking a sleeping thread costs 50-90 us on a 2-core VM (two
// futex calls and the scheduler's latency), more than many kernels take; the host's gap between two
// kernels of a step is a few microseconds, so spinning this long wakes the pool once a step instead
// of once a kernel, and gives the cores back within 100 us of the last kernel. A pool with more
// threads than the process has cores sleeps at once instead (as libgomp cuts its spin count then):
// a thread spinning for one that has no core to run on only delays it.
constexpr auto kSpin = std::chrono::microseconds(100);

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins until ready() or `spin` has passed; whether ready() held.
template <typename Ready>
bool spin_until(std::chrono::microseconds spin, Ready ready) {
  if (spin.count() == 0) return ready();
  const auto deadline = std::chrono::steady_clock::now() + spin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= deadline) return ready();
  }
}

class ThreadPool {
 public:
  explicit ThreadPool(int threads) { start(threads); }
  ~ThreadPool() { stop(); }

  int size() const { return size_; }
  std::chrono::microseconds spin() const { return spin_; }

  void resize(int threads) {
    stop();
    start(threads);
  }

  void submit(std::function<void()> task) {
    bool someone_sleeps = false;
    {
      std::lock_guard lock(mutex_);
      tasks_.push_back(std::move(task));
      queued_.store(tasks_.size(), std::memory_order_release);
      someone_sleeps = sleeping_ > 0;
    }
    if (someone_sleeps) wake_.notify_one();
  }

 private:
  void start(int threads) {
    size_ = threads;
    spin_ = threads <= cores_given_to_process() ? kSpin : std::chrono::microseconds(0);
    stopping_.store(false);
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }

  void stop() {
    {
      std::lock_guard lock(mutex_);
      stopping_.store(true);
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
    workers_.clear();
  }

  void work() {
    inside_parallel_region = true;  // nested parallel_for in a worker runs serially
    for (;;) {
      const bool seen = spin_until(spin_, [this] {
        return queued_.load(std::memory_order_acquire) > 0 || stopping_.load(std::memory_order_acquire);
      });
      std::function<void()> task;
      {
        std::unique_lock lock(mutex_);
        if (tasks_.empty() && !stopping_) {
          if (seen) continue;  // another worker took it: spin again
          ++sleeping_;
          wake_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
          --sleeping_;
        }
        if (tasks_.empty()) return;  // stopping, nothing left
        task = std::move(tasks_.front());
        tasks_.pop_front();
        queued_.store(tasks_.size(), std::memory_order_release);
      }
      task();
    }
  }

  int size_ = 1;
  std::chrono::microseconds spin_{0};  // kSpin, or 0 when the threads outnumber the cores
  std::atomic<bool> stopping_ = false;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> tasks_;
  std::atomic<std::size_t> queued_ = 0;  // tasks_.size(), read by spinning workers without the mutex
  int sleeping_ = 0;                     // workers waiting on wake_ (under mutex_)
  std::vector<std::thread> workers_;
};

std::mutex pool_mutex;

ThreadPool& pool() {
  static ThreadPool instance(default_thread_count());
  return instance;
}

// Completion of one parallel_for: chunks left and the first exception thrown.
class Job {
 public:
  explicit Job(std::int64_t chunks) : remaining_(chunks) {}

  void finish(std::exception_ptr chunk_error) {
    if (chunk_error) {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = chunk_error;
    }
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard lock(mutex_);  // a waiter checks remaining_ under it: the notify cannot fall between
      done_.notify_all();
    }
  }

  // Waits for every chunk, spinning up to `spin` first; rethrows the first exception one threw.
  void wait(std::chrono::microseconds spin) {
    const auto finished = [this] { return remaining_.load(std::memory_order_acquire) == 0; };
    if (!spin_until(spin, finished)) {
      std::unique_lock lock(mutex_);
      done_.wait(lock, finished);
    }
    std::lock_guard lock(mutex_);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::atomic<std::int64_t> remaining_;
  std::mutex mutex_;
  std::condition_variable done_;
  std::exception_ptr error_;
};

}  // namespace

int num_threads() { return pool().size(); }

void set_num_threads(int threads) {
  SHARDLAB_CHECK(threads > 0, "set_num_threads: need at least 1 thread, got {}", threads);
  std::lock_guard lock(pool_mutex);
  pool().resize(threads);
}

void parallel_for(std::int64_t begin, std::int64_t end, std::int64_t grain,
                  const std::function<void(std::int64_t, std::int64_t)>& fn) {
  const std::int64_t count = end - begin;
  if (count <= 0) return;
  const std::int64_t max_chunks =
      (count + std::max<std::int64_t>(grain, 1) - 1) / std::max<std::int64_t>(grain, 1);
  const std::int64_t chunks = std::min<std::int64_t>(pool().size(), max_chunks);
  if (chunks <= 1 || inside_parallel_region) {
    fn(begin, end);
    return;
  }
  auto job = std::make_shared<Job>(chunks);
  const auto chunk_range = [&](std::int64_t chunk) {
    return std::pair{begin + count * chunk / chunks, begin + count * (chunk + 1) / chunks};
  };
  auto run_chunk = [job, &fn](std::int64_t lo, std::int64_t hi) {
    std::exception_ptr error;
    try {
      fn(lo, hi);
    } catch (...) {
      error = std::current_exception();
    }
    job->finish(error);
  };
  for (std::int64_t chunk = 1; chunk < chunks; ++chunk) {
    // Not a structured binding: clang before 16 cannot capture one (the fuzz build uses clang 14).
    const std::pair<std::int64_t, std::int64_t> range = chunk_range(chunk);
    pool().submit([run_chunk, range] { run_chunk(range.first, range.second); });
  }
  inside_parallel_region = true;
  const auto [lo, hi] = chunk_range(0);
  run_chunk(lo, hi);
  inside_parallel_region = false;
  job->wait(pool().spin());
}

}  // namespace shardlab
