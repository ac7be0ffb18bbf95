// dist/comm/fault_injection.cpp: parsing SHARDLAB_INJECT_FAULT and acting on the chosen collective.
#include "dist/comm/fault_injection.h"

#include <unistd.h>

#include <atomic>
#include <charconv>
#include <csignal>
#include <limits>
#include <mutex>

#include "core/error.h"
#include "core/ops.h"
#include "dist/comm/log.h"

namespace shardlab::dist {

namespace {

std::mutex armed_mutex;
std::optional<FaultInjection> armed;  // only on the rank that misbehaves
std::atomic<bool> any_armed{false};   // the one branch every collective pays
std::uint64_t matching_calls = 0;

template <typename Number>
Number parse_number(std::string_view field, std::string_view value, std::string_view text) {
  Number number{};
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), number);
  SHARDLAB_CHECK(error == std::errc() && end == value.data() + value.size(),
                 "SHARDLAB_INJECT_FAULT='{}': {} must be a whole number, not '{}'", text, field, value);
  return number;
}

}  // namespace

std::optional<FaultInjection> parse_fault_injection(std::string_view text) {
  if (text.empty()) return std::nullopt;
  FaultInjection fault;
  bool has_rank = false, has_call = false;
  std::size_t start = 0;
  for (int field = 0; start <= text.size(); ++field) {
    const std::size_t end = std::min(text.find(':', start), text.size());
    const std::string_view part = text.substr(start, end - start);
    start = end + 1;
    if (field == 0) {
      if (part == "kill")
        fault.action = FaultInjection::Action::kill;
      else if (part == "hang")
        fault.action = FaultInjection::Action::hang;
      else if (part == "nan")
        fault.action = FaultInjection::Action::nan;
      else
        fail("SHARDLAB_INJECT_FAULT='{}': the action '{}' is not one of kill, hang, nan", text, part);
      continue;
    }
    const std::size_t equals = part.find('=');
    SHARDLAB_CHECK(equals != std::string_view::npos,
                   "SHARDLAB_INJECT_FAULT='{}': '{}' is not KEY=VALUE (keys rank, call, tag)", text, part);
    const std::string_view key = part.substr(0, equals), value = part.substr(equals + 1);
    if (key == "rank") {
      fault.rank = parse_number<int>(key, value, text);
      has_rank = true;
    } else if (key == "call") {
      fault.call = parse_number<std::uint64_t>(key, value, text);
      SHARDLAB_CHECK(fault.call >= 1, "SHARDLAB_INJECT_FAULT='{}': call counts from 1, not 0", text);
      has_call = true;
    } else if (key == "tag") {
      fault.tag = std::string(value);  // a tag may hold anything but ':'
    } else {
      fail("SHARDLAB_INJECT_FAULT='{}': unknown key '{}' (keys rank, call, tag)", text, key);
    }
  }
  SHARDLAB_CHECK(has_rank && has_call, "SHARDLAB_INJECT_FAULT='{}': rank= and call= are required", text);
  return fault;
}

void arm_fault_injection(std::optional<FaultInjection> fault, int rank) {
  const std::lock_guard lock(armed_mutex);
  armed = fault && fault->rank == rank ? fault : std::nullopt;
  matching_calls = 0;
  any_armed.store(armed.has_value());
}

bool before_collective(const Fingerprint& fingerprint, const Tensor& input) {
  if (!any_armed.load(std::memory_order_relaxed)) return false;
  FaultInjection fault;
  {
    const std::lock_guard lock(armed_mutex);
    if (!armed || (!armed->tag.empty() && armed->tag != fingerprint.tag)) return false;
    if (++matching_calls != armed->call) return false;
    fault = *armed;
  }
  switch (fault.action) {
    case FaultInjection::Action::kill:
      return true;
    case FaultInjection::Action::hang:
      log_all("fault injection: hanging before {}", describe(fingerprint));
      for (;;) pause();
    case FaultInjection::Action::nan:
      SHARDLAB_CHECK(fingerprint.op == Collective::reduce_scatter || fingerprint.op == Collective::all_reduce,
                     "SHARDLAB_INJECT_FAULT: nan needs a reduce_scatter or all_reduce, and call {} is {}",
                     fault.call, describe(fingerprint));
      log_all("fault injection: NaN into {}", describe(fingerprint));
      input.fill_(std::numeric_limits<double>::quiet_NaN());
      return false;
  }
  return false;
}

void kill_after_collective(const Fingerprint& fingerprint) {
  log_all("fault injection: killing myself with SIGKILL in {}", describe(fingerprint));
  raise(SIGKILL);
  std::abort();  // SIGKILL cannot be caught: never reached
}

}  // namespace shardlab::dist
