// core/profile.h: the kernel profiler: while it is on, every kernel call (the op layer's, Tensor's
// fill and copy, the random draws) is timed and summed per op name, which answers "where does the
// step go" as a per-op table, and by category (GEMM, attention, elementwise, ...). Off, a kernel
// call costs one relaxed load. Only the outermost kernel of a thread is timed, so a kernel that runs
// others is not counted twice. CUDA kernels run asynchronously: the host clock times their launch,
// and a pair of CUDA timing events around each call on its stream times the GPU's work, resolved
// later without waiting (collect) or at the end (totals).
//
//   profile::start();  train some steps (profile::collect() between them);  profile::stop();
//   for (const profile::OpTotal& op : profile::totals()) ...  // largest total first
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/cuda/runtime.h"
#include "core/device.h"

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
  double seconds = 0;         // on the host clock: on a GPU, the launches
  double device_seconds = 0;  // on the GPU, between timing events around its kernels; 0 on the CPU
};
// The totals since start(), one per op name, the largest time first (the device's where there is
// one). Waits for the GPU work still to be timed (a host wait).
std::vector<OpTotal> totals();
// Adds the device times that are known by now, without waiting: called between steps, it keeps
// the timing events in flight to about a step's.
void collect();

// Work timed on a stream of its own (a collective on its communication stream): its span joins the
// totals under `op` (a literal) once it has run. Only while the profiler is on.
void add_device_span(const char* op, std::unique_ptr<cuda::TimingSpan> span);

// Times the kernel call in its scope, under `op` (a string that outlives the profile: a literal),
// on `device` (a GPU: also with timing events on the thread's current stream of it).
class KernelTimer {
 public:
  explicit KernelTimer(const char* op, Device device = Device::cpu()) {
    if (on()) begin(op, device);
  }
  ~KernelTimer() {
    if (entered_) end();
  }
  KernelTimer(const KernelTimer&) = delete;
  KernelTimer& operator=(const KernelTimer&) = delete;

 private:
  void begin(const char* op, Device device);
  void end();
  bool entered_ = false;      // profiling was on at construction
  const char* op_ = nullptr;  // null: inside another kernel, not timed
  std::int64_t began_ns_ = 0;
  Device device_;
  std::unique_ptr<cuda::TimingSpan> span_;  // on a GPU
};

// The part of a step an op's kernels belong to: "GEMM", "attention", "elementwise", "reductions",
// "indexing", "optimizer", "communication" (collectives, "nccl <op>") or "other".
std::string_view category_of(std::string_view op);

struct CategoryTotal {
  std::string category;
  double seconds = 0;
};
// Where `step_seconds` (the profiled steps' wall time) went, by category, the largest first: each op's
// device time where it has one, else its host time; then "host gaps", the time no compute kernel
// covers (on a GPU, its compute stream idle while the host prepares work; collectives overlap the
// compute and are not subtracted). Never negative.
std::vector<CategoryTotal> by_category(const std::vector<OpTotal>& totals, double step_seconds);

}  // namespace shardlab::profile
