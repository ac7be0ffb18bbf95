// core/call_log.cpp: the kernel call log of core/call_log.h.
#include "core/call_log.h"

#include <mutex>
#include <utility>


namespace shardlab::call_log {
namespace {

std::mutex mutex;
std::vector<Call> calls;
thread_local int depth = 0;

}  // namespace

namespace detail {

void record(const char* op, Device device, std::vector<OperandLayout> operands) {
  const std::lock_guard lock(mutex);
  calls.push_back({op, device, std::move(operands)});
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

}  // namespace shardlab::call_log
