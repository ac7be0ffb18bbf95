// apps/support/step_trace.h: --trace and --trace-steps: the chosen steps recorded on every rank.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "apps/support/metrics_file.h"
#include "core/trace.h"
#include "dist/comm/communicator.h"
#include "dist/fsdp/trace.h"

namespace shardlab::apps {

// --trace-steps FIRST:LAST: the steps (counted from 1, both included) that --trace records; refused
// unless 1 <= FIRST <= LAST <= total_steps.
struct TraceSteps {
  std::int64_t first = 2, last = 3;
};
TraceSteps parse_trace_steps(const std::string& text, std::int64_t total_steps);

// --trace DIR: records the steps `steps` selects on every rank (dist/fsdp/trace.h), then writes the
// trace files and keeps the figures per step for report(). Off (empty DIR), each call is a branch.
//   trace.begin_step(step + 1);  ... the step ...  trace.end_step();
class StepTrace {
 public:
  // Creates `dir` (when given) first, a collective: a directory that cannot be made fails before step 1.
  StepTrace(std::string dir, TraceSteps steps, dist::Communicator& comm);

  void begin_step(std::int64_t step);
  void end_step();
  // Prints rank 0's figures and writes every rank's to `metrics` (when given), one line per step.
  void report(const char* program, const MetricsFile* metrics) const;
  const std::vector<dist::StepFigures>& figures() const { return figures_; }  // this rank's, per traced step

 private:
  std::string dir_;
  TraceSteps steps_;
  dist::Communicator* comm_;
  std::int64_t step_ = 0;  // the step being recorded, 0 when none
  trace::Clock::time_point step_began_;
  std::vector<dist::StepFigures> figures_;
};

}  // namespace shardlab::apps
