// core/profile.cpp: the kernel profiler's per-op totals (one mutex: kernels run on few threads).
#include "core/profile.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <unordered_map>

namespace shardlab::profile {

namespace {

struct Total {
  std::int64_t calls = 0;
  std::int64_t nanoseconds = 0;
};

std::mutex mutex;
std::unordered_map<const char*, Total> by_name;  // keyed by the literal's address; merged by text
thread_local int depth = 0;                      // kernels running on this thread

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void start() {
  std::lock_guard lock(mutex);
  by_name.clear();
  detail::enabled.store(true, std::memory_order_relaxed);
}

void stop() { detail::enabled.store(false, std::memory_order_relaxed); }

void resume() { detail::enabled.store(true, std::memory_order_relaxed); }

std::vector<OpTotal> totals() {
  std::map<std::string, OpTotal> merged;
  {
    std::lock_guard lock(mutex);
    for (const auto& [name, total] : by_name) {
      OpTotal& op = merged[name];
      op.op = name;
      op.calls += total.calls;
      op.seconds += static_cast<double>(total.nanoseconds) * 1e-9;
    }
  }
  std::vector<OpTotal> out;
  for (auto& [name, op] : merged) out.push_back(std::move(op));
  std::stable_sort(out.begin(), out.end(),
                   [](const OpTotal& a, const OpTotal& b) { return a.seconds > b.seconds; });
  return out;
}

void KernelTimer::begin(const char* op) {
  entered_ = true;
  if (depth++ > 0) return;  // inside another kernel: counted in its time
  op_ = op;
  began_ns_ = now_ns();
}

void KernelTimer::end() {
  --depth;
  if (op_ == nullptr) return;
  const std::int64_t elapsed = now_ns() - began_ns_;
  std::lock_guard lock(mutex);
  Total& total = by_name[op_];
  ++total.calls;
  total.nanoseconds += elapsed;
}

}  // namespace shardlab::profile
