// core/profile.h: the kernel profiler: while it is on, every kernel call (the op layer's, Tensor's
// fill and copy, the random draws) is timed and summed per op name, which answers "where does the
// step go" as a per-op table. Off, a kernel call costs one relaxed load. Only the outermost kernel
// of a thread is timed, so a kernel that runs others is not counted twice. CUDA kernels run
// asynchronously: there it times the launch, not the kernel.
//
//   profile::start();  train some steps;  profile::stop();
//   for (const profile::OpTotal& op : profile::totals()) ...  // largest total first
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace shardlab::profile {

namespace detail {
inline std::atomic<bool> enabled{false};
}

inline bool on() { return detail::enabled.load(std::memory_order_relaxed); }
void start();  // clears the totals
void stop();
void resume();  // on again, keeping the totals

struct OpTotal {
  std::string op;
  std::int64_t calls = 0;
  double seconds = 0;
};
// The totals since start(), one per op name, the largest time first.
std::vector<OpTotal> totals();

// Times the kernel call in its scope, under `op` (a string that outlives the profile: a literal).
class KernelTimer {
 public:
  explicit KernelTimer(const char* op) {
    if (on()) begin(op);
  }
  ~KernelTimer() {
    if (entered_) end();
  }
  KernelTimer(const KernelTimer&) = delete;
  KernelTimer& operator=(const KernelTimer&) = delete;

 private:
  void begin(const char* op);
  void end();
  bool entered_ = false;      // profiling was on at construction
  const char* op_ = nullptr;  // null: inside another kernel, not timed
  std::int64_t began_ns_ = 0;
};

}  // namespace shardlab::profile
