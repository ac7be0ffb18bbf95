// core/host_wait.cpp: counting host waits by reason and refusing them inside a forbidding scope.
#include "core/host_wait.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "core/call_stack.h"
#include "core/error.h"
#include "core/notice.h"
#include "core/trace.h"

namespace shardlab {

namespace {

std::mutex counts_mutex;
std::vector<HostWaitCount> counts;

// The name of this thread's innermost HostWaitsForbidden scope, or nullptr outside any.
thread_local const std::string* innermost_scope = nullptr;
// The reason of this thread's innermost HostWaitsUnavoidable scope, or nullptr outside any.
thread_local const std::string* unavoidable_reason = nullptr;

void add_to_counts(std::string_view reason, std::string_view where) {
  {
    const std::lock_guard lock(counts_mutex);
    auto it = std::find_if(counts.begin(), counts.end(),
                           [&](const HostWaitCount& count) { return count.reason == reason; });
    if (it == counts.end()) it = counts.insert(counts.end(), HostWaitCount{std::string(reason), 0});
    ++it->count;
  }
  if (trace::on())
    trace::instant("host wait: " + std::string(reason), "wait", {{"device", std::string(where)}});
}

// SHARDLAB_HOST_WAIT_STACKS=1: where the waits come from. A refused wait's error ends with its call
// stack, and each call stack that waited is said once on stderr with the wait's reason.
bool stacks_wanted() {
  const char* text = std::getenv("SHARDLAB_HOST_WAIT_STACKS");
  return text != nullptr && std::string_view(text) == "1";
}

}  // namespace

HostWaitsForbidden::HostWaitsForbidden(std::string scope)
    : scope_(std::move(scope)), outer_(innermost_scope) {
  innermost_scope = &scope_;
}

HostWaitsForbidden::~HostWaitsForbidden() { innermost_scope = outer_; }

bool host_waits_forbidden() { return innermost_scope != nullptr; }

HostWaitsUnavoidable::HostWaitsUnavoidable(std::string reason)
    : reason_(std::move(reason)), outer_(unavoidable_reason) {
  unavoidable_reason = &reason_;
}

HostWaitsUnavoidable::~HostWaitsUnavoidable() { unavoidable_reason = outer_; }

void host_wait(std::string_view reason, std::string_view where) {
  if (unavoidable_reason != nullptr) {
    add_to_counts(*unavoidable_reason, where);
    return;
  }
  const std::string stack = stacks_wanted() ? call_stack(1) : std::string();
  SHARDLAB_CHECK(innermost_scope == nullptr,
                 "host wait inside '{}': {} on {} would block the host until the device's queued work "
                 "has run; do it outside the scope (after the step), or keep the value on the device{}{}",
                 *innermost_scope, reason, where, stack.empty() ? "" : "; called from:\n", stack);
  if (!stack.empty())
    notice_once(std::string(reason) + stack,
                fmt::format("host wait: {} on {}, called from:\n{}", reason, where, stack));
  add_to_counts(reason, where);
}

std::vector<HostWaitCount> host_wait_counts() {
  const std::lock_guard lock(counts_mutex);
  return counts;
}

std::int64_t host_wait_total() {
  const std::lock_guard lock(counts_mutex);
  std::int64_t total = 0;
  for (const HostWaitCount& count : counts) total += count.count;
  return total;
}

void reset_host_wait_counts() {
  const std::lock_guard lock(counts_mutex);
  counts.clear();
}

}  // namespace shardlab
