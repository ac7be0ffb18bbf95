// apps/support/step_profile.cpp: the kernels' time per op over the profiled steps.
#include "apps/support/step_profile.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "core/profile.h"
#include "dist/comm/log.h"

namespace shardlab::apps {

void StepProfile::begin_step(std::int64_t step) {
  if (!enabled_ || step < 2) return;
  if (started_) {
    profile::resume();
  } else {
    profile::start();
    started_ = true;
  }
  in_step_ = true;
  began_ = trace::Clock::now();
}

void StepProfile::end_step() {
  if (!in_step_) return;
  profile::stop();
  profile::collect();  // the GPU's times known by now: the events in flight stay about a step's
  seconds_ += std::chrono::duration<double>(trace::Clock::now() - began_).count();
  ++steps_;
  in_step_ = false;
}

namespace {

// Each op's calls and milliseconds per step and share of it; on a GPU, its launches on the host and
// its kernels on the device.
std::string op_table(const std::vector<profile::OpTotal>& totals, double steps, double seconds,
                     bool on_device) {
  std::string table =
      fmt::format("  {:<28} {:>10} {:>10} {:>8}{}\n", "op", "calls", on_device ? "host ms" : "ms", "% step",
                  on_device ? fmt::format(" {:>10} {:>8}", "GPU ms", "% step") : "");
  double host = 0, device = 0;
  for (const profile::OpTotal& op : totals) {
    host += op.seconds;
    device += op.device_seconds;
    table += fmt::format("  {:<28} {:>10.1f} {:>10.3f} {:>7.1f}%{}\n", op.op,
                         static_cast<double>(op.calls) / steps, 1e3 * op.seconds / steps,
                         100 * op.seconds / seconds,
                         on_device ? fmt::format(" {:>10.3f} {:>7.1f}%", 1e3 * op.device_seconds / steps,
                                                 100 * op.device_seconds / seconds)
                                   : "");
  }
  table += fmt::format(
      "  {:<28} {:>10} {:>10.3f} {:>7.1f}%{}\n", "all kernels", "", 1e3 * host / steps, 100 * host / seconds,
      on_device ? fmt::format(" {:>10.3f} {:>7.1f}%", 1e3 * device / steps, 100 * device / seconds) : "");
  table += fmt::format("  {:<28} {:>10} {:>10.3f} {:>7.1f}%", "outside kernels", "",
                       1e3 * (seconds - host) / steps, 100 * (seconds - host) / seconds);
  return table;
}

// Where a step goes by category (profile::by_category), in milliseconds per step and share of it.
std::string category_table(const std::vector<profile::CategoryTotal>& categories, double steps,
                           double seconds) {
  std::string table = fmt::format("  {:<28} {:>10} {:>8}", "by category", "ms", "% step");
  for (const profile::CategoryTotal& category : categories) {
    table += fmt::format("\n  {:<28} {:>10.3f} {:>7.1f}%", category.category, 1e3 * category.seconds / steps,
                         100 * category.seconds / seconds);
  }
  return table;
}

}  // namespace

void StepProfile::report(const char* program, const MetricsFile* metrics, int rank) const {
  if (steps_ == 0) return;
  const std::vector<profile::OpTotal> totals = profile::totals();
  const std::vector<profile::CategoryTotal> categories = profile::by_category(totals, seconds_);
  const bool on_device = std::any_of(totals.begin(), totals.end(),
                                     [](const profile::OpTotal& op) { return op.device_seconds > 0; });
  const double steps = static_cast<double>(steps_);
  dist::log("{}: rank {}'s kernel time per step ({} steps after the first, {:.2f} ms each){}:\n{}\n{}",
            program, rank, steps_, 1e3 * seconds_ / steps,
            on_device ? "; on the GPU, what its kernels took, from timing events" : "",
            op_table(totals, steps, seconds_, on_device), category_table(categories, steps, seconds_));
  if (metrics != nullptr) {
    nlohmann::json ops = nlohmann::json::array(), split = nlohmann::json::array();
    for (const profile::OpTotal& op : totals) {
      ops.push_back({{"op", op.op},
                     {"calls", op.calls},
                     {"seconds", op.seconds},
                     {"device_seconds", op.device_seconds}});
    }
    for (const profile::CategoryTotal& category : categories)
      split.push_back({{"category", category.category}, {"seconds", category.seconds}});
    metrics->write({{"rank", rank},
                    {"profile_steps", steps_},
                    {"profile_seconds", seconds_},
                    {"kernels", ops},
                    {"categories", split}});
  }
}

}  // namespace shardlab::apps
