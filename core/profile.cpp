// core/profile.cpp: the kernel profiler's per-op totals (one mutex: kernels run on few threads),
// the GPU's timing spans until they resolve, and the split by category (each op's from its family,
// core/op_info.h).
#include "core/profile.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "core/op_info.h"

namespace shardlab::profile {

namespace {

struct Total {
  std::int64_t calls = 0;
  std::int64_t nanoseconds = 0;
  double device_seconds = 0;
};

// A span on a GPU whose end has not been seen to run yet.
struct PendingSpan {
  const char* op;
  std::unique_ptr<cuda::TimingSpan> span;
};

std::mutex mutex;
std::unordered_map<const char*, Total> by_name;  // keyed by the literal's address; merged by text
std::deque<PendingSpan> pending;                 // in the order they were queued
thread_local int depth = 0;                      // kernels running on this thread

constexpr const char* kTimingWait = "profile: the GPU's kernel times";

// Adds the spans that have run (all of them when `wait`); the lock is held.
void resolve_pending(bool wait) {
  std::erase_if(pending, [wait](PendingSpan& pending_span) {
    const std::optional<double> seconds =
        wait ? std::optional<double>(pending_span.span->wait_seconds(kTimingWait))
             : pending_span.span->seconds();
    if (!seconds) return false;
    by_name[pending_span.op].device_seconds += *seconds;
    return true;
  });
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void start() {
  std::lock_guard lock(mutex);
  by_name.clear();
  pending.clear();
  detail::enabled.store(true, std::memory_order_relaxed);
}

void stop() { detail::enabled.store(false, std::memory_order_relaxed); }

void resume() { detail::enabled.store(true, std::memory_order_relaxed); }

std::vector<OpTotal> totals() {
  std::map<std::string, OpTotal> merged;
  {
    std::lock_guard lock(mutex);
    resolve_pending(/*wait=*/true);
    for (const auto& [name, total] : by_name) {
      OpTotal& op = merged[name];
      op.op = name;
      op.calls += total.calls;
      op.seconds += static_cast<double>(total.nanoseconds) * 1e-9;
      op.device_seconds += total.device_seconds;
    }
  }
  std::vector<OpTotal> out;
  for (auto& [name, op] : merged) out.push_back(std::move(op));
  const auto time = [](const OpTotal& op) { return op.device_seconds > 0 ? op.device_seconds : op.seconds; };
  std::stable_sort(out.begin(), out.end(),
                   [&](const OpTotal& a, const OpTotal& b) { return time(a) > time(b); });
  return out;
}

void collect() {
  std::lock_guard lock(mutex);
  resolve_pending(/*wait=*/false);
}

void add_device_span(const char* op, std::unique_ptr<cuda::TimingSpan> span) {
  if (!on()) return;
  std::lock_guard lock(mutex);
  pending.push_back({op, std::move(span)});
}

void KernelTimer::begin(const char* op, Device device) {
  entered_ = true;
  if (depth++ > 0) return;  // inside another kernel: counted in its time
  op_ = op;
  device_ = device;
  if (device.is_cuda()) span_ = std::make_unique<cuda::TimingSpan>(cuda::current_stream(device.index));
  began_ns_ = now_ns();
}

void KernelTimer::end() {
  --depth;
  if (op_ == nullptr) return;
  const std::int64_t elapsed = now_ns() - began_ns_;
  if (span_) span_->stop(cuda::current_stream(device_.index));
  std::lock_guard lock(mutex);
  Total& total = by_name[op_];
  ++total.calls;
  total.nanoseconds += elapsed;
  if (span_) pending.push_back({op_, std::move(span_)});
}

std::string_view category_of(std::string_view op) {
  if (op.starts_with("nccl ")) return "communication";
  const OpInfo* info = find_op_info(op);
  return info == nullptr ? "other" : category_name(info->category);
}

std::vector<CategoryTotal> by_category(const std::vector<OpTotal>& totals, double step_seconds) {
  std::map<std::string_view, double> seconds;
  double compute = 0;
  for (const OpTotal& op : totals) {
    const std::string_view category = category_of(op.op);
    const double time = op.device_seconds > 0 ? op.device_seconds : op.seconds;
    seconds[category] += time;
    if (category != "communication") compute += time;
  }
  std::vector<CategoryTotal> out;
  for (const auto& [category, time] : seconds) out.push_back({std::string(category), time});
  std::stable_sort(out.begin(), out.end(),
                   [](const CategoryTotal& a, const CategoryTotal& b) { return a.seconds > b.seconds; });
  out.push_back({"host gaps", std::max(0.0, step_seconds - compute)});
  return out;
}

}  // namespace shardlab::profile
