// apps/support/non_finite.h: skipping steps whose loss or gradient norm is not finite.
#pragma once

#include <cstdint>

#include "apps/support/checkpoint_dir.h"

namespace shardlab::apps {

// Steps whose loss or global gradient norm is not finite (a NaN or an overflow somewhere in forward
// or backward). Such a step is skipped: the parameters and the optimizer state stay as they were
// (the step still counts: its batch is consumed and the schedule moves on, as PyTorch's GradScaler
// does). Each skip is counted and logged; more than `limit` in a row stop the run with an error that
// names the newest checkpoint to resume from. The loss and the norm must be sums over the ranks, so
// that every rank skips, or stops, at the same step.
class NonFiniteSteps {
 public:
  NonFiniteSteps(const char* program, std::int64_t limit) : program_(program), limit_(limit) {}

  // Whether step `step` (from 1) is skipped: when not `finite` (its loss and gradient norm, as the
  // device found them, the values named in the log); throws when it is one more than `limit` in a row.
  bool skip(std::int64_t step, bool finite, double loss, double grad_norm, const CheckpointDir& checkpoints);
  std::int64_t skipped() const { return skipped_; }
  // Logs how many steps were skipped, when any were.
  void report() const;

 private:
  const char* program_;
  std::int64_t limit_;
  std::int64_t in_a_row_ = 0, skipped_ = 0;
};

}  // namespace shardlab::apps
