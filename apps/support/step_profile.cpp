// apps/support/step_profile.cpp: the kernels' time per op over the profiled steps.
#include "apps/support/step_profile.h"

#include <fmt/format.h>

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
  seconds_ += std::chrono::duration<double>(trace::Clock::now() - began_).count();
  ++steps_;
  in_step_ = false;
}

void StepProfile::report(const char* program, const MetricsFile* metrics, int rank) const {
  if (steps_ == 0) return;
  const std::vector<profile::OpTotal> totals = profile::totals();
  const double steps = static_cast<double>(steps_), step_ms = 1e3 * seconds_ / steps;
  std::string table =
      fmt::format("{}: rank {}'s kernel time per step ({} steps after the first, {:.2f} ms each):\n", program,
                  rank, steps_, step_ms);
  table += fmt::format("  {:<28} {:>10} {:>10} {:>8}\n", "op", "calls", "ms", "% step");
  double kernel_seconds = 0;
  nlohmann::json ops = nlohmann::json::array();
  for (const profile::OpTotal& op : totals) {
    kernel_seconds += op.seconds;
    table +=
        fmt::format("  {:<28} {:>10.1f} {:>10.3f} {:>7.1f}%\n", op.op, static_cast<double>(op.calls) / steps,
                    1e3 * op.seconds / steps, 100 * op.seconds / seconds_);
    ops.push_back({{"op", op.op}, {"calls", op.calls}, {"seconds", op.seconds}});
  }
  table += fmt::format("  {:<28} {:>10} {:>10.3f} {:>7.1f}%\n", "all kernels", "",
                       1e3 * kernel_seconds / steps, 100 * kernel_seconds / seconds_);
  table +=
      fmt::format("  {:<28} {:>10} {:>10.3f} {:>7.1f}%", "outside kernels", "",
                  1e3 * (seconds_ - kernel_seconds) / steps, 100 * (seconds_ - kernel_seconds) / seconds_);
  dist::log("{}", table);
  if (metrics != nullptr) {
    metrics->write(
        {{"rank", rank}, {"profile_steps", steps_}, {"profile_seconds", seconds_}, {"kernels", ops}});
  }
}

}  // namespace shardlab::apps
