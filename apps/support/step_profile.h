// apps/support/step_profile.h: --profile: where a step's time goes, op by op.
#pragma once

#include <cstdint>

#include "apps/support/metrics_file.h"
#include "core/trace.h"

namespace shardlab::apps {

// --profile: the kernels' time per op name (core/profile.h) over the steps after the first (which
// builds caches), next to the wall time of those steps from begin_step to end_step; evaluation
// and checkpoints between them are not counted. At the end, a table on rank 0 (where a step's time
// goes: each op's calls and milliseconds per step and share of it, and what no kernel accounts for:
// autograd, FSDP's bookkeeping, collectives, allocation) and every rank's totals in the metrics.
class StepProfile {
 public:
  explicit StepProfile(bool enabled) : enabled_(enabled) {}
  void begin_step(std::int64_t step);
  void end_step();
  void report(const char* program, const MetricsFile* metrics, int rank) const;

 private:
  bool enabled_;
  bool started_ = false, in_step_ = false;
  std::int64_t steps_ = 0;
  double seconds_ = 0;
  trace::Clock::time_point began_;
};

}  // namespace shardlab::apps
