// core/call_log.cpp: the kernel call log of core/call_log.h.
#include "core/call_log.h"

#include <mutex>
#include <utility>

#include "core/op_cost.h"

namespace shardlab::call_log {
namespace {

std::mutex mutex;
std::vector<Call> calls;
thread_local int depth = 0;

}  // namespace

namespace detail {

void record(Call call) {
  call.label = innermost_cost_label();
  const std::lock_guard lock(mutex);
  calls.push_back(std::move(call));
}

bool enter() { return depth++ == 0; }
void leave() { --depth; }

}  // namespace detail

void start() {
  const std::lock_guard lock(mutex);
  calls.clear();
  detail::enabled.store(true, std::memory_order_relaxed);
}

std::vector<Call> stop() {
  detail::enabled.store(false, std::memory_order_relaxed);
  const std::lock_guard lock(mutex);
  return std::exchange(calls, {});
}

std::vector<Call> calls_of(const std::function<void()>& work) {
  start();
  try {
    work();
  } catch (...) {
    stop();
    throw;
  }
  return stop();
}

}  // namespace shardlab::call_log
